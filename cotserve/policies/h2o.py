"""`h2o`: heavy hitters (accumulated attention) + a recent window.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (arXiv 2306.14048), Sec. 4 and Algorithm 1: each cached key carries an accumulated score
F_score = the sum of the attention probabilities it has received from every query so far; when the
cache is over budget, the entry with the lowest score is evicted, except the most recent tokens
(the paper splits the budget evenly between heavy hitters and recent tokens).

Here, per KV head:
* prefill computes causal attention itself (query chunks, `causal_prefill_with_colsums`) and starts
  each key's score at the attention it got from the real prompt rows;
* every decode step computes dense attention itself (`decode_probs`), adds each entry's
  probability to its score, and returns the output (identical to dense attention);
* GQA: a KV head's score adds the probabilities of the query heads of its group (`group_reduce=sum`,
  the default; `max` takes the largest instead). Sum and mean rank identically.
* eviction keeps the last `recent` entries (recent = budget * recent_ratio) plus the budget - recent
  entries with the highest scores among the others; it runs when a slot holds budget + `interval`
  entries (`interval=1`, the default, is Algorithm 1's one-out-per-step greedy eviction; a larger value
  evicts `interval` tokens at once by the same rule, fewer compactions). The accumulated scores are
  the policy's score for `eviction.ScoredEviction` and move with their entries through the compaction
  (its `followers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies.attention_parts import (
    attend,
    causal_prefill_with_colsums,
    decode_probs,
    reduce_group,
    refuse_overriding_parts,
)
from cotserve.policies.base import PolicyConfig, Runtime
from cotserve.policies.eviction import ScoredEviction
from cotserve.policies.options import H2OOptions, check_config, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(H2OOptions)
class H2OConfig(PolicyConfig):
    """`H2OOptions`: the budget, its recent share, the eviction interval, the GQA reduction."""

    def validate(self) -> None:
        check_config(self)

    @property
    def recent(self) -> int:
        return int(round(self.budget * self.recent_ratio))


@register
class H2OPolicy(ScoredEviction):
    """Heavy-Hitter Oracle (Zhang et al. 2023): accumulated attention + recent, physical eviction."""

    name = "h2o"
    config_cls = H2OConfig
    runtimes = Runtime.ALL

    def __init__(self, config: H2OConfig | None = None):
        super().__init__(config)
        self.scores: torch.Tensor | None = None  # [layer, slot, kv_head, capacity] float32
        self._seen: set[int] = set()

    def capacity(self, prompt_lens: list[int], max_new: int) -> int:
        return max(max(prompt_lens), self.config.budget + self.config.interval) + 1

    @property
    def keep_last(self) -> int:
        return self.config.recent

    def threshold(self, batch: BatchState) -> int:
        cfg: H2OConfig = self.config
        return cfg.budget if batch.mode == "prefill" else cfg.budget + cfg.interval - 1

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        return self.scores[layer, slot, :, : n - min(self.keep_last, self.budget)]

    def followers(self, layer: int, slot: int) -> list[torch.Tensor]:
        return [self.scores[layer, slot]]

    def begin(self, batch: BatchState) -> None:
        refuse_overriding_parts(self, batch, ("prefill_attention", "decode_attention"), answers=True)
        super().begin(batch)
        s = batch.cache.shape
        self.scores = torch.zeros(s.layers, s.slots, s.kv_heads, s.capacity, dtype=torch.float32,
                                  device=batch.cache.device)

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> torch.Tensor:
        out, colsum = causal_prefill_with_colsums(q, k, v, batch.prompt_lens, batch.scaling)
        t = k.shape[2]
        self.scores[layer, :, :, :t] = reduce_group(colsum, k.shape[1], self.config.group_reduce)
        self._seen.add(layer)
        return out

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        k, v, valid = batch.cache.view(layer)
        probs = decode_probs(q, k, valid, batch.scaling)  # [B, Hkv, G, S]
        s = k.shape[2]
        gathered = probs.sum(2) if self.config.group_reduce == "sum" else probs.amax(2)
        self.scores[layer, :, :, :s] += gathered
        self._seen.add(layer)
        return attend(probs, v)

    def observe(self, batch: BatchState) -> None:
        if len(self._seen) != batch.cache.shape.layers:
            raise RuntimeError("h2o did not see the attention of every layer")  # guarded in begin()
        self._seen.clear()
