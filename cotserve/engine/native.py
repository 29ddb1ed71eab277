"""The native engine: transformers model modules, cotserve's KV cache, a whole decode loop.

The model's own attention modules compute Q/K/V and RoPE; their attention call is routed (via
transformers' attention interface, implementation name "cotserve") to `cotserve_attention`,
which writes K/V into the preallocated `KVCache` and asks the batch's policy stack for the
output. The loop (prefill, sample, decode, stop) lives in `NativeEngine.stream`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cotserve.engine.decoder import LeanDecoder, route_attention
from cotserve.engine.sampling import SamplingParams, process_logits, sample_next, token_logprobs
from cotserve.engine.textproc import IncrementalDetokenizer, StopStringMatcher, encode_chat
from cotserve.engine.thinking import ThinkingBudget
from cotserve.errors import RequestError
from cotserve.grouping import length_groups
from cotserve.kv.batch import BatchState, ModelInfo
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.models import LoadedModel
from cotserve.policies.base import PolicyStack
from cotserve.policies.boundaries import think_ids
from cotserve.policies.registry import build_policy

ATTN_IMPL = "cotserve"


def cotserve_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention entry point registered with transformers' AttentionInterface.

    query [B, Hq, T, D], key/value [B, Hkv, T, D] (RoPE applied, this forward's tokens only).
    Without a cotserve batch in kwargs (e.g. a plain `model.generate`), behaves as SDPA."""
    batch: BatchState | None = kwargs.pop("cotserve_batch", None)
    if batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = route_attention(module.layer_idx, query, key, value, batch)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, cotserve_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    _registered = True


@dataclass
class GenRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extras: dict[str, Any] = field(default_factory=dict)  # per-request policy inputs (e.g. steering)
    # teacher forcing (fidelity benchmarks): feed these tokens instead of sampling; the model's own
    # greedy choice at each step is still recorded in Completion.greedy_ids
    forced_ids: list[int] | None = None
    record_logprobs: bool = False  # keep each step's log-softmax row (float32) in Completion.logprobs
    priority: int = 0  # the job's priority (lower first): vLLM's scheduler takes it when it runs priorities


@dataclass
class Delta:
    """New output of one request after one step."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    result: Completion | None = None
    # per token of token_ids when the request asked for logprobs: (logprob, [(id, logprob)] top-k)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # set when this request failed on its own (the engine goes on with the others): the client's message
    error: str | None = None
    refused: bool = False  # with `error`: the engine refused the request as invalid (a 400, not a 500)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    telemetry: dict[str, Any] = field(default_factory=dict)
    greedy_ids: list[int] = field(default_factory=list)  # argmax of the logits at each step
    logprobs: torch.Tensor | None = None  # [steps, V] float32 when record_logprobs was set


class NativeEngine:
    """Batched generation with cotserve's cache and policies on a transformers model."""

    def __init__(self, loaded: LoadedModel, max_batch: int = 8, cuda_graphs: bool = True, lean: bool = True,
                 share_prefill: bool = True):
        _register_attention()
        self.cuda_graphs = cuda_graphs
        self.share_prefill = share_prefill  # slots with the same prompt prefill once (prefill-shareable stacks)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # single-token <think>, </think> (None where absent, or where the engine has no tokenizer)
        self.think_ids = think_ids(self.tokenizer) if self.tokenizer is not None else (None, None)
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_batch = max_batch
        self.model.config._attn_implementation = ATTN_IMPL
        cfg = self.model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.info = ModelInfo(
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1 << 20),
            tokenizer=self.tokenizer,
            model_name=loaded.name,
            weight_dtype=loaded.weight_dtype,
        )
        self.scaling = self.model.model.layers[0].self_attn.scaling
        self.eos_ids = self._eos_ids()
        # the lean decoder stack (engine/decoder.py) when the model's layout allows it
        self.lean = LeanDecoder(self.model) if lean and LeanDecoder.supports(self.model) else None
        # optional (batch, logits [B, V]) -> logits, applied to every step's logits before sampling
        # (tests force known output text through it)
        self.logits_hook: Callable[[BatchState, torch.Tensor], torch.Tensor] | None = None

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return ids

    # -- prompt helpers -------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        if chat:
            return self.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    # -- forward --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: BatchState) -> torch.Tensor:
        """Run the decoder stack; returns the final-norm hidden states [B, T, H]. The lean stack
        (`decoder.LeanDecoder`) when the model allows it and `batch.lean` (no forward hook was
        registered in the decoder layers, the LM head or globally when the batch began: hooks
        only fire on the module path), else transformers' modules."""
        if self.lean is None or not batch.lean:
            return self.forward_reference(input_ids, position_ids, batch)
        hidden = self.lean.forward(input_ids, position_ids, batch)
        batch.hidden = hidden
        return hidden

    def _layers_hooked(self) -> bool:
        """Whether a forward hook would fire on the module path: one registered on any module of
        the decoder layers or the LM head, or a global module hook."""
        from torch.nn.modules import module as mod

        if mod._global_forward_hooks or mod._global_forward_pre_hooks:
            return True
        heads = [self.model.lm_head] if hasattr(self.model, "lm_head") else []
        return any(m._forward_hooks or m._forward_pre_hooks
                   for top in [*self.model.model.layers, *heads] for m in top.modules())

    def forward_reference(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: BatchState
                          ) -> torch.Tensor:
        """The decoder stack through transformers' own layer modules (attention routed to
        `cotserve_attention`): the reference the lean stack is tested against."""
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        pos_emb = inner.rotary_emb(hidden, position_ids=position_ids)
        for i, layer in enumerate(inner.layers):
            hidden = batch.policy.steer(i, hidden, batch)
            out = layer(hidden, attention_mask=None, position_ids=position_ids,
                        position_embeddings=pos_emb, cotserve_batch=batch)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = inner.norm(hidden)
        batch.hidden = hidden
        return hidden

    def logits(self, hidden: torch.Tensor, batch: BatchState) -> torch.Tensor:
        out = self.lean.logits(hidden) if self.lean is not None and batch.lean else None
        out = out if out is not None else self.model.lm_head(hidden).float()
        return out if self.logits_hook is None else self.logits_hook(batch, out)

    # -- generation -----------------------------------------------------------------------
    def check_request(self, req: GenRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", field="messages")
        if n >= self.info.max_positions:
            raise RequestError(
                f"prompt has {n} tokens; this model's context is {self.info.max_positions}",
                field="messages", code="context_length_exceeded",
            )
        if req.sampling.thinking_token_budget is not None and None in self.think_ids:
            raise RequestError("thinking_token_budget needs a model with <think> and </think> tokens; this one "
                               "has none", field="thinking_token_budget")
        if req.sampling.structured is not None:
            raise RequestError(f"{req.sampling.structured_field} is not supported on the native engine: structured "
                               "decoding (constrained output) is not implemented there; serve with --engine vllm "
                               "for it", field=req.sampling.structured_field)

    def thinking(self, req: GenRequest) -> ThinkingBudget | None:
        """The request's thinking budget state (None when it set none)."""
        budget = req.sampling.thinking_token_budget
        if budget is None or None in self.think_ids:
            return None
        return ThinkingBudget.start(budget, self.think_ids[0], self.think_ids[1], req.prompt_ids)

    def generate(self, requests: list[GenRequest], policy: str | PolicyStack | None = None,
                 options: dict[str, Any] | None = None) -> list[Completion]:
        """Run requests to completion; batches are formed from requests sorted by prompt length."""
        results: dict[str, Completion] = {}
        for group in group_by_length(requests, self.max_batch):
            for deltas in self.stream(group, policy, options):
                for d in deltas:
                    if d.result is not None:
                        results[d.request_id] = d.result
        return [results[r.request_id] for r in requests]

    @torch.inference_mode()
    def stream(self, requests: list[GenRequest], policy: str | PolicyStack | None = None,
               options: dict[str, Any] | None = None,
               cancelled: Callable[[str], bool] | None = None) -> Iterator[list[Delta]]:
        """Generate one batch; yields the deltas of each step. The last delta of each request
        carries its `Completion`. `cancelled(request_id)` is polled every step."""
        if not requests:
            return
        for r in requests:
            self.check_request(r)
        stack = policy if isinstance(policy, PolicyStack) else build_policy(policy, options)
        bsz = len(requests)
        prompt_lens = [len(r.prompt_ids) for r in requests]
        max_new = [min(r.sampling.max_tokens, self.info.max_positions - n) for r, n in zip(requests, prompt_lens, strict=True)]
        capacity = stack.capacity(prompt_lens, max(max_new))
        cache = KVCache(CacheShape(self.info.num_layers, bsz, self.info.num_kv_heads, capacity, self.info.head_dim),
                        self.dtype, self.device)
        plen_t = torch.tensor(prompt_lens, device=self.device)
        batch = BatchState(info=self.info, cache=cache, policy=stack, scaling=self.scaling, prompt_lens=plen_t,
                           tokens=[list(r.prompt_ids) for r in requests],
                           active=torch.ones(bsz, dtype=torch.bool, device=self.device),
                           extras={i: r.extras for i, r in enumerate(requests)},
                           lean=not self._layers_hooked(),  # checked once per batch, not per step
                           cuda_graphs=self.cuda_graphs and self.device.type == "cuda")
        stack.begin(batch)

        # prefill: one right-padded block (exact under a causal mask)
        t_start = time.perf_counter()
        tmax = max(prompt_lens)
        ids = torch.full((bsz, tmax), self.eos_default(), dtype=torch.long, device=self.device)
        for i, r in enumerate(requests):
            ids[i, : prompt_lens[i]] = torch.tensor(r.prompt_ids, device=self.device)
        pos = torch.arange(tmax, device=self.device).unsqueeze(0).expand(bsz, -1)
        batch.mode = "prefill"
        rows = shared_prefill_rows(requests) if self.share_prefill and stack.prefill_shareable() else None
        if rows is None:
            hidden = self.forward(ids, pos, batch)
            kv_before = cache.nbytes_per_slot().clone()  # the prompt's entries, before any compaction
            stack.after_forward(batch)
        else:
            hidden = self._prefill_once(ids, pos, batch, rows)
            kv_before = cache.nbytes_per_slot().clone()
        last = hidden[torch.arange(bsz, device=self.device), plen_t - 1]
        logits = self.logits(last, batch)

        slots = [_Slot(r, n, m, r.sampling.make_generator(self.device), IncrementalDetokenizer(self.tokenizer),
                       StopStringMatcher(list(r.sampling.stop)), think=self.thinking(r))
                 for r, n, m in zip(requests, prompt_lens, max_new, strict=True)]
        run = _RunStats(policy=stack.name, prefill_s=time.perf_counter() - t_start,
                        padding_fraction=1.0 - sum(prompt_lens) / float(bsz * tmax),
                        kv_after_prefill=cache.nbytes_per_slot().clone())
        run.kv_peak = torch.maximum(kv_before, run.kv_after_prefill)
        run.extra["prefill_rows"] = bsz if rows is None else len(set(rows))
        run.t_decode = time.perf_counter()
        batch.mode = "decode"
        graph = None
        if self.cuda_graphs and self.device.type == "cuda" and stack.graph_safe():
            t_cap = time.perf_counter()
            graph = _DecodeGraph(self, batch)
            run.extra["cuda_graph_capture_s"] = round(time.perf_counter() - t_cap, 4)
            run.t_decode = time.perf_counter()
        while True:
            step_deltas: list[Delta] = []
            greedy = logits.argmax(dim=-1).tolist()
            next_tokens = torch.full((bsz,), self.eos_default(), dtype=torch.long, device=self.device)
            for i, s in enumerate(slots):
                if s.finish is not None:
                    continue
                if cancelled is not None and cancelled(s.req.request_id):
                    s.finish = "cancelled"
                    step_deltas.append(self._final(i, s, run, batch))
                    continue
                tok, text = self._advance(s, logits[i], greedy[i])
                next_tokens[i] = tok
                batch.tokens[i].append(tok)
                if s.finish is None:
                    step_deltas.append(Delta(s.req.request_id, [tok], text,
                                             logprobs=None if s.last_lp is None else [s.last_lp]))
                else:
                    step_deltas.append(self._final(i, s, run, batch, tok, text))
            if step_deltas:
                yield step_deltas
            batch.active = torch.tensor([s.finish is None for s in slots], device=self.device)
            if all(s.finish is not None for s in slots):
                break
            # one decode step for the whole batch (finished slots ride along, ignored)
            positions = plen_t + torch.tensor([len(s.out_ids) for s in slots], device=self.device) - 1
            batch.step = run.steps
            stack.before_step(batch)
            if graph is not None:
                hidden = graph.replay(next_tokens, positions)
            else:
                batch.positions = positions
                hidden = self.forward(next_tokens.view(-1, 1), positions.view(-1, 1), batch)
            # the peak is taken after the step's write and before a compaction frees entries
            torch.maximum(run.kv_peak, cache.nbytes_per_slot(), out=run.kv_peak)
            stack.after_forward(batch)
            logits = self.logits(hidden[:, -1], batch)
            run.steps += 1

    def _advance(self, s: _Slot, logits: torch.Tensor, greedy: int) -> tuple[int, str]:
        """Choose one slot's next token (`greedy`: the argmax of `logits`, taken for the whole
        batch at once); update its text, stop state and finish reason."""
        r = s.req
        s.greedy_ids.append(greedy)
        if r.record_logprobs:
            s.logprob_rows.append(torch.log_softmax(logits.float(), -1).cpu())
        if r.forced_ids is not None and len(s.out_ids) < len(r.forced_ids):
            tok = int(r.forced_ids[len(s.out_ids)])
        else:
            picked = logits
            if r.sampling.processes_logits:  # bias, min_tokens, penalties: the argmax moves too
                picked = process_logits(logits, r.sampling, r.prompt_ids, s.out_ids, self.eos_ids)
                if r.sampling.temperature <= 0:
                    greedy = int(torch.argmax(picked))
            tok = greedy if r.sampling.temperature <= 0 else sample_next(picked, r.sampling, s.generator)
        if s.think is not None:
            forced = s.think.forced()
            tok = tok if forced is None else forced
            s.think.push(tok)
        s.out_ids.append(tok)
        sp = r.sampling
        if sp.logprobs is not None:
            s.last_lp = token_logprobs(logits, tok, sp.logprobs)
        if len(s.out_ids) > sp.min_tokens and (tok in sp.stop_token_ids
                                               or (tok in self.eos_ids and not sp.ignore_eos)):
            s.finish = "stop"
            return tok, s.stops.feed(s.detok.flush()) + s.stops.finish()
        text = s.stops.feed(s.detok.push(tok))
        if s.stops.stopped:
            s.finish = "stop"
        elif len(s.out_ids) >= s.max_new:
            s.finish = "length"
            text += s.stops.feed(s.detok.flush())
            if s.stops.stopped:
                s.finish = "stop"
            text += s.stops.finish()
        return tok, text

    def eos_default(self) -> int:
        return min(self.eos_ids) if self.eos_ids else 0

    def _final(self, i: int, s: _Slot, run: _RunStats, batch: BatchState, tok: int | None = None,
               text: str = "") -> Delta:
        decode_s = time.perf_counter() - run.t_decode
        n = len(s.out_ids)
        tele = {
            "policy": run.policy,
            "prefill_s": round(run.prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tok_s": round(n / decode_s, 2) if decode_s > 0 and n else 0.0,
            "batch_size": batch.batch_size,
            "padding_fraction": round(run.padding_fraction, 4),
            "kv_bytes_after_prefill": int(run.kv_after_prefill[i]),
            "kv_bytes_peak": int(run.kv_peak[i]),  # filled entries, highest before any compaction
            "kv_bytes_allocated": batch.cache.allocated_bytes_per_slot(),  # what the slot holds
            "kv_bytes_final": int(batch.cache.nbytes_per_slot()[i]),
            **run.extra,
        }
        tele.update(batch.policy.telemetry(i))
        comp = Completion(request_id=s.req.request_id, text=s.stops.text, token_ids=list(s.out_ids),
                          finish_reason=s.finish or "stop", prompt_tokens=s.prompt_len,
                          completion_tokens=n, telemetry=tele, greedy_ids=list(s.greedy_ids),
                          logprobs=torch.stack(s.logprob_rows) if s.logprob_rows else None)
        lps = [s.last_lp] if tok is not None and s.last_lp is not None else None
        return Delta(s.req.request_id, [] if tok is None else [tok], text, finished=True,
                     finish_reason=comp.finish_reason, result=comp, logprobs=lps)

    def _prefill_once(self, ids: torch.Tensor, pos: torch.Tensor, batch: BatchState, rows: list[int]
                      ) -> torch.Tensor:
        """Prefill each distinct prompt once (`rows[i]`: the slot whose prompt slot i shares), then
        copy its cache rows to the slots that share it. Only for stacks whose policies keep no
        per-slot state from the prefill (`PolicyStack.prefill_shareable`)."""
        uniq = sorted(set(rows))
        src = torch.tensor([uniq.index(r) for r in rows], device=self.device)
        full = batch.cache
        sub_cache = KVCache(CacheShape(full.shape.layers, len(uniq), full.shape.kv_heads, full.shape.capacity,
                                       full.shape.head_dim), full.k.dtype, self.device)
        sub = BatchState(info=batch.info, cache=sub_cache, policy=batch.policy, scaling=batch.scaling,
                         prompt_lens=batch.prompt_lens[uniq], tokens=[batch.tokens[i] for i in uniq],
                         active=batch.active[uniq], extras={j: batch.extras[i] for j, i in enumerate(uniq)},
                         lean=batch.lean, mode="prefill")
        hidden = self.forward(ids[uniq], pos[: len(uniq)], sub)
        batch.policy.after_forward(sub)
        for name in ("k", "v", "pos"):
            getattr(full, name).copy_(getattr(sub_cache, name).index_select(1, src))
        full.lens.copy_(sub_cache.lens.index_select(1, src))
        hidden = hidden.index_select(0, src)
        batch.hidden = hidden
        return hidden


@dataclass
class _Slot:
    """Decode-loop state of one request in a batch."""

    req: GenRequest
    prompt_len: int
    max_new: int
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    out_ids: list[int] = field(default_factory=list)
    greedy_ids: list[int] = field(default_factory=list)
    logprob_rows: list[torch.Tensor] = field(default_factory=list)
    finish: str | None = None
    last_lp: tuple[float, list[tuple[int, float]]] | None = None  # the latest token's logprobs (if asked)
    think: ThinkingBudget | None = None  # the request's thinking budget, when it set one


@dataclass
class _RunStats:
    policy: str
    prefill_s: float
    padding_fraction: float
    kv_after_prefill: torch.Tensor
    kv_peak: torch.Tensor | None = None
    t_decode: float = 0.0
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _DecodeGraph:
    """The whole one-token decode forward captured in a CUDA graph (static shapes: the batch's
    slots and the cache capacity are fixed, lengths live on the device). Used only for stacks
    whose hooks are `graph_safe` (dense); replaying it costs one launch per step instead of
    several per layer."""

    def __init__(self, engine: NativeEngine, batch: BatchState):
        bsz = batch.batch_size
        dev = engine.device
        self.batch = batch
        self.ids = torch.zeros((bsz, 1), dtype=torch.long, device=dev)
        self.pos = batch.prompt_lens.view(-1, 1).clone()
        batch.positions = self.pos.view(-1)
        cache = batch.cache
        cache.checked = False
        saved = cache.lens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (kernel compilation, allocator) off the graph
            engine.forward(self.ids, self.pos, batch)
        torch.cuda.current_stream().wait_stream(stream)
        cache.lens.copy_(saved)  # the warm-up's write is garbage; the next real write replaces it
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.hidden = engine.forward(self.ids, self.pos, batch)

    def replay(self, next_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(next_tokens.view(-1, 1))
        self.pos.copy_(positions.view(-1, 1))
        self.graph.replay()
        self.batch.hidden = self.hidden
        return self.hidden


def group_by_length(requests: list[GenRequest], max_batch: int) -> list[list[GenRequest]]:
    """Length-sorted batch grouping (SkipKV, Sec. 4.3, `cotserve.grouping.length_groups`): neighbours
    in prompt length share a batch, so right-padding in prefill and ragged cache lengths in decode
    stay small."""
    return length_groups(requests, lambda r: len(r.prompt_ids), max_batch)


def shared_prefill_rows(requests: list[GenRequest]) -> list[int] | None:
    """For each request, the first request with the same prompt and policy inputs (n sequences
    of one prompt); None when every prompt is distinct (nothing to share)."""
    first: dict[str, int] = {}
    rows = []
    for i, r in enumerate(requests):
        key = repr((r.prompt_ids, sorted(r.extras.items(), key=lambda kv: kv[0]), r.forced_ids))
        rows.append(first.setdefault(key, i))
    return rows if len(set(rows)) < len(rows) else None
