"""`rkv`: R-KV, redundancy-aware KV eviction for reasoning models (Cai et al., arXiv 2505.24133).

Every `interval` decode steps a sequence holding more than `budget` entries keeps, per layer and
KV head, the `window` most recent entries plus the `budget - window` entries with the best joint
score (R-KV Sec. 3.4, SkipKV arXiv 2512.07993 Sec. 4.1 without its sentence term):

    score = sigma * importance - (1 - sigma) * redundancy

importance: attention of the last `window` queries, averaged, GQA group reduced by max, max-pooled
(width `pool_width`); redundancy: key cosine similarity with the newest copies exempted
(`cotserve.policies.scoring`). The options `group_reduce`, `normalize` and `reference_quirk` switch to
the public R-KV code's variants (see `scoring`); R-KV's code also defaults to sigma (its
`mix_lambda`) = 0.07 where both papers use 0.1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies import scoring
from cotserve.policies.base import Runtime
from cotserve.policies.eviction import BudgetEviction, EvictionConfig
from cotserve.policies.options import RKVOptions, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(RKVOptions)
class RKVConfig(EvictionConfig):
    """`RKVOptions`: the eviction options plus R-KV's importance and redundancy scoring."""


def rkv_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scaling: float,
               c: RKVConfig) -> torch.Tensor:
    """Joint R-KV score of the candidate entries (all but the last `window`): [Hkv, n - window]."""
    m = k.shape[1] - c.window
    imp = scoring.attention_importance(q, k, scaling, c.window, c.pool_width, q_pos=q_pos, k_pos=pos,
                                       gqa_pool=c.group_reduce, normalize=c.normalize)
    red = scoring.key_redundancy(k, c.redundancy_threshold, c.redundancy_retain, c.reference_quirk)[:, :m]
    return scoring.mix_scores(imp, red, c.sigma)


@register
class RKVPolicy(BudgetEviction):
    """R-KV token eviction: SkipKV's token score without the sentence term."""

    name = "rkv"
    config_cls = RKVConfig
    runtimes = Runtime.ALL

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        q, q_pos, k, pos = self.observed(batch, layer, slot, n)
        return rkv_scores(q, q_pos, k, pos, batch.scaling, self.config)
