"""Budgeted physical eviction: the machinery the score-based eviction policies share.

`BudgetEviction` keeps, per sequence and layer, at most `budget + interval` KV entries:

* it records the last `window` queries of every layer (prefill: the prompt's last queries;
  decode: one per step) while the default dense attention runs (its hooks return None);
* every `interval` decode steps (and right after prefill when the prompt is longer than the
  budget), each sequence holding more than `budget` entries is compacted to exactly `budget`
  entries per KV head: the `window` most recent entries plus the `budget - window` best-scored
  others (`score`, given by the subclass). The compaction is PHYSICAL (`KVCache.compact`): the
  cache is sized for `max(prompt, budget + interval)` entries per slot, not for the whole output.

Entries keep their true positions (`KVCache.pos`), so new tokens keep theirs and policies can map
entries back to tokens. The cache only ever holds a slot's valid entries at indices
`0 .. lens - 1` (right-padded prefill, per-slot lengths), so padding never becomes attendable.
Finished sequences that still ride along in the batch are truncated to their most recent entries
(nothing reads them).

It also follows each sequence's generated thoughts (`thoughts.thought_tracker`: the blank-line
splitter steering uses too, SkipKV Sec. 4.2) and reports the count of non-execution thoughts,
classified by the rules of the `thought_rules` file (default: `thoughts.DEFAULT_RULES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cotserve.errors import CotserveError
from cotserve.policies.base import Axis, Policy, PolicyConfig
from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.thoughts import load_rules, thought_tracker

if TYPE_CHECKING:
    from cotserve.engine.batch import BatchState


@dataclass
class EvictionConfig(PolicyConfig):
    """budget: KV entries kept per sequence, layer and KV head after a compaction.
    interval: decode steps between compactions (N); memory stays at most budget + interval.
    window: the most recent entries always kept, and the number of observation queries (w).
    compact_prefill: compact right after prefill when the prompt exceeds the budget.
    thought_rules: YAML/JSON file of thought classification rules (`thoughts.load_rules`);
    "" = the defaults."""

    budget: int = 1024
    interval: int = 128
    window: int = 8
    compact_prefill: bool = True
    thought_rules: str = ""

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.budget <= self.window:
            raise ValueError(f"budget ({self.budget}) must be larger than window ({self.window})")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.thought_rules:
            try:
                load_rules(self.thought_rules)
            except CotserveError as exc:
                raise ValueError(str(exc)) from exc


class BudgetEviction(Policy):
    """Base class: subclasses implement `score`. See the module docstring."""

    axis = Axis.EVICT
    config_cls = EvictionConfig

    def capacity(self, prompt_lens: list[int], max_new: int) -> int | None:
        c = self.config
        prompt = max(prompt_lens)
        if not c.compact_prefill or prompt <= c.budget:
            prompt += c.interval
        return max(prompt, c.budget + c.interval)

    # -- state ---------------------------------------------------------------------------
    def begin(self, batch: BatchState) -> None:
        info = batch.info
        b = batch.batch_size
        w = self.config.window
        dev = batch.cache.device
        self.batch = batch
        self.q_win = [torch.zeros(b, info.num_heads, w, info.head_dim, dtype=batch.cache.k.dtype, device=dev)
                      for _ in range(info.num_layers)]
        self.q_pos = torch.full((b, w), -1, dtype=torch.long, device=dev)
        self.compactions = [0] * b
        self.evicted = [0] * b
        self.peak_entries = [0] * b
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

    # -- eviction ------------------------------------------------------------------------
    def after_forward(self, batch: BatchState) -> None:
        self.observe(batch)
        # entries held per slot after this forward's write and before any compaction (the prompt
        # at prefill, one more entry per decode step): the peak is the max of these
        for i, n in enumerate(batch.cache.lens.amax(0).tolist()):
            self.peak_entries[i] = max(self.peak_entries[i], n)
        self.compact_due(batch)

    def compact_due(self, batch: BatchState) -> None:
        c = self.config
        lens = batch.cache.lens.amax(0).tolist()
        if batch.mode == "prefill":
            if not c.compact_prefill:
                return
        elif (batch.step + 1) % c.interval:
            return
        active = batch.active.tolist() if batch.active is not None else [True] * len(lens)
        for i, n in enumerate(lens):
            if n <= c.budget:
                continue
            if active[i]:
                self.compact_slot(batch, i)
            else:
                self.truncate_slot(batch, i)

    def observe(self, batch: BatchState) -> None:
        """Called after every forward, before any compaction (subclasses follow the text here)."""

    def compact_slot(self, batch: BatchState, slot: int) -> None:
        cache = batch.cache
        c = self.config
        qmask = self.q_pos[slot] >= 0
        q_pos = self.q_pos[slot, qmask]
        n0 = int(cache.lens[:, slot].max())
        for layer in range(batch.info.num_layers):
            n = int(cache.lens[layer, slot])
            if n <= c.budget:
                continue
            k = cache.k[layer, slot, :, :n]
            pos = cache.pos[layer, slot, :, :n]
            q = self.q_win[layer][slot][:, qmask]
            scores = self.score(batch, layer, slot, q, q_pos, k, pos)
            keep = self.select(scores, c.budget, c.window)
            cache.compact(layer, slot, keep)
        self.compactions[slot] += 1
        self.evicted[slot] += n0 - c.budget
        self.after_compaction(batch, slot)

    def select(self, scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
        from cotserve.policies.scoring import select_keep

        return select_keep(scores, budget, window)

    def truncate_slot(self, batch: BatchState, slot: int) -> None:
        cache = batch.cache
        c = self.config
        for layer in range(batch.info.num_layers):
            n = int(cache.lens[layer, slot])
            if n > c.budget:
                keep = torch.arange(n - c.budget, n, device=cache.device).expand(cache.shape.kv_heads, -1)
                cache.compact(layer, slot, keep)

    def after_compaction(self, batch: BatchState, slot: int) -> None:
        """Hook for subclasses (e.g. sentence bookkeeping)."""

    def score(self, batch: BatchState, layer: int, slot: int, q: torch.Tensor, q_pos: torch.Tensor,
              k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Scores [Hkv, n - window] of the candidate entries 0..n-window-1 (higher = keep)."""
        raise NotImplementedError

    # -- reporting -----------------------------------------------------------------------
    def _follow_thoughts(self, slot: int) -> None:
        if self.trackers is None:
            return
        toks = self.batch.tokens[slot]
        for t in toks[self.fed[slot]:]:
            self.trackers[slot].push(t)
        self.fed[slot] = len(toks)

    def telemetry(self, slot: int) -> dict[str, Any]:
        self._follow_thoughts(slot)
        held = int(self.batch.cache.lens[:, slot].max())
        total = held + self.evicted[slot]  # entries that entered the cache (the last sampled token never does)
        out: dict[str, Any] = {
            "kv_budget": self.config.budget,
            "compactions": self.compactions[slot],
            "evicted_tokens": self.evicted[slot],
            "kv_entries_peak": self.peak_entries[slot],  # filled entries per layer and KV head, before compactions
            "kv_entries_allocated": self.batch.cache.capacity,  # what the slot holds (see KVCache)
            "retained_ratio": round(held / max(total, 1), 4),
        }
        if self.trackers is not None:
            out["non_execution_thoughts"] = self.trackers[slot].non_execution
        return out
