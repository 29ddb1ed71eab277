"""Score-based physical eviction: the one base of every eviction policy (rkv, skipkv, h2o, snapkv,
streamingllm), after the idea of NVIDIA kvpress's ScorerPress.

`ScoredEviction`: a policy supplies a per-entry score; the base keeps, per layer and KV head, the
protected entries (the first `keep_first`, the last `keep_last`) plus the best-scored others up to
`budget` entries (`scoring.protected_top`), compacts the cache PHYSICALLY (`KVCache.compact`),
carries per-entry side tensors through the same permutation (`followers`, e.g. H2O's accumulated
scores) and keeps the telemetry counters (`compactions`, `evicted_tokens`, `retained_ratio`, the
peak of filled entries). A policy says:

* `budget`, `keep_first`, `keep_last`: entries kept after a compaction and the protected ends;
* `threshold(batch)`: after this forward, compact the slots holding more entries than this (None:
  no compaction after this forward);
* `score(batch, layer, slot, n)`: scores [Hkv, n - keep_first - keep_last] of the candidate entries
  keep_first .. n - keep_last - 1 of (layer, slot) (higher = keep); not asked when no candidate is
  to be kept (streamingllm);
* `observe(batch)`: after every forward, before any compaction.

Finished sequences that still ride along in the batch are truncated to their most recent entries
(nothing reads them; not counted).

`BudgetEviction` (rkv, skipkv) keeps, per sequence and layer, at most `budget + interval` KV entries:

* it records the last `window` queries of every layer (prefill: the prompt's last queries;
  decode: one per step) while the default dense attention runs (its hooks return None);
* every `interval` decode steps (and right after prefill when the prompt is longer than the
  budget), each sequence holding more than `budget` entries is compacted to exactly `budget`
  entries per KV head: the `window` most recent entries plus the `budget - window` best-scored
  others (`score`, given by the subclass from `observed`). The cache is sized for
  `max(prompt, budget + interval)` entries per slot, not for the whole output.

Entries keep their true positions (`KVCache.pos`), so new tokens keep theirs and policies can map
entries back to tokens. The cache only ever holds a slot's valid entries at indices
`0 .. lens - 1` (right-padded prefill, per-slot lengths), so padding never becomes attendable.

`BudgetEviction` also follows each sequence's generated thoughts (`thoughts.thought_tracker`: the
blank-line splitter steering uses too, SkipKV Sec. 4.2) and reports the count of non-execution
thoughts, classified by the rules of the `thought_rules` file (default: `thoughts.DEFAULT_RULES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cotserve.errors import CotserveError
from cotserve.policies.base import Axis, Policy, PolicyConfig
from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.options import EvictionOptions, check_config, options_config
from cotserve.policies.scoring import protected_top
from cotserve.policies.thoughts import load_rules, thought_tracker

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState
    from cotserve.kv.cache import KVCache


def evict_to(cache: KVCache, layer: int, slot: int, keep: torch.Tensor,
             followers: list[torch.Tensor] | None = None) -> int:
    """Physically keep entries `keep[kv_head, n]` of (layer, slot); return how many were dropped.

    Each follower is a per-entry tensor [kv_head, capacity] of this (layer, slot) (e.g. H2O's
    accumulated scores); it is permuted exactly like the cache (compact stores keep sorted) and its
    tail is zeroed, so a score always belongs to the entry it was computed for."""
    keep = keep.sort(dim=-1).values
    cur = int(cache.lens[layer, slot])
    n = keep.shape[-1]
    cache.compact(layer, slot, keep)
    for f in followers or []:
        f[:, :n] = torch.gather(f[:, :cur], 1, keep)
        f[:, n:] = 0
    return cur - n


class ScoredEviction(Policy):
    """Base class of the eviction policies: subclasses give `budget`, `threshold` and `score`
    (and `keep_first` / `keep_last` / `followers` where they need them). See the module docstring."""

    axis = Axis.EVICT

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self.batch: BatchState | None = None
        self.compactions: list[int] = []
        self.evicted: list[int] = []
        self.peak_entries: list[int] = []

    # -- what a policy supplies ------------------------------------------------------------
    @property
    def budget(self) -> int:
        """Entries kept per layer and KV head after a compaction."""
        return self.config.budget

    @property
    def keep_first(self) -> int:
        """The oldest entries, always kept (attention sinks)."""
        return 0

    @property
    def keep_last(self) -> int:
        """The most recent entries, always kept."""
        return 0

    def threshold(self, batch: BatchState) -> int | None:
        """Compact, after this forward, the slots holding more entries than this; None: none."""
        raise NotImplementedError

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        """Scores [Hkv, n - keep_first - keep_last] of the candidate entries of (layer, slot), which
        holds `n` entries (higher = keep)."""
        raise NotImplementedError

    def observe(self, batch: BatchState) -> None:
        """Called after every forward, before any compaction."""

    def followers(self, layer: int, slot: int) -> list[torch.Tensor]:
        """Per-entry tensors [Hkv, capacity] of (layer, slot) that move with the entries."""
        return []

    def after_compaction(self, batch: BatchState, slot: int) -> None:
        """Called after a slot was compacted by score (e.g. sentence bookkeeping)."""

    # -- the mechanics -----------------------------------------------------------------------
    def begin(self, batch: BatchState) -> None:
        b = batch.batch_size
        self.batch = batch
        self.compactions = [0] * b
        self.evicted = [0] * b
        self.peak_entries = [0] * b

    def after_forward(self, batch: BatchState) -> None:
        self.observe(batch)
        # entries held per slot after this forward's write and before any compaction (the prompt
        # at prefill, one more entry per decode step): the peak is the max of these
        lens = batch.cache.lens.amax(0).tolist()
        for i, n in enumerate(lens):
            self.peak_entries[i] = max(self.peak_entries[i], n)
        limit = self.threshold(batch)
        if limit is None:
            return
        active = batch.active.tolist() if batch.active is not None else [True] * len(lens)
        for i, n in enumerate(lens):
            if n <= limit:
                continue
            if active[i]:
                self.compact_slot(batch, i)
            else:
                self.truncate_slot(batch, i)

    def compact_slot(self, batch: BatchState, slot: int) -> None:
        cache = batch.cache
        budget, first, last = self.budget, self.keep_first, self.keep_last
        choose = budget - first - min(last, budget - first) > 0
        n0 = int(cache.lens[:, slot].max())
        for layer in range(cache.shape.layers):
            n = int(cache.lens[layer, slot])
            if n <= budget:
                continue
            scores = self.score(batch, layer, slot, n) if choose else None
            keep = protected_top(scores, n, budget, first, last, cache.shape.kv_heads, cache.device)
            evict_to(cache, layer, slot, keep, self.followers(layer, slot))
        self.compactions[slot] += 1
        self.evicted[slot] += n0 - budget
        self.after_compaction(batch, slot)

    def truncate_slot(self, batch: BatchState, slot: int) -> None:
        cache = batch.cache
        budget = self.budget
        for layer in range(cache.shape.layers):
            n = int(cache.lens[layer, slot])
            if n > budget:
                keep = torch.arange(n - budget, n, device=cache.device).expand(cache.shape.kv_heads, -1)
                evict_to(cache, layer, slot, keep, self.followers(layer, slot))

    def telemetry(self, slot: int) -> dict[str, Any]:
        if self.batch is None:
            return {}
        held = int(self.batch.cache.lens[:, slot].max())
        seen = held + self.evicted[slot]  # entries that entered the cache (the last sampled token never does)
        return {"evicted_tokens": self.evicted[slot], "compactions": self.compactions[slot],
                "retained_ratio": round(held / seen, 4) if seen else 1.0}


@options_config(EvictionOptions)
class EvictionConfig(PolicyConfig):
    """`EvictionOptions`: the options every budget eviction policy shares (rkv, skipkv)."""

    def validate(self) -> None:
        check_config(self)
        if self.thought_rules:
            try:
                load_rules(self.thought_rules)
            except CotserveError as exc:
                raise ValueError(str(exc)) from exc


class BudgetEviction(ScoredEviction):
    """Base class of rkv and skipkv: subclasses implement `score` from `observed`. See the module
    docstring."""

    config_cls = EvictionConfig

    def capacity(self, prompt_lens: list[int], max_new: int) -> int | None:
        c = self.config
        prompt = max(prompt_lens)
        if not c.compact_prefill or prompt <= c.budget:
            prompt += c.interval
        return max(prompt, c.budget + c.interval)

    @property
    def keep_last(self) -> int:
        return self.config.window

    def threshold(self, batch: BatchState) -> int | None:
        c = self.config
        if batch.mode == "prefill":
            return c.budget if c.compact_prefill else None
        return None if (batch.step + 1) % c.interval else c.budget

    # -- state ---------------------------------------------------------------------------
    def begin(self, batch: BatchState) -> None:
        super().begin(batch)
        info = batch.info
        b = batch.batch_size
        w = self.config.window
        dev = batch.cache.device
        self.q_win = [torch.zeros(b, info.num_heads, w, info.head_dim, dtype=batch.cache.k.dtype, device=dev)
                      for _ in range(info.num_layers)]
        self.q_pos = torch.full((b, w), -1, dtype=torch.long, device=dev)
        plens = batch.prompt_lens.tolist()
        self.fed = list(plens)  # next position the thought tracker has not seen
        tok = batch.info.tokenizer
        rules = load_rules(self.config.thought_rules)
        self.trackers = ([thought_tracker(tok, thought_delimiter_ids(tok), rules) for _ in range(b)]
                         if tok is not None else None)

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> None:
        w = self.config.window
        for i, plen in enumerate(batch.prompt_lens.tolist()):
            n = min(w, plen)
            self.q_win[layer][i, :, w - n:] = q[i, :, plen - n:plen]
            if layer == 0:
                self.q_pos[i, w - n:] = torch.arange(plen - n, plen, device=self.q_pos.device)
        return None

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> None:
        buf = self.q_win[layer]
        buf[:, :, :-1] = buf[:, :, 1:].clone()
        buf[:, :, -1] = q[:, :, 0]
        if layer == 0:
            self.q_pos[:, :-1] = self.q_pos[:, 1:].clone()
            self.q_pos[:, -1] = batch.positions
        return None

    def observed(self, batch: BatchState, layer: int, slot: int, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [Hq, w, D], q_pos [w], k [Hkv, n, D], pos [Hkv, n]) of (layer, slot): the recorded
        observation queries with their positions, the cached keys with theirs."""
        cache = batch.cache
        qmask = self.q_pos[slot] >= 0
        return (self.q_win[layer][slot][:, qmask], self.q_pos[slot, qmask],
                cache.k[layer, slot, :, :n], cache.pos[layer, slot, :, :n])

    # -- reporting -----------------------------------------------------------------------
    def _follow_thoughts(self, slot: int) -> None:
        if self.trackers is None:
            return
        toks = self.batch.tokens[slot]
        for t in toks[self.fed[slot]:]:
            self.trackers[slot].push(t)
        self.fed[slot] = len(toks)

    def telemetry(self, slot: int) -> dict[str, Any]:
        if self.batch is None:
            return {}
        self._follow_thoughts(slot)
        out: dict[str, Any] = {
            "kv_budget": self.config.budget,
            **super().telemetry(slot),
            "kv_entries_peak": self.peak_entries[slot],  # filled entries per layer and KV head, before compactions
            "kv_entries_allocated": self.batch.cache.capacity,  # what the slot holds (see KVCache)
        }
        if self.trackers is not None:
            out["non_execution_thoughts"] = self.trackers[slot].non_execution
        return out
