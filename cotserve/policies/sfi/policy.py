"""The SFI policy: Slow-Fast Inference (Xie et al., arXiv:2603.12038) on cotserve's KV cache.

State per sequence (slot), layer and KV head:

* sinks: the first `sinks` cache entries, always read;
* recent window: the last `recent` entries, read in place from the main cache (nothing copied);
* selected set: `k` entries per KV head (capped by what exists), chosen by the selector
  (`cotserve.policies.selector`) and packed, together with the sinks, into preallocated
  contiguous compact buffers once per refresh: keys transposed `ckt [layer, slot, kv_head, dim,
  sinks + k]`, values `cv [layer, slot, kv_head, sinks + k, dim]`.

Bootstrap: after prefill, each layer selects from the evidence of the last `prefill_window` prompt
queries (the paper's W = 16). Fast step: one softmax over compact buffer + recent window (`attention.fast_attention`),
batched over slots and heads. Slow step (per slot, when its `RefreshTrigger` fires): dense
attention over the whole history for that slot, whose logits for the last `obs_window` decode
queries (kept in a small ring buffer per layer; the paper's W = 1: the current query) feed the selector's evidence step; after the last
layer, the rest of the selector runs for all layers of the slot at once (the same problem per
layer, batched), then the compact buffers are re-packed. The bootstrap takes the same path.
Under the C++ kernel with one observation row and no fallback heads (the paper's defaults) the
slow slots' dense attention and evidence come from the fast step's own kernel call
(`cpu_decode.two_source_decode_evidence`), the selector runs in C++ (`cpu_decode.selector_select`)
and the re-pack is incremental (`cpu_decode.pack_compact_update`); the torch forms are their
references.

Telemetry per response: `sfi_slow_step_ratio` (slow steps / decode steps) and
`sfi_retained_ratio` (entries read / entries in context, averaged over layers, KV heads and
decode steps; a slow step reads everything, 1.0).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from cotserve.kernels import cpu_decode
from cotserve.policies import selector as sel
from cotserve.policies.base import Axis, Policy, Runtime, causal_prefill, grouped_attention
from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.registry import register
from cotserve.policies.sfi.attention import fast_attention, slow_attention
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.fallback import entries_read, page_bound_attention, page_bounds
from cotserve.policies.sfi.selection import (  # noqa: F401  (the selector's functions, also imported from here)
    candidates,
    evidence_of,
    mask_rows_inplace,
    select_from_evidence,
    select_positions,
    selector_scores_from_evidence,
)
from cotserve.policies.sfi.trigger import RefreshTrigger

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState
    from cotserve.policies.interface import PooledForm, PoolView

log = logging.getLogger(__name__)


def triton_runs(device: torch.device) -> bool:
    """Whether the paged runtime's Triton kernels can run on `device`: CUDA, or a CPU through
    Triton's interpreter (TRITON_INTERPRET=1, how the tests run them)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _use_kernel(cfg: SFIConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """The fast step runs the C++ kernel (`kernels/cpu_decode.cpp`) with `kernel=auto` on a CPU
    with a float32 cache, where the kernel builds; otherwise the torch form (`fast_attention`)."""
    return cfg.kernel == "auto" and device.type == "cpu" and dtype == torch.float32 and cpu_decode.available()


def _compact_dtype(cfg: SFIConfig, cache_dtype: torch.dtype, weight_dtype: torch.dtype | None,
                   kernel: bool) -> torch.dtype:
    """The compact buffers' dtype. bfloat16 only under the kernel (which widens entries to
    float32 before any product; torch's matmuls would round the logits to bf16): by default when
    the model's linear weights are bf16 (`--dtype bf16w`), whose v_proj outputs are bf16 numbers
    already (so are the cached values, unless v_proj adds a float32 bias, as Qwen2's does); keys,
    sinks included, are rounded after RoPE (relative error 2^-9 per element). Else the cache's
    dtype. The fidelity bench checks what this costs (docs/results/2026-11-29-sfi.md)."""
    if cfg.compact_dtype == "bfloat16" and not kernel:
        log.warning("sfi: compact_dtype=bfloat16 needs the CPU kernel; the compact buffers keep %s", cache_dtype)
    if not kernel or cfg.compact_dtype == "cache":
        return cache_dtype
    if cfg.compact_dtype == "bfloat16" or weight_dtype == torch.bfloat16:
        return torch.bfloat16
    return cache_dtype


@register
class SFIPolicy(Policy):
    """Slow-Fast Inference: sink + selected (compact) + recent reads, refreshed near sentence ends."""

    name = "sfi"
    axis = Axis.READ
    config_cls = SFIConfig
    runtimes = Runtime.ALL
    config: SFIConfig

    # -- setup ----------------------------------------------------------------------------
    def begin(self, batch: BatchState) -> None:
        cfg = self.config
        cache = batch.cache
        shape = cache.shape
        self.runtime = None  # the paged runtime (graph.py, pooled.py), when it serves this batch
        pool_slot = batch.pool_slot
        if pool_slot is not None and pool_slot.form is not None and list(batch.policy.parts) == [self]:
            # a slot of the continuous engine's pool: the pooled runtime (pooled.py), in its captured step
            self.runtime = pool_slot.join(cfg, batch)
            return
        if cfg.kernel == "paged" or (cfg.kernel == "auto" and batch.cuda_graphs):
            from cotserve.policies.sfi import graph

            alone = list(batch.policy.parts) == [self]
            if not triton_runs(cache.device):
                log.warning("sfi: kernel=paged needs Triton on CUDA (on a CPU only under TRITON_INTERPRET=1); "
                            "this batch decodes through the eager policy")
            elif graph.supported(cfg) and alone:
                self.runtime = graph.NativeGraphSFI(cfg, batch)
                return
            elif cfg.kernel == "paged":
                log.warning("sfi: kernel=paged serves SFI alone without fallback heads (dense_heads=0); "
                            "this batch decodes through the eager policy")
        L, B, H, D = shape.layers, shape.slots, shape.kv_heads, shape.head_dim  # noqa: N806
        dev, dt = cache.device, cache.k.dtype
        self.hq = batch.info.num_heads
        self.C = cfg.sinks + min(cfg.k, shape.capacity)
        self.kernel = _use_kernel(cfg, dev, dt)
        cdt = _compact_dtype(cfg, dt, batch.info.weight_dtype, self.kernel)
        if self.kernel:
            # the C++ kernel's layout: keys in blocks of 16 entries, [C / 16, D, 16] per head
            self.C = -(-self.C // 16) * 16
            self.ckt = torch.zeros(L, B, H, self.C // 16, D, 16, dtype=cdt, device=dev)
            # the cache row each compact entry holds (-1: none), for the incremental re-pack, and
            # the cache compaction epoch it refers to
            self.cidx = torch.full((L, B, H, self.C), -1, dtype=torch.long, device=dev)
            self.cidx_epoch = [[0] * B for _ in range(L)]
        else:
            # keys stored transposed ([D, C] per head: q.K^T is then a plain matmul, about twice
            # as fast on CPU as one over a transposed view)
            self.ckt = torch.zeros(L, B, H, D, self.C, dtype=cdt, device=dev)
        self.cv = torch.zeros(L, B, H, self.C, D, dtype=cdt, device=dev)
        self.cpos = torch.full((L, B, H, self.C), -1, dtype=torch.long, device=dev)
        w = cfg.obs_window
        self.ring = torch.zeros(L, B, self.hq, w, D, dtype=dt, device=dev)
        self.ring_pos = [[-1] * w for _ in range(B)]
        self.ring_ptr = [0] * B
        self.knorm = torch.zeros(L, B, H, shape.capacity, dtype=torch.float32, device=dev)
        self.knorm_upto = [[0] * B for _ in range(L)]
        self.knorm_epoch = [[0] * B for _ in range(L)]
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
        # evidence of the current forward's refreshing slots: slot -> per layer
        # (f [H, n], now, support instability [H] or None)
        self.evidence: dict[int, list[tuple[torch.Tensor, int, torch.Tensor | None] | None]] = {}
        # unstable-head fallback: which (layer, slot, KV head) take the fallback read on fast steps
        self.n_dense = round(cfg.dense_heads * L * H)
        # the slow step fused into the kernel's decode call (`cpu_decode.two_source_decode_evidence`):
        # one read of the keys gives the slow slots' dense attention and their evidence, for the
        # paper's one observation row (the current query) and no fallback heads (whose support
        # instability needs the torch form); the evidence lands in fbuf [L, B, H, capacity]
        self.fused_slow = self.kernel and cfg.obs_window == 1 and self.n_dense == 0 and cfg.alpha > 0
        if self.fused_slow:
            self.fbuf = torch.zeros(L, B, H, shape.capacity, dtype=torch.float32, device=dev)
        self.dense_by_layer: list[list[tuple[int, int]]] = []
        self.set_dense_heads(torch.zeros(L, B, H, dtype=torch.bool, device=dev))
        self.dense_sum = [0.0] * B
        self.instab_mean = torch.zeros(L, B, H, dtype=torch.float32, device=dev)  # over refreshes
        self.instab_count = [0] * B
        # page bounds of the fallback heads (`dense_budget` > 0): (layer, slot, head) ->
        # (bounds [2D, pages], cache compaction epoch); bounded pages per slot
        self.bounds: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}
        self.bounded_pages = [0] * B

    def pooled_form(self, pool: PoolView) -> PooledForm | None:
        """The paged runtime over every slot of the continuous engine's pool (`pooled.py`), for
        options it serves (`pooled.poolable`)."""
        from cotserve.policies.sfi.pooled import pooled_form

        return pooled_form(self.config, pool)

    # -- selection and packing -------------------------------------------------------------
    def _stash_evidence(self, layer: int, b: int, logits: torch.Tensor, row_pos: list[int], n: int,
                        batch: BatchState) -> None:
        """Selector step 1 for one (slot, layer) while its logits [H, G, R, n] are at hand; steps
        2-5 and the re-pack run for all layers at once after the last layer (`_select_slot`).
        Deferring is exact: in the step that computes it, a layer's new selection is never read
        (the slot takes a slow, dense step there)."""
        h, g, r, _ = logits.shape
        pos = batch.cache.pos[layer, b, :, :n]  # [H, n]
        mask_rows_inplace(logits, pos, torch.tensor(row_pos, device=pos.device), self.config.sinks)
        cfg = self.config
        oldest = min(range(r), key=row_pos.__getitem__)
        # evidence f and, for the fallback, the support instability, in one set of passes
        f, instab = sel.evidence_and_instability(logits, cfg.alpha, cfg.k, cfg.recent, oldest, self.n_dense > 0)
        self.evidence.setdefault(b, [None] * self.n_layers)[layer] = (f, max(row_pos), instab)

    def _key_norms(self, li: torch.Tensor | slice, layers: list[int], b: int, n: int, cache) -> torch.Tensor:
        """||k|| of the first n entries of slot b in `layers` [l, H, n], computed once per entry
        (incrementally) and recomputed after the cache compacts the row."""
        batched: dict[int, list[int]] = {}
        for layer in layers:
            if self.knorm_epoch[layer][b] != cache.compactions[layer][b]:
                self.knorm_upto[layer][b] = 0
                self.knorm_epoch[layer][b] = cache.compactions[layer][b]
            upto = self.knorm_upto[layer][b]
            if n - upto > 64:  # many rows (bootstrap, after a compaction): per layer, on views
                self.knorm[layer, b, :, upto:n] = cache.k[layer, b, :, upto:n].float().norm(dim=-1)
            elif upto < n:  # the few rows written since the last refresh: all layers in one op
                batched.setdefault(upto, []).append(layer)
            self.knorm_upto[layer][b] = max(upto, n)
        for upto, ls in batched.items():
            lt = torch.tensor(ls, device=cache.device)
            self.knorm[lt, b, :, upto:n] = cache.k[lt, b, :, upto:n].float().norm(dim=-1)
        return self.knorm[li, b, :, :n]

    def _select_slot(self, b: int, batch: BatchState) -> None:
        """Selector steps 2-5 and the re-pack of slot b's compact buffers, batched over the layers
        (grouped by entry count, equal unless an eviction policy compacted layers differently)."""
        cfg, cache = self.config, batch.cache
        per_layer = self.evidence.pop(b)
        groups: dict[tuple[int, int], list[int]] = {}
        for layer, item in enumerate(per_layer):
            if item is not None:
                groups.setdefault((item[0].shape[-1], item[1]), []).append(layer)
        for (n, now), layers in groups.items():
            if self.fused_slow and len(layers) == self.n_layers:
                f = self.fbuf[:, b, :, :n]  # the kernel wrote every layer's evidence here: a view
            else:
                f = torch.stack([per_layer[layer][0] for layer in layers])  # [l, H, n]
            # all layers (the usual case): views; otherwise copies of the chosen layers
            li = slice(None) if len(layers) == self.n_layers else torch.tensor(layers, device=cache.device)
            pos = cache.pos[li, b, :, :n]  # [l, H, n]
            idx = select_from_evidence(cfg, f, pos, self._key_norms(li, layers, b, n, cache), now, self.kernel)
            self._pack(layers, b, n, idx, pos, cache)
            self.k_eff[b] = idx.shape[-1]
        if self.n_dense > 0:
            self._choose_dense_heads(b, per_layer)
            self._take_page_bounds(b, batch)

    def _choose_dense_heads(self, b: int, per_layer: list) -> None:
        """The unstable-head fallback (ours; `dense_heads`, `dense_min`): until the next refresh,
        slot b's `n_dense` KV heads (over all layers) with the largest support instability
        (`selector.support_instability`, averaged over this sequence's refreshes so far, bootstrap
        included: whether a head retrieves is a property of the head, and one refresh's 8 rows
        are a small sample) above `dense_min` take the fallback read on fast steps (`_dense_head`),
        the others their SFI selection."""
        layers = [i for i, item in enumerate(per_layer) if item is not None]
        lt = torch.tensor(layers, device=self.dense.device)
        m = self.instab_count[b]
        instab = (self.instab_mean[lt, b] * m + torch.stack([per_layer[i][2] for i in layers])) / (m + 1)
        self.instab_mean[lt, b] = instab  # [l, H]: the running mean over this sequence's refreshes
        self.instab_count[b] = m + 1
        flat = instab.flatten()
        top = flat.topk(min(self.n_dense, flat.numel()))
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[top.indices[top.values > self.config.dense_min]] = True
        dense = self.dense.clone()
        dense[lt, b] = chosen.view(instab.shape)
        self.set_dense_heads(dense)

    def _take_page_bounds(self, b: int, batch: BatchState) -> None:
        """Quest page bounds (`fallback.page_bounds`) of slot b's fallback heads, over the full
        pages before the recent window (the window only moves forward, so they stay before it)."""
        cfg, cache = self.config, batch.cache
        for key in [key for key in self.bounds if key[1] == b]:
            del self.bounds[key]
        if cfg.dense_budget == 0:
            return
        self.bounded_pages[b] = max(0, int(cache.lens[0, b]) - cfg.recent) // cfg.dense_page  # for telemetry
        for layer, heads in enumerate(self.dense_by_layer):
            pages = max(0, int(cache.lens[layer, b]) - cfg.recent) // cfg.dense_page  # layers may differ
            for slot, h in heads:
                if slot == b:
                    kb = page_bounds(cache.k[layer, b, h, : pages * cfg.dense_page], cfg.dense_page)
                    self.bounds[(layer, b, h)] = (kb, cache.compactions[layer][b])

    def set_dense_heads(self, dense: torch.Tensor) -> None:
        """Which (layer, slot, KV head) take the fallback read on fast steps from now on: bool [L, B, H]."""
        self.dense = dense
        self.dense_frac = dense.float().mean(dim=(0, 2)).tolist()  # per slot, for the telemetry
        self.dense_by_layer = [[] for _ in range(self.n_layers)]
        for layer, slot, head in dense.nonzero().tolist():
            self.dense_by_layer[layer].append((slot, head))

    def _pack(self, layers: list[int], b: int, n: int, idx: torch.Tensor, pos: torch.Tensor, cache) -> None:
        """Write sinks + selected entries (idx [l, H, ke]) of slot b into the compact buffers: under
        the C++ kernel incrementally (`cpu_decode.pack_compact_update`: only the rows newly chosen
        since the last refresh are read, into the entries of those that left); otherwise one `index_select` each for
        K and V over the cache's flat [entries, D] view (row indices computed for every layer and
        head at once; `KVCache` buffers are contiguous), then one strided copy into the buffers."""
        ns = min(self.config.sinks, n)
        keys = torch.cat([torch.arange(ns, device=idx.device).expand(*idx.shape[:-1], ns), idx], dim=-1)
        nl, h, m = keys.shape
        sel = slice(None) if nl == self.n_layers else torch.tensor(layers, device=idx.device)
        if self.kernel and m > 0:
            # incremental, in C++: the rows still chosen stay where they are in the buffers, only the
            # new ones are read and converted (a compaction of the cache renumbers its rows: full re-pack)
            for layer in layers:
                if self.cidx_epoch[layer][b] != cache.compactions[layer][b]:
                    self.cidx[layer, b] = -1
                    self.cidx_epoch[layer][b] = cache.compactions[layer][b]
            lt = torch.tensor(layers, device=idx.device)
            cpu_decode.pack_compact_update(cache.k, cache.v, b, keys, lt, self.ckt, self.cv, self.cidx)
            ci = self.cidx[sel, b]  # [l, H, C]
            self.cpos[sel, b] = torch.where(ci >= 0, torch.gather(pos, 2, ci.clamp(min=0)), -1)
            return
        self.cpos[sel, b] = -1
        self.cpos[sel, b, :, :m] = torch.gather(pos, 2, keys)
        if m == 0:
            return
        lt = torch.tensor(layers, device=idx.device)
        _, slots, heads, cap, d = cache.k.shape
        row0 = ((lt.view(-1, 1) * slots + b) * heads + torch.arange(h, device=idx.device)) * cap  # [l, H]
        flat = (keys + row0.unsqueeze(-1)).view(-1)
        kk = torch.index_select(cache.k.view(-1, d), 0, flat).view(nl, h, m, d)
        self.ckt[sel, b, :, :, :m] = kk.transpose(-1, -2)
        self.cv[sel, b, :, :m] = torch.index_select(cache.v.view(-1, d), 0, flat).view(nl, h, m, d)

    # -- the paged runtime's hooks ------------------------------------------------------------
    def graph_ready(self) -> bool:
        return getattr(self, "runtime", None) is not None

    def before_step(self, batch: BatchState) -> None:
        if self.runtime is not None:
            self.runtime.plan(batch)

    # -- prefill: dense causal attention + bootstrap selection ------------------------------
    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> torch.Tensor:
        out = causal_prefill(q, k, v, batch.scaling)
        if self.runtime is not None:
            self.runtime.prefill(layer, q, batch)
            return out
        w_max, r_max = self.config.prefill_window, self.config.obs_window
        hkv = k.shape[1]
        for b in range(q.shape[0]):
            n = int(batch.prompt_lens[b])
            w = min(w_max, n)
            qrows = q[b, :, n - w : n]  # [Hq, w, D]: the bootstrap's evidence rows
            r = min(r_max, w)  # the ring (decode-time evidence rows) starts with the last r of them
            self.ring[layer, b, :, :r] = qrows[:, w - r :]
            row_pos = list(range(n - w, n))
            if layer == 0:
                self.ring_pos[b] = row_pos[w - r :] + [-1] * (r_max - r)
                self.ring_ptr[b] = r % r_max
            kk = batch.cache.k[layer, b, :, :n]
            g = self.hq // hkv
            logits = torch.matmul(qrows.reshape(hkv, g * w, -1) * batch.scaling, kk.transpose(-1, -2)).float()
            logits = logits.view(hkv, g, w, n)
            self._stash_evidence(layer, b, logits, row_pos, n, batch)
        if layer == self.n_layers - 1:
            for b in list(self.evidence):
                self._select_slot(b, batch)
        return out

    # -- decode ----------------------------------------------------------------------------
    def _plan(self, batch: BatchState) -> None:
        """Once per decode step (at layer 0): slow/fast per slot, ring slots, window masks, and
        which compact entries each layer reads (those older than the recent window)."""
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
        if self.fused_slow and self.slow_slots:
            self.slow_t = torch.zeros(len(self.triggers), dtype=torch.bool, device=self.bidx.device)
            self.slow_t[self.slow_slots] = True
        dev = self.bidx.device
        r = cfg.recent
        self.wstart = [max(0, n - r) for n in self.lens]
        self.lo, self.hi = min(self.wstart), max(self.lens)
        ar = torch.arange(self.lo, self.hi, device=dev)
        ws = torch.tensor(self.wstart, device=dev)
        lens_t = torch.tensor(self.lens, device=dev)
        self.wrange = (ws, lens_t)  # the kernel's window rows
        self.wmask = ((ar >= ws.view(-1, 1)) & (ar < lens_t.view(-1, 1))).unsqueeze(1)
        wstart_t = ws.clamp(max=batch.cache.capacity - 1)
        self.any_fast = len(self.slow_slots) < sum(bool(a) for a in active) or not self.slow_slots
        if r > 0:  # position where each (layer, slot, head)'s window starts: [L, B, H]
            wpos = batch.cache.pos[:, self.bidx, :, wstart_t].permute(1, 0, 2)
            self.cmask = (self.cpos >= 0) & (self.cpos < wpos.unsqueeze(-1))
        else:
            self.cmask = self.cpos >= 0
        reads = self.cmask.sum(dim=-1)  # [L, B, H] compact entries read
        if self.n_dense > 0:  # a fallback head reads every entry outside the window, or its pages
            outside = [self._fallback_reads(b, w) for b, w in enumerate(self.wstart)]
            reads = torch.where(self.dense, torch.tensor(outside, device=dev).view(1, -1, 1), reads)
        self.read_acc = reads.sum(dim=0)  # [B, H] entries read outside the window, over all layers

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        if self.runtime is not None:
            return self.runtime.attend(layer, q)
        if layer == 0:
            self._plan(batch)
        cache = batch.cache
        self.ring[layer, self.bidx, :, self.ptr_t] = q[:, :, 0]
        if self.fused_slow and self.slow_slots:
            out = self._fast(layer, q, batch, fused=True)
            for b in self.slow_slots:
                item = (self.fbuf[layer, b, :, : self.lens[b]], self.ring_pos[b][self.ptr_now[b]], None)
                self.evidence.setdefault(b, [None] * self.n_layers)[layer] = item
            if layer == self.n_layers - 1:
                for b in list(self.evidence):
                    self._select_slot(b, batch)
            return out
        if self.any_fast:
            out = self._fast(layer, q, batch)
            heads = [(b, h) for b, h in self.dense_by_layer[layer] if b not in self.slow_slots and self.active_now[b]]
            if heads:
                self._fallback(layer, heads, q, out, batch)
        else:
            out = torch.zeros_like(q)
        for b in self.slow_slots:
            n = self.lens[b]
            rows = [i for i, p in enumerate(self.ring_pos[b]) if p >= 0]
            cur = rows.index(self.ptr_now[b])
            qrows = self.ring[layer, b, :, rows]
            o, logits = slow_attention(qrows, cur, cache.k[layer, b, :, :n], cache.v[layer, b, :, :n], batch.scaling)
            out[b] = o
            self._stash_evidence(layer, b, logits, [self.ring_pos[b][i] for i in rows], n, batch)
        if layer == self.n_layers - 1:
            for b in list(self.evidence):
                self._select_slot(b, batch)
        return out

    def _fast(self, layer: int, q: torch.Tensor, batch: BatchState, fused: bool = False) -> torch.Tensor:
        """The fast step of every slot; `fused` (the kernel's fused slow step): the slow slots'
        dense attention and evidence in the same call."""
        cache = batch.cache
        if self.kernel:
            b, hq, _, d = q.shape
            hkv = self.ckt.shape[2]
            args = (q.view(b, hkv, hq // hkv, d), self.ckt[layer], self.cv[layer], self.cmask[layer], cache.k[layer],
                    cache.v[layer], *self.wrange, batch.scaling)
            if fused:
                out = cpu_decode.two_source_decode_evidence(*args, self.slow_t, self.fbuf[layer], self.config.sinks,
                                                            self.config.alpha)
            else:
                out = cpu_decode.two_source_decode(*args)
            return out.view(b, hq, 1, d)
        wk = cache.k[layer, :, :, self.lo : self.hi]
        wv = cache.v[layer, :, :, self.lo : self.hi]
        return fast_attention(q, self.ckt[layer], self.cv[layer], self.cmask[layer], wk, wv, self.wmask,
                              batch.scaling)

    def _fallback_reads(self, b: int, outside: int) -> int:
        """Entries outside the recent window that one fallback head of slot b reads this step (by
        layer 0's bounded pages: after a cache compaction, until the next refresh, an estimate)."""
        cfg = self.config
        if cfg.dense_budget == 0:
            return outside
        read = entries_read(self.bounded_pages[b], cfg.dense_budget, cfg.dense_page, cfg.sinks, self.wstart[b])
        return max(0, min(outside, read))

    def _fallback(self, layer: int, heads: list[tuple[int, int]], q: torch.Tensor, out: torch.Tensor,
                  batch: BatchState) -> None:
        """The fallback reads of this layer's fallback heads (slot, KV head): under the C++ kernel,
        the page-bound reads of all of them in one call (`cpu_decode.page_bound_decode`, rows
        read in place); otherwise, and for heads without fresh bounds, one at a time
        (`_dense_head`)."""
        cache = batch.cache
        if self.kernel and self.config.dense_budget > 0:
            paged = [(b, h) for b, h in heads if (bd := self.bounds.get((layer, b, h))) is not None
                     and bd[1] == cache.compactions[layer][b]]
            if paged:
                dev = q.device
                slots = torch.tensor([b for b, _ in paged], device=dev)
                kv_heads = torch.tensor([h for _, h in paged], device=dev)
                lens = cache.lens[layer, slots]  # this layer's (an eviction stack may compact layers differently)
                hkv = self.dense.shape[-1]
                groups = q.view(q.shape[0], hkv, self.hq // hkv, -1)
                cfg = self.config
                o = cpu_decode.page_bound_decode(groups[slots, kv_heads], cache.k[layer], cache.v[layer], slots,
                                                 kv_heads, lens, [self.bounds[(layer, b, h)][0] for b, h in paged],
                                                 cfg.dense_budget, cfg.dense_page, cfg.sinks, batch.scaling)
                out.view(groups.shape)[slots, kv_heads] = o
                done = set(paged)
                heads = [bh for bh in heads if bh not in done]
        for b, h in heads:
            self._dense_head(layer, b, h, q, out, batch)

    def _dense_head(self, layer: int, b: int, h: int, q: torch.Tensor, out: torch.Tensor, batch: BatchState) -> None:
        """The fallback read of slot b's KV head h (its GQA group of query heads), written over the
        fast step's output for that group: Quest page bounds pick `dense_budget` entries
        (`fallback.page_bound_attention`), or, with `dense_budget=0` or bounds made stale by a
        cache compaction, dense attention over the whole history."""
        cache = batch.cache
        n = int(cache.lens[layer, b])  # this layer's (an eviction stack may compact layers differently)
        g = self.hq // self.dense.shape[-1]
        grp = slice(h * g, (h + 1) * g)
        bounds = self.bounds.get((layer, b, h))
        if bounds is not None and bounds[1] == cache.compactions[layer][b]:
            o, _ = page_bound_attention(q[b, grp], cache.k[layer, b, h, :n], cache.v[layer, b, h, :n], bounds[0],
                                        self.config.dense_budget, self.config.dense_page, batch.scaling,
                                        self.config.sinks)
            out[b, grp] = o
            return
        kv = (cache.k[layer, b : b + 1, h : h + 1, :n], cache.v[layer, b : b + 1, h : h + 1, :n])
        out[b : b + 1, grp] = grouped_attention(q[b : b + 1, grp], *kv, None, batch.scaling)

    def after_forward(self, batch: BatchState) -> None:
        if batch.mode != "decode" or self.runtime is not None:  # the runtime counts in `plan`
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
                if self.n_dense > 0:
                    self.dense_sum[b] += self.dense_frac[b]

    def describe(self) -> dict[str, Any]:
        if self.runtime is not None:
            return {"fast_step": "paged_triton", "compact_dtype": str(self.runtime.cv.dtype).replace("torch.", "")}
        return {"fast_step": "cpu_kernel" if self.kernel else "torch",
                "compact_dtype": str(self.cv.dtype).replace("torch.", "")}

    def telemetry(self, slot: int) -> dict[str, Any]:
        if self.runtime is not None:
            st = self.runtime.states[slot]
            return {**self.runtime.telemetry(st), "sfi_dense_head_ratio": 0.0}
        n = self.steps[slot]
        return {
            "sfi_steps": n,
            "sfi_slow_steps": self.slow_steps[slot],
            "sfi_slow_step_ratio": round(self.slow_steps[slot] / n, 4) if n else 0.0,
            "sfi_retained_ratio": round(self.retained_sum[slot] / n, 4) if n else 1.0,
            "sfi_selected_per_head": self.k_eff[slot],
            "sfi_dense_head_ratio": round(self.dense_sum[slot] / max(n - self.slow_steps[slot], 1), 4),
        }
