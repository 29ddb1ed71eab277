"""SFI state for graph-captured decoding on vLLM's paged cache (the CUDA backend's runtime): the
buffers and the refresh are `cotserve.policies.sfi.paged.PagedSFI`'s; this module plans vLLM's
batch rows each step and views vLLM's cache as pages.

Everything a captured step reads lives in persistent tensors, allocated once:

* compact buffers `ck`, `cv` [L, slots, Hkv, C, D] and their positions `cpos` [L, slots, Hkv, C]
  (-1 = empty), C = sinks + k rounded up to 64;
* rings [L, slots + 1, W, Hq, D] of query rows (slot `slots` is scratch: dense rows write there);
* per batch row: mode (0 dense or prefill, 1 fast, 2 slow), slot, token index, window start,
  length; the ring writes of the step (token, slot, ring index);
* FlashAttention's lengths (a fast row's is 1: FlashAttention then reads almost nothing of it).

`step` runs once per step in the metadata builder, outside any graph: it finishes the refreshes
due from the previous step (evidence of the ring's rows over the paged history, selector steps
2-5, re-pack; `refresh`), decides every row with the native policy's `RefreshTrigger`, and fills
the tensors. The evidence, fusion, soft-NMS, exclusivity and top-K are `cotserve.policies`' own
functions, run on all layers of a request at once.
"""

from __future__ import annotations

import logging
import time

import torch

from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.options import SFIOptions, option_default
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.paged import W_MAX, PagedSFI, SlotState, padded, to_device
from cotserve.policies.sfi.state import ring_size, sfi_telemetry
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.compat import host_lens
from cotserve.vllm.step_clock import StepClock, step_counters
from cotserve.vllm.telemetry import allocator_counters, telemetry_on, write_telemetry

__all__ = ["GraphSFI", "SlotState", "W_MAX", "padded", "ring_size", "sfi_telemetry", "write_telemetry"]

log = logging.getLogger(__name__)


class GraphSFI(PagedSFI):
    def __init__(self, layers: list, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device, slots: int, max_rows: int, rows: BatchRows,
                 max_k: int | None = None, max_sinks: int = 16, tokenizer=None):
        max_k = option_default(SFIOptions, "k") if max_k is None else max_k
        super().__init__(len(layers), num_heads, num_kv_heads, head_dim, scale, dtype, device, slots, max_rows,
                         max_k, max_sinks)
        self.layers = layers
        self.rows = rows  # the process's batch rows (`process.runtimes().rows`)
        self.boundaries = sentence_end_ids(tokenizer) if tokenizer is not None else frozenset()
        self.fa_lens = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self._one = torch.ones((), dtype=torch.int32, device=self.device)
        self._rows_set = self._writes_set = 0  # rows and ring writes the last plan set (`_step`)
        self.free = list(range(slots))
        self.finished: list[SlotState] = []
        self.any_sfi = False
        self.warmed_up = False
        self._no_slots_warned = False
        self._busy_warned = False
        self.host_s = self.refresh_host_s = 0.0  # CPU time in `step`, and in its refreshes
        # the last step's refreshes run, slow rows and SFI rows (fast, slow or short-dense), for the step clock
        self.step_refreshes = self.step_slow = self.step_sfi = 0
        self.step_clock: StepClock | None = None  # set by the step's plan while the telemetry is on
        if slots and self.device.type == "cuda":
            self.reserve_logits()  # made at model load: counted in vLLM's budget, never allocated in a step
        log.info("sfi: %d slots, C=%d, %.2f GiB of compact buffers", slots, self.C,
                 2 * self.ck.numel() * self.ck.element_size() / 2**30)

    def warm_up(self, li: int, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, block_table: torch.Tensor) -> None:
        """Compile SFI's kernels while the engine starts, before it serves: the refresh kernels for the
        paper's default options (`_warm`) and the fast step's kernel for every launch a batch of
        1 .. max_rows rows can ask for (`sfi_launch.fast_launch`; the captured batch sizes compile only
        their own, and an eager step of another size would compile inside a request). Run once, on a step
        that is not being captured (its launches would be in the graph), with the step's own cache and
        block table, on one row of mode 0 into scratch outputs: nothing a request reads is written."""
        if self.warmed_up:
            return
        self.warmed_up = True
        if self.slots == 0:
            return
        from cotserve.kernels.sfi_launch import fast_launch
        from cotserve.kernels.sfi_paged import sfi_paged_fast

        self._warm(SFIConfig(), self.free[0] if self.free else 0)
        mode = torch.zeros_like(self.row_mode[:1])
        q1, o1 = torch.zeros_like(q[:1]), torch.empty_like(out[:1])
        # the step's ring writes as the step launches them, all to the scratch slot (nothing kept)
        scratch = (torch.zeros_like(self.w_tok), torch.full_like(self.w_slot, self.slots), torch.zeros_like(self.w_idx))
        launches = {fast_launch(r, self.hkv, self.device, self.d) for r in range(1, self.max_rows + 1)}
        for launch in sorted(launches):
            sfi_paged_fast(q1, o1, self.ck[li], self.cv[li], self.cpos[li], key_cache, value_cache, block_table[:1],
                           mode, self.row_slot[:1], self.row_tok[:1], self.row_ws[:1], self.row_len[:1], self.scale,
                           rows=1, launch=launch, row_cws=self.row_cws[li][:1], ring=(self.ring[li], *scratch),
                           ccount=self.ccount)

    # -- per step, outside the graph -----------------------------------------------------------
    def refresh_due(self, cm, block_size: int) -> None:
        """Finish the refreshes due from the previous step (evidence, selection, re-pack) on the
        cache as that step left it: before the eviction runtime's `plan`, which may compact it."""
        t0 = time.perf_counter()
        due: list[tuple[SlotState, torch.Tensor]] = []
        for i in range(min(cm.num_reqs, self.max_rows)):
            req = self.rows.rows.get(i)
            if req is not None and isinstance(req.state, SlotState) and req.state.refresh_n:
                st = req.state
                due.append((st, st.refresh_blocks if st.refresh_blocks is not None else cm.block_table_tensor[i]))
        self.refresh_all(due, block_size)
        self.refreshes += len(due)
        self.step_refreshes = len(due)
        dt = time.perf_counter() - t0
        self.refresh_host_s += dt
        self.host_s += dt

    def step(self, cm, block_size: int, head_size: int | None = None, evict=None) -> torch.Tensor:
        """Plan the step (after `refresh_due` and the eviction runtime's `plan`: `cm` in physical
        terms for the requests that evict, `evict` that runtime); returns FlashAttention's lengths
        (a view of a persistent buffer)."""
        t0 = time.perf_counter()
        try:
            return self._step(cm, block_size, evict)
        finally:
            self.host_s += time.perf_counter() - t0

    def _step(self, cm, block_size: int, evict=None) -> torch.Tensor:
        for gone in self.rows.take_released():
            self._release(gone)
        self.step_slow = self.step_sfi = 0
        n_reqs = cm.num_reqs
        if not self.any_sfi and not any(r.sfi is not None for r in self.rows.rows.values()):
            # no SFI request in this step nor the last: the row tensors already say "all dense" (and
            # the ring writes go to the scratch slot), so only FlashAttention's lengths are written
            fa = self.fa_lens[: cm.seq_lens.shape[0]]
            fa.copy_(cm.seq_lens, non_blocking=True)
            self.extra_writes = []
            return fa
        # fresh host values each step, sent through pinned memory (`to_device`): a CPU that runs ahead of
        # the GPU (asynchronous scheduling) neither waits for it nor overwrites a pending transfer. Only
        # the rows this step or the last one used are sent (the others already say "dense"), and only
        # the ring writes this step or the last one made (the others already go to the scratch slot):
        # the host builds and converts a few dozen values, not the buffers' thousands
        nr = min(n_reqs, self.max_rows)
        span = max(nr, self._rows_set)
        host = [[0] * span for _ in range(5)]  # mode, slot, token, window start, length per row
        wcols: list[list[int]] = [[], [], []]  # ring writes: token, slot, ring index
        self.extra_writes = []
        any_sfi = False
        qsl = cm.query_start_loc_cpu[: n_reqs + 1].tolist() if n_reqs else [0]
        cuts: list[tuple[int, torch.Tensor | int]] = []  # compacted rows: their per-(layer, head) cutoffs
        for i in range(nr):
            req = self.rows.rows.get(i)
            if req is None or req.sfi is None:
                continue
            st = req.state
            tok, ntok = qsl[i], qsl[i + 1] - qsl[i]
            if st is None:
                st = self._admit(req, cm, i, ntok)
                if st is None:
                    continue
            any_sfi = True
            if ntok == 0:
                continue
            self.step_sfi += 1
            est = req.evict_state if req.evict is not None and evict is not None else None
            new_len = st.kv_len + ntok  # true length
            st.kv_len = new_len
            phys = est.n_phys if est is not None else new_len  # entries in the cache
            w = len(st.ring_pos)
            if new_len <= st.prompt_len:  # prefill: record the prompt's last rows
                m = min(w, ntok)
                for p in range(new_len - m, new_len):
                    entry = (tok + p - (new_len - ntok), st.slot, p % w)
                    self._ring_entry(wcols, entry)
                    st.ring_pos[p % w] = p
                if new_len == st.prompt_len and phys > st.cfg.sinks + st.cfg.k + st.cfg.recent and not st.catch_up:
                    # the bootstrap: the prompt's last prefill_window rows (a shorter prompt decodes
                    # densely until its context is long enough to skip entries, then selects; one
                    # admitted too late in its prompt for those rows catches up in its decode steps)
                    st.refresh_n, st.refresh_lo, st.refresh_hi = phys, new_len - st.cfg.prefill_window, new_len
                    self._refresh_terms(st, est, evict, cm, i, phys)
                continue
            pos = new_len - 1
            ws = max(0, phys - st.cfg.recent)
            if ntok > 1:  # several new tokens past the prompt (not a decode step): its compact buffer is stale
                st.catch_up = max(st.catch_up, st.cfg.obs_window, 1)
            if phys <= st.cfg.sinks + st.cfg.k + st.cfg.recent or st.catch_up:
                # too short to skip anything (a fast step would read as many entries), or too few
                # query rows in its ring to select (admitted late): a dense step, no refresh; the
                # query row still goes to the ring for the first selection
                st.steps += 1
                if st.catch_up:
                    st.catch_up -= 1
                    st.catch_up_steps += 1
                else:
                    st.short_steps += 1
                st.short = True
                st.retained_sum += 1.0
                self._ring_entry(wcols, (tok + ntok - 1, st.slot, pos % w))
                st.ring_pos[pos % w] = pos
                self._row(host, i, (0, st.slot, tok, ws, phys))
                continue
            seq_prev = req.output_ids[-2] if len(req.output_ids) >= 2 else (
                req.prompt_ids[-1] if req.prompt_ids else -1)
            slow = st.trigger.step(st.steps, seq_prev in self.boundaries)
            if st.short and (st.short_steps or st.catch_up_steps):  # the first step past those selects
                slow = True
                st.trigger.reset(st.steps)
            st.short = False
            st.steps += 1
            if est is not None and est.pos is not None:
                cuts.append((i, self._cutoff(est, ws, phys)))
            self._ring_entry(wcols, (tok, st.slot, pos % w))
            st.ring_pos[pos % w] = pos
            self._row(host, i, (2 if slow else 1, st.slot, tok, ws, phys))
            if slow:
                self.step_slow += 1
                st.slow_steps += 1
                st.retained_sum += 1.0
                st.refresh_n, st.refresh_lo, st.refresh_hi = phys, new_len - st.cfg.obs_window, new_len
                self._refresh_terms(st, est, evict, cm, i, phys)
            else:  # an upper bound: compact entries the window covers are counted as read
                read = min(st.k_eff + min(st.cfg.sinks, phys), ws) + (phys - ws)
                st.retained_sum += min(1.0, read / phys)
        self.any_sfi = any_sfi
        # the row plan and the ring writes in one transfer (the GPU is never waited for), copied on the
        # device into the packed row tensors (int32) and ring writes (long): two copies
        nwrite = len(wcols[0])
        wspan = max(nwrite, self._writes_set)
        pad = [0] * (wspan - nwrite)
        scratch = [self.slots] * (wspan - nwrite)
        flat = [*host[0], *host[1], *host[2], *host[3], *host[4], *wcols[0], *pad, *wcols[1], *scratch, *wcols[2], *pad]
        plan = to_device(flat, torch.long, self.device)
        if span:
            self.rows_t[:, :span].copy_(plan[: 5 * span].view(5, span), non_blocking=True)
        if wspan:
            self.writes_t[:, :wspan].copy_(plan[5 * span :].view(3, wspan), non_blocking=True)
        self._rows_set, self._writes_set = nr, nwrite
        if any_sfi and span:  # each head's compact cutoff: the window start, or a compacted row's true positions
            self.row_cws[:, :span].copy_(self.row_ws[:span].view(1, -1, 1).expand(self.L, span, self.hkv))
            for i, cut in cuts:
                self.row_cws[:, i] = cut
        lens = cm.seq_lens
        n = lens.shape[0]
        fa = self.fa_lens[:n]
        torch.where(self.row_mode[:n] == 1, self._one, lens, out=fa)
        return fa

    def _ring_entry(self, wcols: list[list[int]], entry: tuple[int, int, int]) -> None:
        """One ring write of the step: into the ring-write tensors while they have room, else eager."""
        if len(wcols[0]) < self.nw:
            for col, v in zip(wcols, entry, strict=True):
                col.append(v)
        else:
            self.extra_writes.append(entry)

    @staticmethod
    def _row(host: list[list[int]], i: int, values: tuple[int, int, int, int, int]) -> None:
        for col, v in zip(host, values, strict=True):
            col[i] = v

    def _refresh_terms(self, st: SlotState, est, evict, cm, row: int, phys: int) -> None:
        """A refresh due for an evicting request reads the cache as this step leaves it: keep its
        block row (physical) and, once it has compacted, its entries' true positions."""
        if est is None:
            return
        st.refresh_blocks = cm.block_table_tensor[row].clone()
        st.refresh_pos = evict.positions(est, phys) if est.pos is not None else None

    @staticmethod
    def _cutoff(est, ws: int, phys: int) -> torch.Tensor | int:
        """The true position [L, Hkv] of each head's window entry `ws` (physical) of a compacted
        request: among the entries its last compaction kept, or in the tail that followed them (one
        position for every head)."""
        kept = est.pos.shape[-1]
        return est.pos[:, :, ws].to(torch.int32) if ws < kept else est.tail_start + ws - kept

    def _admit(self, req: RowRequest, cm=None, row: int = 0, ntok: int = 0) -> SlotState | None:
        """A slot for the request in batch row `row` (`ntok` tokens this step), or None (it decodes
        densely this step). A request that found every slot busy waits, dense, and takes the next
        slot that frees (an evicting one decodes densely to its end); taken after its prompt began,
        its state starts at its current length and its first `obs_window` decode steps stay dense,
        filling the ring, before the first selection."""
        cfg: SFIConfig = req.sfi
        if not self.slots:  # an engine that serves no SFI (a plain vLLM with prefix caching on)
            if not self._no_slots_warned:
                log.warning("sfi: this engine makes no SFI slots (prefix caching on in a plain vLLM, no room "
                            "for one beside the KV cache, or COTSERVE_VLLM_SFI_SLOTS=0); SFI requests "
                            "decode densely")
                self._no_slots_warned = True
            req.sfi = None
            return None
        if cfg.k > self.max_k or ring_size(cfg) > W_MAX or cfg.sinks > self.C - self.max_k:
            log.warning("sfi: request options beyond the engine's buffers (k <= %d, prefill/obs_window <= %d); "
                        "it decodes densely", self.max_k, W_MAX)
            req.sfi = None
            return None
        if not self.free:
            if req.evict is not None:  # its eviction's terms start with its prompt: dense to its end
                log.warning("sfi: all %d SFI slots are busy; this evicting request decodes densely", self.slots)
                req.sfi = None
            elif not req.sfi_waiting:
                if not self._busy_warned:  # a normal state where slots are sized by memory: said once
                    log.warning("sfi: all %d SFI slots are busy; a request that finds none decodes densely "
                                "until one frees (COTSERVE_VLLM_SFI_SLOTS sets their number)", self.slots)
                    self._busy_warned = True
                req.sfi_waiting = True
            return None
        self._warm(cfg, self.free[0])
        slot = self.free.pop(0)
        # its prefill: the prompt, and after a preemption the output it recomputes with it
        st = SlotState.start(cfg, max(len(req.prompt_ids), req.prefill_len), slot=slot)
        if req.sfi_waiting and cm is not None:  # late: the entries it already has, from the host's lengths
            st.kv_len = int(host_lens(cm)[row]) - ntok
            if st.prompt_len - st.kv_len < cfg.prefill_window:  # too few prompt rows left for the bootstrap
                st.catch_up = max(1, cfg.obs_window)
            # its decode steps so far ran densely: counted as such
            st.wait_steps = max(0, st.kv_len - st.prompt_len)
            st.steps, st.retained_sum = st.wait_steps, float(st.wait_steps)
            req.sfi_waiting = False
        self.cpos[:, slot].fill_(-1)
        self.ccount[slot : slot + 1].fill_(0)
        req.state = st
        return st

    def _release(self, req: RowRequest) -> None:
        st = req.state
        if isinstance(st, SlotState):
            self.finished.append(st)
            if telemetry_on():  # released inside the step's plan: nothing built when it goes nowhere
                write_telemetry({**self.telemetry(st), "runtime_host_s": round(self.host_s, 4),
                                 "runtime_refresh_host_s": round(self.refresh_host_s, 4),
                                 "runtime_refreshes": self.refreshes, **allocator_counters(self.device),
                                 **step_counters(self.step_clock)})
            self.free.append(st.slot)
            req.state = None

    # -- the paged cache ----------------------------------------------------------------------
    def _cache_objects(self) -> tuple:
        return tuple(layer.kv_cache for layer in self.layers)  # vLLM binds them after the model loads

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's paged keys and values, views [blocks, block, H, D] of vLLM's cache."""
        kv = self.layers[layer].kv_cache
        kv = kv[0] if isinstance(kv, (list, tuple)) else kv
        k, v = kv.transpose(1, 2).split(self.d, dim=-1)
        return k, v

