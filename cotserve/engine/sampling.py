"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cotserve.errors import RequestError

MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
# Temperatures below this decode greedily (as vLLM does): dividing logits by a tiny temperature
# overflows float32 and the softmax turns to NaN.
MIN_TEMPERATURE = 1e-5
SEED_MOD = 1 << 64  # torch generators take seeds in [0, 2**64); other integers wrap into it


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", field="max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError("temperature must be a finite number >= 0", field="temperature")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError("top_p must be in (0, 1]", field="top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0", field="top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", field="top_logprobs")

    def make_generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(int(self.seed) % SEED_MOD)
        else:
            gen.seed()
        return gen


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
    scaled = filter_logits((logits - logits.max()) / params.temperature, params.top_k, params.top_p)
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
