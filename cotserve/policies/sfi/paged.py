"""SFI's graph-safe state on a paged KV cache, shared by vLLM's CUDA backend
(`cotserve.vllm.graph_sfi`) and the native engine's CUDA graphs (`cotserve.policies.sfi.graph`).

Everything a captured decode step reads lives in persistent tensors, allocated once:

* compact buffers `ck`, `cv` [L, slots, Hkv, C, D] and their positions `cpos` [L, slots, Hkv, C]
  (-1 = empty), C = sinks + k rounded up to 64; per slot the entries in use, `ccount` (sinks + k:
  the fast step reads no further);
* rings [L, slots + 1, W, Hq, D] of query rows (slot `slots` is scratch: rows of no SFI sequence
  write there);
* per batch row: mode (0 not SFI, 1 SFI: compact entries older than the window start plus the
  window), slot, token index, window start, length; the ring writes of the step (token, slot, ring
  index); per layer, row and KV head the compact entries' cutoff (`row_cws`: the window start, or,
  for a sequence whose cache an eviction policy compacted, the true position of the head's first
  window entry).

A sequence that also evicts keeps SFI in the terms its eviction hands it: lengths, window start and
block rows are physical (its cache after compactions), positions true. Its compact entries hold
true positions, a refresh masks and weighs entries by their true positions (`SlotState.refresh_pos`,
taken at the step that computed the evidence, with that step's block row), and the compact buffers,
being copies, stay readable after their entries left the cache, until the next refresh.

A refresh (`refresh`) computes the evidence of a sequence's ring rows over its history, the rows
read from the ring and the keys in place from the paged cache (`kernels.sfi_refresh.ring_logits_layers`),
runs the selector's steps 2-5 (the fused Triton selector, or `cotserve.policies`' own functions) on
all layers at once, and re-packs the compact buffers and their positions
(`pack_selection_layers`). Both kernels read many layers in one launch through a table of the
layers' offsets (`PagedLayers`, taken once and kept while the engine's cache tensors stay the same
objects): one launch per chunk of layers, not one per layer; a refresh is issued between two steps,
so it launches as little as it can (one host-to-device copy, the two kernels, the selector's two and
the top-K with its sort).
The engine-specific part, how the cache is viewed as pages and how rows are planned each step,
is the subclass's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cotserve.kernels.sfi_paged import sfi_paged_fast
from cotserve.kernels.sfi_refresh import PagedLayers, pack_selection_layers, ring_logits_layers
from cotserve.kernels.sfi_select import fused_supported, selector_scores, topk_sorted
from cotserve.policies import selector as sel
from cotserve.policies.options import SFIOptions, option_default
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.selection import select_from_evidence
from cotserve.policies.sfi.state import SFIRequestState, sfi_telemetry


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list, or nested lists) on `device` without waiting for the GPU.

    A copy from pageable host memory synchronizes the stream first: the host would wait for every
    queued kernel, the step vLLM's asynchronous scheduling has in flight included, and its next step
    would no longer be planned while the GPU runs this one. On CUDA the values go through pinned
    memory instead; PyTorch's caching host allocator records the copy's event and reuses that block
    only after the copy ran, so a fresh tensor per step is safe however far the host runs ahead."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def ring_rows(row_pos: list[int], ring_idx: list[int], slots: list[int], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A refresh's ring rows (their positions and ring indices) and its requests' slots on `device`
    as int32, in one transfer (`to_device`), each part starting 16 bytes apart from the first: Triton
    compiles a kernel per pointer alignment, and these are always aligned, as the warm-up's are."""
    r, r4 = len(row_pos), -(-len(row_pos) // 4) * 4
    pad = [0] * (r4 - r)
    host = to_device([*row_pos, *pad, *ring_idx, *pad, *slots], torch.int32, device)
    return host[:r], host[r4 : r4 + r], host[2 * r4 : 2 * r4 + len(slots)]


def padded(*shape: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """An uninitialized tensor of `shape` whose rows are allocated to a multiple of 16 entries: the
    strides the refresh kernels see are then multiples of 16 whatever the length, so Triton
    compiles them once (at admission) and never again inside a slow step."""
    *lead, last = shape
    return torch.empty(*lead, -(-max(last, 1) // 16) * 16, dtype=dtype, device=device)[..., :last]


W_MAX = 32  # obs_window at most
# float32 logits a refresh holds at once: requests are refreshed together and layers in chunks
# under this many (one layer of one request may exceed it); its working set, about twice this many
# floats, is what a vLLM engine reserves for it (`cotserve.vllm.gpu_memory`)
REFRESH_FLOATS = 1 << 28


@dataclass
class SlotState(SFIRequestState):
    """A request's state in the paged form: its slot of the persistent buffers, and its refresh
    due at the next step (`refresh_pos` [L, Hkv, refresh_n] and `refresh_blocks`: a compacted
    sequence's terms, `SFIRequestState`)."""

    slot: int = field(kw_only=True)
    refresh_n: int = 0  # > 0: a refresh over this many entries is due at the next step
    refresh_lo: int = 0  # ... from the query rows at positions [refresh_lo, refresh_hi)
    refresh_hi: int = 0  # (0: refresh_n; they differ once an eviction policy compacted the cache)
    short_steps: int = 0  # decode steps taken densely while the context was too short to skip anything
    short: bool = True  # the last step was such a step (the first one past the length is slow)
    catch_up: int = 0  # dense steps left that fill the ring before it selects (admitted late, or a stale buffer)
    catch_up_steps: int = 0  # decode steps taken densely while the ring filled so
    wait_steps: int = 0  # decode steps taken densely before a slot was free (admitted late)

    def telemetry(self) -> dict[str, float | int]:
        out = super().telemetry()
        if self.short_steps:
            out["sfi_short_dense_steps"] = self.short_steps
        if self.catch_up_steps:
            out["sfi_catch_up_dense_steps"] = self.catch_up_steps
        if self.wait_steps:
            out["sfi_wait_dense_steps"] = self.wait_steps
        return out


def compact_len(max_k: int, max_sinks: int = 16) -> int:
    """C, a compact buffer's entries: sinks + k rounded up to 64."""
    return -(-(max_k + max_sinks) // 64) * 64


def slot_bytes(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               max_k: int, max_sinks: int = 16) -> int:
    """Bytes `PagedSFI` allocates per slot: compact K and V, their positions, the ring of query rows."""
    elem = torch.empty((), dtype=dtype).element_size()
    c = compact_len(max_k, max_sinks)
    return num_layers * (num_kv_heads * c * (2 * head_dim * elem + 4) + W_MAX * num_heads * head_dim * elem)


class PagedSFI:
    """Compact buffers, rings, row tensors and the batched refresh (module docstring)."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device, slots: int, max_rows: int,
                 max_k: int = option_default(SFIOptions, "k"), max_sinks: int = 16):
        self.L, self.hq, self.hkv, self.d = num_layers, num_heads, num_kv_heads, head_dim
        self.g = num_heads // num_kv_heads
        self.scale = scale
        self.device = torch.device(device)
        self.slots = slots
        self.max_rows = max_rows
        self.max_k = max_k
        self.C = compact_len(max_k, max_sinks)
        L, S, H, C, D = self.L, slots, num_kv_heads, self.C, head_dim  # noqa: N806
        dev = self.device
        sb = max(S, 1)  # no slots (an engine that serves no SFI): one small unused slot keeps the kernels' pointers valid
        self.ck = torch.zeros(L, sb, H, C, D, dtype=dtype, device=dev)
        self.cv = torch.zeros(L, sb, H, C, D, dtype=dtype, device=dev)
        self.cpos = torch.full((L, sb, H, C), -1, dtype=torch.int32, device=dev)
        self.ccount = torch.zeros(sb, dtype=torch.int32, device=dev)  # entries in use per slot (the re-pack's)
        self.ring = torch.zeros(L, S + 1, W_MAX, num_heads, D, dtype=dtype, device=dev)
        r = max_rows
        # the row tensors and the step's ring writes as views of two packed buffers: one copy each per step
        self.rows_t = torch.zeros(5, r, dtype=torch.int32, device=dev)
        self.row_mode, self.row_slot, self.row_tok, self.row_ws, self.row_len = self.rows_t.unbind(0)
        self.row_cws = torch.zeros(L, r, H, dtype=torch.int32, device=dev)
        nw = r * 4  # ring writes per step: one per decode row, a few per prefill row (more go eager)
        self.nw = nw
        self.writes_t = torch.zeros(3, nw, dtype=torch.long, device=dev)
        self.w_tok, self.w_slot, self.w_idx = self.writes_t.unbind(0)
        self.w_slot.fill_(S)  # the scratch slot: nothing kept
        self.extra_writes: list[tuple[int, int, int]] = []  # ring writes beyond nw (eager steps only)
        self.refreshes = 0
        self._warmed: set[tuple] = set()
        self._logits: torch.Tensor | None = None  # `logits_buffer`'s storage
        self._layers: tuple[tuple, PagedLayers] | None = None  # `paged_layers`' cache: (the engine's cache objects, views)

    def logits_buffer(self, *shape: int) -> torch.Tensor:
        """float32 `shape` laid out as `padded` lays it out, a view of one buffer that every chunk of
        every refresh reuses (grown when a refresh needs more): the refresh's largest tensor never
        goes through the allocator, and the next chunk's logits do not sit beside the last one's.
        Each chunk's logits are consumed (selector scores or evidence) before the next is written."""
        *lead, last = shape
        n16 = -(-max(last, 1) // 16) * 16
        numel = n16
        for x in lead:
            numel *= x
        if self._logits is None or self._logits.numel() < numel:
            self._logits = None
            self._logits = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._logits[:numel].view(*lead, n16)[..., :last]

    def reserve_logits(self, floats: int | None = None) -> None:
        """Allocate the refreshes' logits buffer now (CUDA: while the model loads, inside vLLM's
        budget): `REFRESH_FLOATS` plus the rows' padding to 16 entries."""
        floats = REFRESH_FLOATS if floats is None else floats
        self.logits_buffer(floats // 16 + floats // 256, 16)

    # -- inside the step (captured) -------------------------------------------------------------
    def attend_fast(self, layer: int, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_table: torch.Tensor, rows: int | None = None,
                    row_cws: torch.Tensor | None = None) -> None:
        """One layer's SFI part of the step, q and out [tokens, Hq, D]: the step's query rows of SFI
        requests into their rings (scratch slot for the rest) and the fast rows' attention over
        compact buffer + window into `out`, in one launch (`sfi_paged_fast` with `ring`)."""
        sfi_paged_fast(q, out, self.ck[layer], self.cv[layer], self.cpos[layer], key_cache, value_cache, block_table,
                       self.row_mode, self.row_slot, self.row_tok, self.row_ws, self.row_len, self.scale, rows=rows,
                       row_cws=row_cws, ring=(self.ring[layer], self.w_tok, self.w_slot, self.w_idx), ccount=self.ccount)
        for tok, slot, w in self.extra_writes:  # writes beyond the ring-write tensors: eager steps only
            self.ring[layer, slot, w] = q[tok]

    # -- refresh: evidence, selection, re-pack -------------------------------------------------
    def refresh_all(self, due: list[tuple[SlotState, torch.Tensor]], block_size: int) -> None:
        """Run the due refreshes, those with the same options, length and ring rows together."""
        groups: dict[tuple, list[tuple[SlotState, torch.Tensor]]] = {}
        for st, blocks in due:
            hi = st.refresh_hi or st.refresh_n
            rows = tuple(p for p in st.ring_pos if max(0, st.refresh_lo) <= p < hi)
            own = id(st) if st.refresh_pos is not None else None  # its own entry positions: alone
            groups.setdefault((repr(st.cfg), st.refresh_n, rows, own), []).append((st, blocks))
        for (_, n, rows, _), group in groups.items():
            # requests at once: one layer of the part's float32 logits stays under REFRESH_FLOATS
            per = max(1, REFRESH_FLOATS // max(1, self.hq * len(rows) * n))
            for a in range(0, len(group), per):
                part = group[a : a + per]
                # one request's block row as a view (no copy launched) where it is 16-byte aligned, as the
                # warm-up's is (Triton compiles a kernel per pointer alignment); else stacked (a fresh tensor)
                row = part[0][1]
                bt = row.unsqueeze(0) if len(part) == 1 and row.data_ptr() % 16 == 0 else torch.stack(
                    [b for _, b in part])
                self.refresh([st for st, _ in part], bt, block_size)

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as paged views [blocks, block, H, D] (the engine's layout)."""
        raise NotImplementedError

    def _cache_objects(self) -> tuple:
        """The engine's cache tensors the layer views are taken of (compared by identity: when the
        engine binds new ones, the views are taken again)."""
        raise NotImplementedError

    def paged_layers(self) -> PagedLayers:
        """Every layer's paged keys and values with their offset tables, for the refresh's one-launch
        kernels; taken once and kept while the engine's cache tensors stay the same objects."""
        objs = self._cache_objects()
        cached = self._layers
        if cached is None or len(cached[0]) != len(objs) or any(a is not b for a, b in zip(cached[0], objs, strict=True)):
            kv = [self._kv(li) for li in range(self.L)]
            cached = self._layers = (objs, PagedLayers.of([k for k, _ in kv], [v for _, v in kv]))
        return cached[1]

    def refresh(self, states: list[SlotState], blocks: torch.Tensor, block_size: int,
                budget: int = REFRESH_FLOATS) -> None:
        """Evidence of the ring's rows over the first `refresh_n` entries, then selector steps 2-5
        and the re-pack, for every layer of J requests with equal options, length and ring rows
        (`blocks` [J, max blocks]); the layers go in chunks that keep the float32 logits under
        `budget` elements. A compacted sequence (alone in its group) brings its entries' true
        positions (`refresh_pos`): they mask the rows causally, weigh the prior and fill `cpos`."""
        st0 = states[0]
        cfg, n = st0.cfg, st0.refresh_n
        hi = st0.refresh_hi or n
        idx = [i for i, p in enumerate(st0.ring_pos) if max(0, st0.refresh_lo) <= p < hi]
        rp = [st0.ring_pos[i] for i in idx]
        now, oldest, r, j = max(rp), min(rp), len(idx), len(states)
        tpos = st0.refresh_pos  # [L, H, n] true positions, or None: each entry's index
        for st in states:
            st.refresh_n = st.refresh_hi = 0
            st.refresh_pos = st.refresh_blocks = None
        dev = self.device
        row_pos, ridx, slots = ring_rows(rp, idx, [st.slot for st in states], dev)
        chunk = max(1, min(self.L, budget // max(1, j * self.hq * r * n)))
        fused = fused_supported(cfg) and tpos is None  # the fused selector's prior reads indices as positions
        views = self.paged_layers()
        k_eff = max(0, min(cfg.k, n - cfg.sinks))
        keeps, fs, norms_all = [], [], []
        for l0 in range(0, self.L, chunk):
            nl = min(self.L, l0 + chunk) - l0
            logits = self.logits_buffer(j, nl, self.hkv, self.g * r, n)
            norms = padded(j, nl, self.hkv, n, device=dev)
            # one read of the keys, in place, with the ring's rows as queries, causal by index
            ring_logits_layers(self.ring, slots, ridx, row_pos, self.scale, views, l0, nl, blocks, n, logits, norms,
                               causal=tpos is None and oldest + 1 < n)
            logits = logits.view(j, nl, self.hkv, self.g, r, n)
            if not fused:  # the fused selector never reads the sinks' logits (its candidates start after them)
                logits[..., : cfg.sinks] = float("-inf")
            if tpos is not None:  # causal, by true position
                tp = tpos[l0 : l0 + nl].view(1, nl, self.hkv, 1, 1, n)
                logits.masked_fill_(tp > row_pos.view(r, 1), float("-inf"))
            if fused:  # the whole selector in two kernels, then the top-K
                scores = selector_scores(cfg, logits.view(j * nl, self.hkv, self.g * r, n),
                                         norms.view(j * nl, self.hkv, n), now)
                keeps.append(topk_sorted(scores, k_eff).view(j, nl, self.hkv, k_eff))
            else:
                f, _ = sel.evidence_and_instability(logits, cfg.alpha, cfg.k, cfg.recent, 0, False)
                fs.append(f)
                norms_all.append(norms)
        if fused:
            keep = keeps[0] if len(keeps) == 1 else torch.cat(keeps, 1)  # [J, L, H, k]
        else:
            f = torch.cat(fs, 1)  # [J, L, H, n]
            where = torch.arange(n, device=dev).expand(j, self.L, self.hkv, n) if tpos is None else tpos.unsqueeze(0)
            keep = select_from_evidence(cfg, f, where, torch.cat(norms_all, 1), now)
        # the re-pack: the sinks and the kept entries, read straight from the paged cache, and their
        # (true) positions into the slots' `cpos`, in one launch
        tp = None if tpos is None else tpos.to(torch.int64).contiguous()
        pack_selection_layers(keep.contiguous(), min(cfg.sinks, n), tp, blocks, views, self.ck, self.cv, self.cpos,
                              slots, ccount=self.ccount)
        for st in states:
            st.k_eff = keep.shape[-1]

    def _warm(self, cfg: SFIConfig, slot: int = 0) -> None:
        """Compile the refresh kernels for these options' row counts now (at admission, during the
        prompt) rather than inside the first slow step of a decoding request."""
        key = (cfg.obs_window, cfg.prefill_window, fused_supported(cfg))
        if key in self._warmed:
            return
        self._warmed.add(key)
        views = self.paged_layers()  # also checks, at admission, that the layers' caches are uniform
        dev = self.device
        bt = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        n = views.keys[0].shape[1]  # one block
        for rows in sorted({cfg.obs_window, cfg.prefill_window}):
            row_pos, ridx, scratch = ring_rows([0] * rows, [0] * rows, [self.slots], dev)  # reads the scratch slot
            logits, norms = padded(1, 1, self.hkv, self.g * rows, n, device=dev), padded(1, 1, self.hkv, n, device=dev)
            ring_logits_layers(self.ring, scratch, ridx, row_pos, self.scale, views, 0, 1, bt, n, logits, norms,
                               causal=True)
            if fused_supported(cfg):
                topk_sorted(selector_scores(cfg, logits[:, 0], norms[:, 0], n - 1), 1)
        # the re-pack of nothing into the slot being admitted (no entry copied; its positions say empty)
        slot_t = torch.tensor([slot], dtype=torch.int32, device=dev)
        keep = padded(1, self.L, self.hkv, 16, dtype=torch.long, device=dev)[..., :0]
        pack_selection_layers(keep, 0, None, bt, views, self.ck, self.cv, self.cpos, slot_t, ccount=self.ccount)

    # -- telemetry -----------------------------------------------------------------------------
    telemetry = staticmethod(sfi_telemetry)
