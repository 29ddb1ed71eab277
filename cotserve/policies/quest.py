"""`quest`: query-aware page selection for reading; nothing is evicted.

Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"
(arXiv 2406.10774), Sec. 3.3-3.4, Algorithm 1 and Fig. 5: the cache is split into pages of
`page_size` tokens; each page keeps the per-channel minimum m and maximum M of its keys. For the
current query q the criticality of a page is the upper bound of q . k over its keys,

    U(page) = sum_i max(q_i * m_i, q_i * M_i)   (>= q . k for every key k in the page),

and only the top pages (budget / page_size of them) are read by this step's attention, plus the
current (last, partly filled) page. The paper's setup leaves the first two layers dense
(`dense_layers=2`), where attention is not sparse enough.

Here, per KV head (GQA): the bound is computed for each query head of the group and the group's
bounds are added (`group_reduce=sum`, the default: the sum of the heads' bounds bounds the sum of
their scores, i.e. the group's total attention logit); `max` takes the largest head's bound instead.
Page bounds are kept incrementally: each decode step folds the one new key into its page's
min/max; a (layer, slot) is rebuilt from its cache only when its length shows that another policy
compacted it (length != covered entries + 1). Prefill attention is the engine's dense causal default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cotserve.policies.attention_parts import attend, decode_probs
from cotserve.policies.base import Axis, Policy, PolicyConfig
from cotserve.policies.options import QuestOptions, check_config, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(QuestOptions)
class QuestConfig(PolicyConfig):
    """`QuestOptions`: the token budget, the page size, the dense first layers, the GQA reduction."""

    def validate(self) -> None:
        check_config(self)


def page_bounds(k: torch.Tensor, length: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max keys of each page of the first `length` entries: k [Hkv, S, D] ->
    (min, max) [Hkv, ceil(length / page_size), D]; the last page covers only its real entries."""
    h, _, d = k.shape
    pages = -(-length // page_size)
    kk = k[:, :length].float()
    pad = pages * page_size - length
    if pad:
        kk_lo = torch.cat([kk, kk.new_full((h, pad, d), float("inf"))], 1)
        kk_hi = torch.cat([kk, kk.new_full((h, pad, d), float("-inf"))], 1)
    else:
        kk_lo = kk_hi = kk
    return (kk_lo.view(h, pages, page_size, d).amin(2), kk_hi.view(h, pages, page_size, d).amax(2))


def page_upper_bounds(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, how: str) -> torch.Tensor:
    """U = sum_i max(q_i m_i, q_i M_i) per page and KV head: q [B, Hq, 1, D], mins/maxs [B, Hkv, P, D]
    -> [B, Hkv, P] (the group's query heads combined by `how`: sum | max)."""
    b, hq, _, d = q.shape
    hkv = mins.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, 1, d)
    ub = torch.maximum(qg * mins.unsqueeze(2), qg * maxs.unsqueeze(2)).sum(-1)  # [B, Hkv, G, P]
    return ub.sum(2) if how == "sum" else ub.amax(2)


def select_pages(ub: torch.Tensor, lens: torch.Tensor, page_size: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages read per KV head: the `top` highest bounds among the complete-or-not pages before
    the current one, plus the current page (the one holding entry lens - 1).

    ub [B, Hkv, P]; lens [B]. Returns (pages [B, Hkv, top' + 1], ok [B, Hkv, top' + 1]) with
    top' = min(top, P); `ok` is False for slots of the top set that had no page to fill them."""
    b, h, p = ub.shape
    cur = (lens - 1) // page_size  # [B]
    page_ids = torch.arange(p, device=ub.device)
    eligible = page_ids.unsqueeze(0) < cur.unsqueeze(1)  # [B, P]: real pages before the current one
    masked = ub.masked_fill(~eligible.unsqueeze(1), float("-inf"))
    kp = min(top, p)
    vals, idx = masked.topk(kp, dim=-1)
    ok = torch.isfinite(vals)
    pages = torch.cat([idx, cur.view(b, 1, 1).expand(b, h, 1)], dim=-1)
    ok = torch.cat([ok, torch.ones(b, h, 1, dtype=torch.bool, device=ub.device)], dim=-1)
    return pages, ok


def pages_to_tokens(pages: torch.Tensor, ok: torch.Tensor, lens: torch.Tensor, page_size: int,
                    limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry indices [B, Hkv, n * page_size] of the selected pages, and their validity (selected,
    inside the slot's length). Invalid indices are clamped into range (masked, never attended)."""
    b, h, n = pages.shape
    idx = (pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=pages.device)).view(b, h, -1)
    valid = ok.repeat_interleave(page_size, dim=-1) & (idx < lens.view(b, 1, 1))
    return idx.clamp(max=limit - 1), valid


@register
class QuestPolicy(Policy):
    """Quest (Tang et al. 2024): per-step top pages by min/max key bounds; read axis."""

    name = "quest"
    axis = Axis.READ
    config_cls = QuestConfig

    def __init__(self, config: QuestConfig | None = None):
        super().__init__(config)
        self.mins: dict[int, torch.Tensor] = {}
        self.maxs: dict[int, torch.Tensor] = {}
        self.covered: dict[int, torch.Tensor] = {}  # layer -> entries covered by the bounds [B]
        self.read = torch.zeros(0)
        self.total = torch.zeros(0)
        self.rebuilds = 0

    def begin(self, batch: BatchState) -> None:
        s = batch.cache.shape
        pages = -(-s.capacity // self.config.page_size)
        dev = batch.cache.device
        for layer in range(self.config.dense_layers, s.layers):
            self.mins[layer] = torch.zeros(s.slots, s.kv_heads, pages, s.head_dim, device=dev)
            self.maxs[layer] = torch.zeros(s.slots, s.kv_heads, pages, s.head_dim, device=dev)
            self.covered[layer] = torch.full((s.slots,), -1, dtype=torch.long, device=dev)
        self.read = torch.zeros(s.slots, dtype=torch.float64, device=dev)
        self.total = torch.zeros(s.slots, dtype=torch.float64, device=dev)

    def _update_bounds(self, layer: int, batch: BatchState) -> None:
        """Fold the newest entry of each slot into its page; rebuild slots another policy compacted."""
        cache, ps = batch.cache, self.config.page_size
        lens = cache.lens[layer]
        mins, maxs, covered = self.mins[layer], self.maxs[layer], self.covered[layer]
        stale = lens != covered + 1
        if bool(stale.any()):
            for slot in stale.nonzero().flatten().tolist():
                n = int(lens[slot])
                lo, hi = page_bounds(cache.k[layer, slot], n, ps)
                mins[slot, :, : lo.shape[1]] = lo
                maxs[slot, :, : hi.shape[1]] = hi
                self.rebuilds += 1
        fresh = ~stale
        if bool(fresh.any()):
            slots = torch.arange(lens.shape[0], device=lens.device)
            idx = lens - 1
            page = idx // ps
            newk = cache.k[layer, slots, :, idx].float()  # [B, Hkv, D]
            first = (idx % ps == 0).view(-1, 1, 1)
            lo = torch.where(first, newk, torch.minimum(mins[slots, :, page], newk))
            hi = torch.where(first, newk, torch.maximum(maxs[slots, :, page], newk))
            keep_old = stale.view(-1, 1, 1)
            mins[slots, :, page] = torch.where(keep_old, mins[slots, :, page], lo)
            maxs[slots, :, page] = torch.where(keep_old, maxs[slots, :, page], hi)
        covered.copy_(lens)

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor | None:
        if layer < self.config.dense_layers:
            return None  # the engine's dense decode
        cfg: QuestConfig = self.config
        self._update_bounds(layer, batch)
        k, v, _ = batch.cache.view(layer)
        s = k.shape[2]
        lens = batch.cache.lens[layer]
        p = -(-s // cfg.page_size)
        ub = page_upper_bounds(q, self.mins[layer][:, :, :p], self.maxs[layer][:, :, :p], cfg.group_reduce)
        pages, ok = select_pages(ub, lens, cfg.page_size, cfg.budget // cfg.page_size)
        idx, valid = pages_to_tokens(pages, ok, lens, cfg.page_size, s)
        d = k.shape[-1]
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, d)
        kg, vg = torch.gather(k, 2, gather), torch.gather(v, 2, gather)
        self.read += valid.sum(-1).double().mean(-1)
        self.total += lens.double()
        return attend(decode_probs(q, kg, valid, batch.scaling), vg)

    def telemetry(self, slot: int) -> dict[str, Any]:
        total = float(self.total[slot]) if self.total.numel() else 0.0
        return {"read_ratio": round(float(self.read[slot]) / total, 4) if total else 1.0,
                "page_rebuilds": self.rebuilds}
