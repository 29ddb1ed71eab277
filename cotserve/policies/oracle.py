"""`oracle_topk`: a diagnostic upper bound for read-selection policies such as SFI.

At every decode step and layer it computes the exact attention of the current query over the
whole history (so it saves nothing: it is a yardstick, not a speed-up), then lets each KV head
read only its `sinks` first entries, its `recent` newest ones and the `k` other entries with the
largest attention weight (max over the query heads of its GQA group), and renormalizes over them.
`stale=s` (s >= 1) ranks the entries by the attention of the query s steps back instead: what a
perfect selector achieves when its choice is s steps old, as in a slow/fast scheme where the
selection is refreshed only now and then (SFI, arXiv:2603.12038, relies on the support being
stable within a sentence; this measures how stable it is for a given model and text).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies.base import Axis, Policy, PolicyConfig
from cotserve.policies.options import OracleTopKOptions, check_config, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(OracleTopKOptions)
class OracleTopKConfig(PolicyConfig):
    """`OracleTopKOptions`: entries read besides sinks and window, how stale the ranking query is."""

    def validate(self) -> None:
        check_config(self)


def oracle_read_mask(scores: torch.Tensor, lens: torch.Tensor, k: int, sinks: int, recent: int) -> torch.Tensor:
    """Which entries each head reads: bool [B, H, S] from ranking scores [B, H, S] (-inf or 0 on
    invalid entries), per-slot valid lengths `lens` [B]: sinks + recent window + top-k of the rest."""
    b, h, s = scores.shape
    ar = torch.arange(s, device=scores.device)
    n = lens.view(b, 1, 1)
    valid = ar < n
    fixed = (ar < sinks) | ((ar >= n - recent) & valid)
    rest = scores.masked_fill(fixed | ~valid, float("-inf"))
    take = min(k, s)
    keep = fixed.expand(b, h, s)
    if take > 0:
        top = rest.topk(take, dim=-1)
        chosen = torch.zeros(b, h, s, dtype=torch.bool, device=scores.device)
        keep = keep | chosen.scatter_(-1, top.indices, torch.isfinite(top.values))
    return keep & valid


@register
class OracleTopKPolicy(Policy):
    """Exact (or s-step-stale) per-step top-k attention: a yardstick for read selection."""

    name = "oracle_topk"
    axis = Axis.READ
    config_cls = OracleTopKConfig
    config: OracleTopKConfig

    def begin(self, batch: BatchState) -> None:
        self.history: list[list[torch.Tensor]] = [[] for _ in range(batch.cache.shape.layers)]

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        cfg = self.config
        k, v, valid = batch.cache.view(layer)  # [B, H, S, D], valid [B, S]
        b, hq, _, d = q.shape
        h = k.shape[1]
        logits = torch.matmul(q.view(b, h, hq // h, d), k.transpose(-1, -2)).float() * batch.scaling
        logits = logits.masked_fill(~valid.view(b, 1, 1, -1), float("-inf"))
        score = torch.softmax(logits, dim=-1).amax(dim=2)  # [B, H, S]
        if cfg.stale > 0:
            past = self.history[layer]
            past.append(score)
            if len(past) > cfg.stale + 1:
                past.pop(0)
            old = past[0]  # the score of `stale` steps back (or the oldest one there is)
            score = torch.nn.functional.pad(old, (0, score.shape[-1] - old.shape[-1]))
        keep = oracle_read_mask(score, batch.cache.lens[layer], cfg.k, cfg.sinks, cfg.recent)
        logits = logits.masked_fill(~keep.unsqueeze(2), float("-inf"))
        out = torch.matmul(torch.softmax(logits, dim=-1).to(v.dtype), v)
        return out.view(b, hq, 1, d)
