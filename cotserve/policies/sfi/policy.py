"""The SFI policy: Slow-Fast Inference (Xie et al., arXiv:2603.12038) on cotserve's KV cache.

State per sequence (slot), layer and KV head:

* sinks: the first `sinks` cache entries, always read;
* recent window: the last `recent` entries, read in place from the main cache (nothing copied);
* selected set: `k` entries per KV head (capped by what exists), chosen by the selector
  (`cotserve.policies.selector`) and packed, together with the sinks, into a preallocated
  contiguous compact buffer `ck/cv [layer, slot, kv_head, sinks + k, dim]` once per refresh.

Bootstrap: after prefill, each layer selects from the evidence of the last `obs_window` prompt
queries. Fast step: one softmax over compact buffer + recent window (`attention.fast_attention`),
batched over slots and heads. Slow step (per slot, when its `RefreshTrigger` fires): dense
attention over the whole history for that slot, whose logits for the last `obs_window` decode
queries (kept in a small ring buffer per layer) feed the selector; then re-select and re-pack.

Telemetry per response: `sfi_slow_step_ratio` (slow steps / decode steps) and
`sfi_retained_ratio` (entries read / entries in context, averaged over layers, KV heads and
decode steps; a slow step reads everything, 1.0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cotserve.policies import selector as sel
from cotserve.policies.base import Axis, Policy, causal_prefill
from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.registry import register
from cotserve.policies.sfi.attention import fast_attention, slow_attention
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger

if TYPE_CHECKING:
    from cotserve.engine.batch import BatchState


def select_positions(cfg: SFIConfig, logits: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor,
                     key_norms: torch.Tensor, now: int) -> torch.Tensor:
    """The whole SFI selector for one (sequence, layer): cache indices to keep per KV head.

    logits [H, R, S] (R = GQA group x observation rows), allowed bool [H, R, S] (causal per row;
    None: already applied to `logits` as -inf), positions [H, S] true positions of the entries,
    key_norms [H, S]. Candidates are the entries after the sinks. Returns long
    [H, min(k, S - sinks)] sorted ascending."""
    h, _, s = logits.shape
    idx = torch.arange(s, device=logits.device)
    cand = (idx >= cfg.sinks).unsqueeze(0).expand(h, s)
    k_eff = min(cfg.k, s - cfg.sinks)
    if k_eff <= 0:
        return torch.empty(h, 0, dtype=torch.long, device=logits.device)
    f = sel.evidence(logits, allowed, cand, cfg.alpha)
    factors = [sel.position_prior(positions, now, cfg.decay, cfg.tail_len, cfg.brake)]
    if cfg.norm_power != 0.0:
        factors.append(sel.key_norm_prior(key_norms, cand, cfg.norm_power))
    r = sel.prior(factors, cand)
    lam = sel.stability_lambda(f, r, cfg.lam_clip) if cfg.lam < 0 else cfg.lam
    fuse = sel.geometric_fusion if cfg.fusion == "geometric" else sel.linear_fusion
    logs = fuse(f, r, lam, cand)
    logs = sel.soft_nms(logs, cfg.nms_window, cfg.nms_strength)
    logs = sel.cross_head_exclusivity(logs, cfg.excl_strength, cfg.excl_temperature)
    return sel.topk_per_head(logs, k_eff)


def mask_rows_inplace(logits: torch.Tensor, positions: torch.Tensor, row_pos: torch.Tensor, sinks: int) -> None:
    """Write -inf where a query row may not look: the sinks (always read, so not candidates) and,
    per row, entries newer than the row's own position (causal). logits [H, G, R, S], positions
    [H, S] sorted ascending per head, row_pos [R]. Only the tail newer than the oldest row is
    touched, so this costs O(R x window) instead of a full mask."""
    logits[..., :sinks] = float("-inf")
    h, _, r, s = logits.shape
    oldest = row_pos.min().view(1, 1).expand(h, 1).contiguous()
    cut = int(torch.searchsorted(positions.contiguous(), oldest, right=True).min())
    if cut < s:
        tail = positions[:, cut:]  # [H, T]
        bad = tail.unsqueeze(1) > row_pos.view(1, r, 1)  # [H, R, T]
        logits[..., cut:].masked_fill_(bad.unsqueeze(1), float("-inf"))


@register
class SFIPolicy(Policy):
    """Slow-Fast Inference: sink + selected (compact) + recent reads, refreshed near sentence ends."""

    name = "sfi"
    axis = Axis.READ
    config_cls = SFIConfig
    config: SFIConfig

    # -- setup ----------------------------------------------------------------------------
    def begin(self, batch: BatchState) -> None:
        cfg = self.config
        cache = batch.cache
        shape = cache.shape
        L, B, H, D = shape.layers, shape.slots, shape.kv_heads, shape.head_dim  # noqa: N806
        dev, dt = cache.device, cache.k.dtype
        self.hq = batch.info.num_heads
        self.C = cfg.sinks + min(cfg.k, shape.capacity)
        self.ck = torch.zeros(L, B, H, self.C, D, dtype=dt, device=dev)
        self.cv = torch.zeros_like(self.ck)
        self.cpos = torch.full((L, B, H, self.C), -1, dtype=torch.long, device=dev)
        w = cfg.obs_window
        self.ring = torch.zeros(L, B, self.hq, w, D, dtype=dt, device=dev)
        self.ring_pos = [[-1] * w for _ in range(B)]
        self.ring_ptr = [0] * B
        self.knorm = torch.zeros(L, B, H, shape.capacity, dtype=torch.float32, device=dev)
        self.knorm_upto = [[0] * B for _ in range(L)]
        tok = batch.info.tokenizer
        self.boundaries = sentence_end_ids(tok) if tok is not None else frozenset()
        self.triggers = [RefreshTrigger(cfg.trigger, cfg.min_gap, cfg.max_interval, cfg.cooldown, cfg.period)
                         for _ in range(B)]
        self.bidx = torch.arange(B, device=dev)
        self.n_layers = L
        self.steps = [0] * B
        self.slow_steps = [0] * B
        self.retained_sum = [0.0] * B
        self.k_eff = [0] * B
        self.read_acc = torch.zeros(B, H, dtype=torch.long, device=dev)
        self.slow_slots: list[int] = []

    # -- selection and packing -------------------------------------------------------------
    def _refresh(self, layer: int, b: int, logits: torch.Tensor, row_pos: list[int], n: int,
                 batch: BatchState) -> None:
        """Run the selector on one slot's logits [H, G, R, n] and re-pack its compact buffer."""
        cfg, cache = self.config, batch.cache
        h, g, r, _ = logits.shape
        pos = cache.pos[layer, b, :, :n]  # [H, n]
        rp = torch.tensor(row_pos, device=pos.device)
        mask_rows_inplace(logits, pos, rp, cfg.sinks)
        upto = self.knorm_upto[layer][b]
        if upto < n:
            self.knorm[layer, b, :, upto:n] = cache.k[layer, b, :, upto:n].float().norm(dim=-1)
            self.knorm_upto[layer][b] = n
        idx = select_positions(cfg, logits.reshape(h, g * r, n), None, pos, self.knorm[layer, b, :, :n],
                               now=max(row_pos))
        kk, vv = cache.k[layer, b, :, :n], cache.v[layer, b, :, :n]
        self.cpos[layer, b].fill_(-1)
        ns = min(cfg.sinks, n)
        self.ck[layer, b, :, :ns] = kk[:, :ns]
        self.cv[layer, b, :, :ns] = vv[:, :ns]
        self.cpos[layer, b, :, :ns] = pos[:, :ns]
        ke = idx.shape[1]
        if ke:
            hi = torch.arange(kk.shape[0], device=idx.device).unsqueeze(1)
            s0 = cfg.sinks
            self.ck[layer, b, :, s0 : s0 + ke] = kk[hi, idx]  # row copies (faster than gather on CPU)
            self.cv[layer, b, :, s0 : s0 + ke] = vv[hi, idx]
            self.cpos[layer, b, :, s0 : s0 + ke] = torch.gather(pos, 1, idx)
        self.k_eff[b] = ke

    # -- prefill: dense causal attention + bootstrap selection ------------------------------
    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> torch.Tensor:
        out = causal_prefill(q, k, v, batch.scaling)
        w_max = self.config.obs_window
        hkv = k.shape[1]
        for b in range(q.shape[0]):
            n = int(batch.prompt_lens[b])
            w = min(w_max, n)
            qrows = q[b, :, n - w : n]  # [Hq, w, D]
            self.ring[layer, b, :, :w] = qrows
            row_pos = list(range(n - w, n))
            if layer == 0:
                self.ring_pos[b] = row_pos + [-1] * (w_max - w)
                self.ring_ptr[b] = w % w_max
            kk = batch.cache.k[layer, b, :, :n]
            g = self.hq // hkv
            logits = torch.matmul(qrows.reshape(hkv, g * w, -1), kk.transpose(-1, -2)).float()
            logits = logits.mul_(batch.scaling).view(hkv, g, w, n)
            self._refresh(layer, b, logits, row_pos, n, batch)
        return out

    # -- decode ----------------------------------------------------------------------------
    def _plan(self, batch: BatchState) -> None:
        """Once per decode step (at layer 0): slow/fast per slot, ring slots, window masks."""
        cfg = self.config
        t = batch.step
        active = batch.active.tolist() if batch.active is not None else [True] * len(self.triggers)
        positions = batch.positions.tolist()
        self.lens = batch.cache.lens[0].tolist()
        self.slow_slots = []
        self.ptr_now = []
        for b, trig in enumerate(self.triggers):
            p = self.ring_ptr[b]
            self.ptr_now.append(p)
            self.ring_pos[b][p] = int(positions[b])
            self.ring_ptr[b] = (p + 1) % cfg.obs_window
            if not active[b]:
                continue
            toks = batch.tokens[b]
            after = len(toks) >= 2 and toks[-2] in self.boundaries
            if trig.step(t, after):
                self.slow_slots.append(b)
        self.active_now = active
        self.ptr_t = torch.tensor(self.ptr_now, device=self.bidx.device)
        dev = self.bidx.device
        r = cfg.recent
        self.wstart = [max(0, n - r) for n in self.lens]
        self.lo, self.hi = min(self.wstart), max(self.lens)
        ar = torch.arange(self.lo, self.hi, device=dev)
        ws = torch.tensor(self.wstart, device=dev).view(-1, 1)
        self.wmask = ((ar >= ws) & (ar < torch.tensor(self.lens, device=dev).view(-1, 1))).unsqueeze(1)
        self.wstart_t = ws.view(-1).clamp(max=batch.cache.capacity - 1)
        self.any_fast = len(self.slow_slots) < sum(bool(a) for a in active) or not self.slow_slots
        self.read_acc.zero_()

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        if layer == 0:
            self._plan(batch)
        cache = batch.cache
        self.ring[layer, self.bidx, :, self.ptr_t] = q[:, :, 0]
        if self.any_fast:
            out = self._fast(layer, q, batch)
        else:
            out = torch.zeros_like(q)
        for b in self.slow_slots:
            n = self.lens[b]
            rows = [i for i, p in enumerate(self.ring_pos[b]) if p >= 0]
            cur = rows.index(self.ptr_now[b])
            qrows = self.ring[layer, b, :, rows]
            o, logits = slow_attention(qrows, cur, cache.k[layer, b, :, :n], cache.v[layer, b, :, :n], batch.scaling)
            out[b] = o
            self._refresh(layer, b, logits, [self.ring_pos[b][i] for i in rows], n, batch)
        return out

    def _fast(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        cache = batch.cache
        cpos = self.cpos[layer]
        if self.config.recent > 0:
            wpos = cache.pos[layer, self.bidx, :, self.wstart_t]  # [B, H] position where the window starts
            cmask = (cpos >= 0) & (cpos < wpos.unsqueeze(-1))
        else:
            cmask = cpos >= 0
        self.read_acc.add_(cmask.sum(-1))
        wk = cache.k[layer, :, :, self.lo : self.hi]
        wv = cache.v[layer, :, :, self.lo : self.hi]
        return fast_attention(q, self.ck[layer], self.cv[layer], cmask, wk, wv, self.wmask, batch.scaling)

    def after_forward(self, batch: BatchState) -> None:
        if batch.mode != "decode":
            return
        read = (self.read_acc.float().mean(-1) / self.n_layers).tolist()
        wcount = self.wmask.sum(-1).view(-1).tolist()
        slow = set(self.slow_slots)
        for b, act in enumerate(self.active_now):
            if not act:
                continue
            self.steps[b] += 1
            if b in slow:
                self.slow_steps[b] += 1
                self.retained_sum[b] += 1.0
            else:
                self.retained_sum[b] += min(1.0, (read[b] + wcount[b]) / max(self.lens[b], 1))

    def telemetry(self, slot: int) -> dict[str, Any]:
        n = self.steps[slot]
        return {
            "sfi_steps": n,
            "sfi_slow_steps": self.slow_steps[slot],
            "sfi_slow_step_ratio": round(self.slow_steps[slot] / n, 4) if n else 0.0,
            "sfi_retained_ratio": round(self.retained_sum[slot] / n, 4) if n else 1.0,
            "sfi_selected_per_head": self.k_eff[slot],
        }
