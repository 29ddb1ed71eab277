"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p, min-p, seed) and
the logit processing before it (logit bias, min_tokens, presence/frequency/repetition penalties)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from cotserve.errors import RequestError
from cotserve.structured import STRUCTURED_KINDS

MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
# Temperatures below this decode greedily (as vLLM does): dividing logits by a tiny temperature
# overflows float32 and the softmax turns to NaN.
MIN_TEMPERATURE = 1e-5
SEED_MOD = 1 << 64  # torch generators take seeds in [0, 2**64); other integers wrap into it


def _finite(x: float) -> bool:
    """A finite number: False for NaN (every comparison with it is False) and the infinities."""
    return -math.inf < x < math.inf


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 (or below MIN_TEMPERATURE) means greedy. top_k 0 means no top-k cut. A seed
    (any integer; it wraps into [0, 2**64)) makes sampling reproducible: the same seed, prompt and
    batch give the same text. Without a seed a random one is drawn."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: each token's log-probability and the top k (k <= 20)
    seed_drawn: bool = False  # the seed was drawn by the server (for resuming), not asked by the client
    min_p: float = 0.0  # keep tokens whose probability is at least min_p times the top token's
    min_tokens: int = 0  # no end (EOS or stop_token_ids) before this many tokens
    presence_penalty: float = 0.0  # OpenAI: minus this once for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # vLLM/HF: logits of prompt and generated tokens divided (>0) or multiplied (<0)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    thinking_token_budget: int | None = None  # tokens inside <think> before </think> is forced (engine/thinking.py)
    structured: dict[str, Any] | None = None  # constrained output, {kind: value} as vLLM's structured outputs take it
    structured_field: str = "response_format"  # the request field that asked for it (named in a refusal)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", field="max_tokens")
        if not _finite(self.temperature) or self.temperature < 0:
            raise RequestError("temperature must be a finite number >= 0", field="temperature")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError("top_p must be in (0, 1]", field="top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0", field="top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", field="top_logprobs")
        if not (_finite(self.min_p) and 0 <= self.min_p <= 1):
            raise RequestError("min_p must be in [0, 1]", field="min_p")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens", field="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_finite(value) and -2 <= value <= 2):
                raise RequestError(f"{name} must be in [-2, 2]", field=name)
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise RequestError("thinking_token_budget must be >= 0", field="thinking_token_budget")
        if self.structured is not None and (not isinstance(self.structured, dict) or len(self.structured) != 1
                                            or next(iter(self.structured)) not in STRUCTURED_KINDS):
            raise RequestError(f"constrained output takes one of {', '.join(STRUCTURED_KINDS)}",
                               field=self.structured_field)
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError("repetition_penalty must be a finite number > 0", field="repetition_penalty")
        # JSON object keys are strings: a job's sampling settings carry {"123": -100}
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        for k, v in self.logit_bias.items():
            if k < 0 or not (_finite(v) and -100 <= v <= 100):
                raise RequestError("logit_bias maps token ids to biases in [-100, 100]", field="logit_bias")

    @property
    def processes_logits(self) -> bool:
        """Whether `process_logits` changes anything (at the defaults it is skipped: same tokens as ever)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def make_generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(int(self.seed) % SEED_MOD)
        else:
            gen.seed()
        return gen


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """`bias[id]` added to the logit of each token id of a [V] row (ids beyond the row are skipped)."""
    ids = [i for i in bias if i < logits.shape[-1]]
    if not ids:
        return logits
    idx = torch.tensor(ids, device=logits.device)
    add = torch.tensor([bias[i] for i in ids], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, idx, add)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], out_ids: list[int], presence: float,
                    frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's penalties on a [V] row. Repetition (HF/vLLM) over prompt and generated tokens: a
    positive logit is divided by `repetition`, a negative one multiplied. Then OpenAI's over the
    generated tokens: minus `frequency` times the token's count, minus `presence` once if it occurs."""
    vocab = logits.shape[-1]
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        ids = [t for t in (*prompt_ids, *out_ids) if 0 <= t < vocab]
        if ids:
            seen[torch.tensor(ids, device=logits.device)] = True
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    if (presence or frequency) and out_ids:
        ids = torch.tensor([t for t in out_ids if 0 <= t < vocab], dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], out_ids: list[int],
                   end_ids: set[int] | list[int] = ()) -> torch.Tensor:
    """One sequence's [V] logit row before sampling (greedy included): logit bias, then `end_ids`
    (EOS and stop_token_ids) masked while fewer than min_tokens are generated, then the penalties.
    The row is returned unchanged (the same tensor) at the defaults."""
    if not params.processes_logits:
        return logits
    logits = logits.float()
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    if len(out_ids) < params.min_tokens:
        ends = [t for t in (*end_ids, *params.stop_token_ids) if 0 <= t < logits.shape[-1]]
        if ends:
            logits = logits.index_fill(0, torch.tensor(sorted(set(ends)), device=logits.device), float("-inf"))
    return apply_penalties(logits, prompt_ids, out_ids, params.presence_penalty, params.frequency_penalty,
                           params.repetition_penalty)


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens of a [V] row whose probability is below min_p times the top one's."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of a [V] logit row."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from a [V] float logit row."""
    if params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = logits.float()
    # shift so the largest logit is 0 before dividing: no overflow to inf, so no NaN in the softmax
    scaled = filter_min_p((logits - logits.max()) / params.temperature, params.min_p)  # before top-k/p, as vLLM
    scaled = filter_logits(scaled, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` under the raw model distribution (log-softmax of a [V] logit row,
    before temperature and top-k/top-p) and the `top` most likely tokens with theirs."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    best: list[tuple[int, float]] = []
    if top > 0:
        vals, ids = torch.topk(lsm, top)
        best = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return float(lsm[token]), best
