"""`snapkv`: observation-window voting at prefill, nothing evicted while decoding.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469),
Sec. 4.2, Eq. (1)-(2) and Listing 1: the last `window` prompt queries (the observation window)
attend over the prompt; for each prefix key the attention is summed over the window's queries
(Eq. 1, "voting"), smoothed by a 1-D pooling of width `pool_width` (stride 1, "clustering"), and the top
(budget - window) prefix keys per head (Eq. 2) plus the window itself are kept. Decoding then runs
dense attention over the compressed prompt plus every generated token (no further eviction).

Here, per slot and KV head:
* the window's attention is the causal softmax of its queries over the slot's real prompt (the
  window attends causally among itself, as in Listing 1), columns of the prefix only;
* GQA: the window-summed scores of a group's query heads are averaged into their KV head
  (`group_reduce=mean`; `max` takes the largest), then pooled;
* pooling: `max` (default) or `avg` (zero padding counted, PyTorch's avg_pool1d default; the public
  SnapKV code defaults to avg pooling, Listing 1 leaves the operator generic);
* a prompt of at most `budget` tokens is kept whole. The scores are computed inside prefill (the
  prompt attention output itself is the engine's causal default); the compaction after the forward
  is `eviction.ScoredEviction`'s, with the window as its protected last entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cotserve.policies.attention_parts import refuse_overriding_parts
from cotserve.policies.base import PolicyConfig
from cotserve.policies.eviction import ScoredEviction
from cotserve.policies.options import SnapKVOptions, check_config, options_config
from cotserve.policies.registry import register
from cotserve.policies.scoring import protected_top

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(SnapKVOptions)
class SnapKVConfig(PolicyConfig):
    """`SnapKVOptions`: the prompt budget, the observation window, the pooling, the GQA reduction."""

    def validate(self) -> None:
        check_config(self)


def snapkv_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, kernel: int, pooling: str,
                  group_reduce: str = "mean") -> torch.Tensor:
    """Pooled observation-window scores of the prefix keys of ONE sequence: [Hkv, L - window].

    q [Hq, L, D], k [Hkv, L, D]: the real prompt (no padding). Eq. (1) then the pooling of Listing 1."""
    hq, length, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qw = q[:, length - window :].reshape(hkv, g * window, d)
    logits = torch.matmul(qw, k.transpose(-1, -2)).float() * scaling  # [Hkv, G*w, L]
    rows = torch.arange(length - window, length, device=q.device).repeat(g)
    causal = rows.unsqueeze(1) >= torch.arange(length, device=q.device).unsqueeze(0)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    votes = probs[..., : length - window].reshape(hkv, g, window, -1).sum(2)  # Eq. (1): [Hkv, G, L-w]
    votes = votes.mean(1) if group_reduce == "mean" else votes.amax(1)  # GQA group -> KV head
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(votes.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


def snapkv_keep(pooled: torch.Tensor, length: int, budget: int, window: int) -> torch.Tensor:
    """Indices [kv_head, budget], sorted: top (budget - window) prefix keys by pooled score + the window."""
    return protected_top(pooled, length, budget, 0, window, pooled.shape[0], pooled.device)


@register
class SnapKVPolicy(ScoredEviction):
    """SnapKV (Li et al. 2024): prompt compression once, after prefill."""

    name = "snapkv"
    config_cls = SnapKVConfig

    def __init__(self, config: SnapKVConfig | None = None):
        super().__init__(config)
        self._pooled: dict[int, dict[int, torch.Tensor]] = {}  # layer -> slot -> scores [Hkv, L - window]

    def capacity(self, prompt_lens: list[int], max_new: int) -> int:
        # the prompt is written whole, then shrinks to budget; decoding only appends
        return max(max(prompt_lens), self.config.budget + max_new) + 1

    @property
    def keep_last(self) -> int:
        return self.config.window

    def threshold(self, batch: BatchState) -> int | None:
        return self.config.budget if batch.mode == "prefill" else None

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        return self._pooled[layer][slot]

    def begin(self, batch: BatchState) -> None:
        refuse_overriding_parts(self, batch, ("prefill_attention",), answers=False)
        super().begin(batch)

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> None:
        cfg: SnapKVConfig = self.config
        pooled: dict[int, torch.Tensor] = {}
        for slot, length in enumerate(batch.prompt_lens.tolist()):
            if length <= cfg.budget:
                continue
            pooled[slot] = snapkv_scores(q[slot, :, :length], k[slot, :, :length], batch.scaling, cfg.window,
                                         cfg.pool_width, cfg.pooling, cfg.group_reduce)
        self._pooled[layer] = pooled
        return None  # the prompt attention itself is the engine's causal default

    def observe(self, batch: BatchState) -> None:
        if batch.mode == "prefill" and len(self._pooled) != batch.cache.shape.layers:
            raise RuntimeError("snapkv did not see the prompt queries of every layer")  # guarded in begin()

    def after_forward(self, batch: BatchState) -> None:
        super().after_forward(batch)
        self._pooled.clear()
