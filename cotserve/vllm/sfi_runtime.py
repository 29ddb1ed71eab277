"""SFI per request on vLLM's paged KV cache: the state, the per-step plan and the selection.

One `SFIRuntime` per worker process, shared by the attention layers. The algorithm is the native
policy's (`cotserve.policies.sfi`), from the same code: the trigger (`RefreshTrigger`), the
evidence (`selector.evidence_and_instability` after `mask_rows_inplace`), the selector steps 2-5
(`select_from_evidence`) and the two attention forms (`fast_attention`, `slow_attention`). What
differs is where K/V live: vLLM's paged cache, read through a `PagedKV` accessor that the
backend provides, with each entry's position equal to its index, unless the request also evicts.

A request that also evicts (`skipkv+sfi`, `rkv+sfi`, `streamingllm+sfi`) runs as the native stack
does (`PolicyStack`: eviction, then SFI reading the compacted cache): the eviction runtime's `plan`
rewrites the step's metadata to physical terms first, and SFI works in those terms (the physical
length and block row it is handed), with each entry's true position from the eviction runtime
(`EvictRuntime.positions`) where it uses positions: the ring of query rows, the compact entries'
positions, the mask of a slow step's rows, the selector's prior, and the window's start (a compact
entry is read when its true position is before that of the window's first entry). As in the native
engine, a compaction leaves the selection alone: the compact buffers are copies, still read (by
true position) after their entries left the cache, until the trigger's next refresh. A refresh's
selection reads the cache as the step that computed its evidence saw it; its request may compact
before the next step, so `select_pending` runs it first (the native engine selects after the last
layer, before the compaction that follows the forward).

Per request (an SFI slot):
* ring: the query rows of the last max(prefill_window, obs_window) positions per layer (position p
  at p % that size), written during prefill (the prompt's last rows) and at every decode step; the
  bootstrap reads the prompt's last `prefill_window` rows, a slow step the last `obs_window`;
* compact buffers: sinks + selected K/V per layer and KV head, packed at each refresh;
* the trigger, and the telemetry counters.

Per step (`plan`, once, from the metadata builder): each row's mode (dense, prefill, fast, slow),
its token index, length and window start. A refresh (bootstrap after the prompt's last chunk, or a
slow step) stashes the evidence per layer during the forward; the selection and the re-pack run
for all layers of that request at the next `plan` (exact: the new selection is read from the
next step on, as in the native engine where it runs after the last layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cotserve.policies import selector as sel
from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.sfi.attention import fast_attention, slow_attention
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.policy import mask_rows_inplace, select_from_evidence
from cotserve.policies.sfi.state import SFIRequestState, ring_size, sfi_telemetry
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.step_clock import StepClock, step_counters
from cotserve.vllm.telemetry import write_telemetry

log = logging.getLogger(__name__)

DENSE, PREFILL, FAST, SLOW = 0, 1, 2, 3


class PagedKV(Protocol):
    """Reads one layer's paged cache for one request (entries in position order)."""

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end): [H, end - start, D] each."""
        ...


@dataclass
class SeqState(SFIRequestState):
    """One SFI request's state on the CPU: its own ring and compact buffers, and the evidence of a
    refresh (the shared counters and a pending refresh's terms: `SFIRequestState`)."""

    ring: torch.Tensor | None = None  # [L, Hq, W, D], position ring_pos[i] at index i
    ck: torch.Tensor | None = None  # [L, H, C, D]
    cv: torch.Tensor | None = None
    cpos: torch.Tensor | None = None  # [L, H, C], -1 = empty
    evidence: list[tuple[torch.Tensor, int] | None] | None = None  # per layer (f [H, n], now)
    read_acc: float = 0.0  # compact entries read this step, summed over layers and heads


@dataclass
class RowPlan:
    row: int
    mode: int
    tok: int  # first token index of the row in the step's flat query
    ntok: int
    seq: SeqState | None
    new_len: int  # entries in the cache after this step
    ws: int = 0  # window start (fast and slow steps)
    bootstrap: bool = False  # prefill: this chunk ends the prompt
    qpos: int = -1  # true position of the decoded token (fast and slow steps)
    # an evicting request that has compacted: the true positions [L, H, new_len] of its (physical)
    # entries and [L, H, 1] of the window's first one (all entries before it, when the window is empty)
    epos: torch.Tensor | None = None
    wpos: torch.Tensor | None = None


@dataclass
class StepPlan:
    rows: list[RowPlan]

    @property
    def sfi_rows(self) -> list[RowPlan]:
        return [r for r in self.rows if r.seq is not None]

    @property
    def decode_rows(self) -> list[RowPlan]:
        return [r for r in self.rows if r.mode in (FAST, SLOW)]


class SFIRuntime:
    """SFI state of every SFI request in one worker's batch (see the module docstring)."""

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 dtype: torch.dtype, device: torch.device, tokenizer=None):
        self.L, self.hq, self.hkv, self.d = num_layers, num_heads, num_kv_heads, head_dim
        self.g = num_heads // num_kv_heads
        self.scaling = scaling
        self.dtype, self.device = dtype, device
        self.step_clock: StepClock | None = None  # set by the step's plan while the telemetry is on
        self.boundaries = sentence_end_ids(tokenizer) if tokenizer is not None else frozenset()
        self.plan_now: StepPlan | None = None
        self.finished: list[SeqState] = []  # states of requests that left (telemetry readers)
        self.last_layer = num_layers - 1

    # -- per step ----------------------------------------------------------------------------
    def select_pending(self, rows: BatchRows, paged: PagedKV, kv_caches: list[torch.Tensor]) -> None:
        """The pending selections of evicting requests, on the cache as their refresh step saw it:
        before the eviction runtime's `plan` (which may compact them) in the step's metadata build."""
        for req in rows.rows.values():
            st = req.state
            if req.evict is not None and isinstance(st, SeqState) and st.evidence is not None:
                self._select(st, paged, kv_caches, st.refresh_blocks)

    def plan(self, rows: BatchRows, num_reqs: int, query_start_loc: list[int], paged: PagedKV,
             kv_caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: list[int] | None = None,
             positions: Callable[[RowRequest, int], torch.Tensor | None] | None = None) -> StepPlan:
        """Once per step, before the forward: finish pending selections, then decide every row.
        For evicting requests, `seq_lens` are the step's physical lengths (the metadata as the
        eviction runtime rewrote it) and `positions(req, n)` the true positions [L, H, n] of its
        physical entries (None while they are their indices)."""
        for gone in rows.take_released():
            if gone.state is not None:
                self.finished.append(gone.state)
                write_telemetry({**self.telemetry(gone.state), **step_counters(self.step_clock)})
                gone.state = None
        out = []
        for i in range(num_reqs):
            tok, ntok = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
            req = rows.rows.get(i)
            if req is None or req.sfi is None or ntok == 0:
                out.append(RowPlan(i, DENSE, tok, ntok, None, 0))
                continue
            st = req.state
            if st is None:
                st = req.state = self._new_state(req)
            evicting = req.evict is not None and seq_lens is not None
            if st.evidence is not None:
                self._select(st, paged, kv_caches, st.refresh_blocks if evicting else block_table[i])
            new_len = st.kv_len + ntok
            st.kv_len = new_len
            if new_len <= st.prompt_len:
                boot = new_len == st.prompt_len
                if boot and evicting:  # no compaction before the prompt's end: its entries are its positions
                    st.refresh_blocks, st.refresh_pos = block_table[i].clone(), None
                out.append(RowPlan(i, PREFILL, tok, ntok, st, new_len, bootstrap=boot))
                continue
            seq = req.prompt_ids + req.output_ids
            after = len(seq) >= 2 and seq[-2] in self.boundaries
            slow = st.trigger.step(st.steps, after)
            st.steps += 1
            st.read_acc = 0.0
            if not evicting:
                ws = max(0, new_len - st.cfg.recent)
                out.append(RowPlan(i, SLOW if slow else FAST, tok, ntok, st, new_len, ws, qpos=new_len - 1))
                continue
            phys = seq_lens[i]  # entries in the cache (physical), this step's included
            ws = max(0, phys - st.cfg.recent)
            epos = positions(req, phys) if positions is not None else None
            wpos = None
            if epos is not None:
                wpos = epos[:, :, ws:ws + 1] if ws < phys else torch.full(
                    (self.L, self.hkv, 1), new_len, dtype=epos.dtype, device=epos.device)
            if slow:
                st.refresh_blocks, st.refresh_pos = block_table[i].clone(), epos
            out.append(RowPlan(i, SLOW if slow else FAST, tok, ntok, st, phys, ws, qpos=new_len - 1, epos=epos,
                               wpos=wpos))
        self.plan_now = StepPlan(out)
        return self.plan_now

    def _new_state(self, req: RowRequest) -> SeqState:
        cfg: SFIConfig = req.sfi
        c = cfg.sinks + cfg.k
        return SeqState.start(
            cfg, len(req.prompt_ids),
            ring=torch.zeros(self.L, self.hq, ring_size(cfg), self.d, dtype=self.dtype, device=self.device),
            ck=torch.zeros(self.L, self.hkv, c, self.d, dtype=self.dtype, device=self.device),
            cv=torch.zeros(self.L, self.hkv, c, self.d, dtype=self.dtype, device=self.device),
            cpos=torch.full((self.L, self.hkv, c), -1, dtype=torch.long, device=self.device),
        )

    # -- per layer ---------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, paged: PagedKV) -> None:
        """SFI's part of one layer's attention: q and out [tokens, Hq, D]. Writes the rows of
        fast and slow steps into `out`; records prompt queries and bootstrap evidence."""
        plan = self.plan_now
        if plan is None:
            return
        for r in plan.sfi_rows:
            st = r.seq
            w = len(st.ring_pos)
            blocks = block_table[r.row]
            if r.mode == PREFILL:
                m = min(w, r.ntok)
                for p in range(r.new_len - m, r.new_len):
                    st.ring[layer, :, p % w] = q[r.tok + p - (r.new_len - r.ntok)]
                    if layer == 0:
                        st.ring_pos[p % w] = p
                if r.bootstrap:
                    self._bootstrap(layer, st, r, kv_cache, blocks, paged)
                continue
            pos = r.qpos
            st.ring[layer, :, pos % w] = q[r.tok]
            if layer == 0:
                st.ring_pos[pos % w] = pos
            if r.mode == FAST:
                out[r.tok] = self._fast(layer, st, r, q[r.tok], kv_cache, blocks, paged)
            else:
                out[r.tok] = self._slow(layer, st, r, kv_cache, blocks, paged)
        if layer == self.last_layer:
            self._account(plan)

    def _fast(self, layer: int, st: SeqState, r: RowPlan, q: torch.Tensor, kv_cache, blocks, paged) -> torch.Tensor:
        wk, wv = paged.read(kv_cache, blocks, r.ws, r.new_len)
        cpos = st.cpos[layer]
        cmask = (cpos >= 0) & (cpos < (r.ws if r.wpos is None else r.wpos[layer]))
        st.read_acc += float(cmask.sum())
        wmask = torch.ones(1, 1, wk.shape[1], dtype=torch.bool, device=q.device)
        o = fast_attention(q.view(1, self.hq, 1, self.d), st.ck[layer].transpose(-1, -2).unsqueeze(0),
                           st.cv[layer].unsqueeze(0), cmask.unsqueeze(0), wk.unsqueeze(0), wv.unsqueeze(0), wmask,
                           self.scaling)
        return o.view(self.hq, self.d)

    @staticmethod
    def _rows(st: SeqState, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """Ring indices and positions of the query rows at positions [lo, hi)."""
        idx = [i for i, p in enumerate(st.ring_pos) if lo <= p < hi and p >= 0]
        return idx, [st.ring_pos[i] for i in idx]

    def _slow(self, layer: int, st: SeqState, r: RowPlan, kv_cache, blocks, paged) -> torch.Tensor:
        k, v = paged.read(kv_cache, blocks, 0, r.new_len)
        idx, row_pos = self._rows(st, r.qpos + 1 - st.cfg.obs_window, r.qpos + 1)  # the last obs_window queries
        cur = row_pos.index(r.qpos)
        o, logits = slow_attention(st.ring[layer, :, idx], cur, k, v, self.scaling)
        self._stash(layer, st, logits, row_pos, r.new_len, None if r.epos is None else r.epos[layer])
        return o.view(self.hq, self.d)

    def _bootstrap(self, layer: int, st: SeqState, r: RowPlan, kv_cache, blocks, paged) -> None:
        k, _ = paged.read(kv_cache, blocks, 0, r.new_len)
        idx, row_pos = self._rows(st, r.new_len - st.cfg.prefill_window, r.new_len)  # the prompt's last rows
        qrows = st.ring[layer, :, idx]  # [Hq, w, D]
        w = len(idx)
        logits = torch.matmul(qrows.reshape(self.hkv, self.g * w, -1) * self.scaling, k.transpose(-1, -2)).float()
        self._stash(layer, st, logits.view(self.hkv, self.g, w, r.new_len), row_pos, r.new_len)

    def _stash(self, layer: int, st: SeqState, logits: torch.Tensor, row_pos: list[int], n: int,
               pos: torch.Tensor | None = None) -> None:
        """Selector step 1 for one layer; `pos` [H, n]: the entries' true positions (None: their indices)."""
        if pos is None:
            pos = torch.arange(n, device=logits.device).expand(self.hkv, n)
        mask_rows_inplace(logits, pos, torch.tensor(row_pos, device=logits.device), st.cfg.sinks)
        oldest = min(range(len(row_pos)), key=row_pos.__getitem__)
        f, _ = sel.evidence_and_instability(logits, st.cfg.alpha, st.cfg.k, st.cfg.recent, oldest, False)
        if st.evidence is None:
            st.evidence = [None] * self.L
        st.evidence[layer] = (f, max(row_pos))

    # -- selection ---------------------------------------------------------------------------
    def _select(self, st: SeqState, paged: PagedKV, kv_caches: list[torch.Tensor], blocks: torch.Tensor) -> None:
        """Selector steps 2-5 for every layer of one request at once, then the re-pack. An evicting
        request's entries have the true positions its refresh step recorded (`refresh_pos`)."""
        per_layer, st.evidence = st.evidence, None
        true_pos, st.refresh_pos, st.refresh_blocks = st.refresh_pos, None, None
        if any(item is None for item in per_layer):
            log.warning("sfi: a refresh saw only some layers; keeping the previous selection")
            return
        cfg = st.cfg
        n, now = per_layer[0][0].shape[-1], per_layer[0][1]
        f = torch.stack([item[0] for item in per_layer])  # [L, H, n]
        keys, vals = zip(*(paged.read(kv, blocks, 0, n) for kv in kv_caches), strict=True)
        k_all, v_all = torch.stack(keys), torch.stack(vals)  # [L, H, n, D]
        pos = torch.arange(n, device=f.device).expand(self.L, self.hkv, n) if true_pos is None else true_pos
        norms = k_all.float().norm(dim=-1)
        idx = select_from_evidence(cfg, f, pos, norms, now)  # [L, H, ke]
        ns = min(cfg.sinks, n)
        keep = torch.cat([torch.arange(ns, device=idx.device).expand(self.L, self.hkv, ns), idx], dim=-1)
        m = keep.shape[-1]
        gi = keep.unsqueeze(-1).expand(-1, -1, -1, self.d)
        st.cpos.fill_(-1)
        st.cpos[:, :, :m] = keep if true_pos is None else torch.gather(true_pos, 2, keep)
        st.ck[:, :, :m] = torch.gather(k_all, 2, gi)
        st.cv[:, :, :m] = torch.gather(v_all, 2, gi)
        st.k_eff = idx.shape[-1]

    def _account(self, plan: StepPlan) -> None:
        for r in plan.decode_rows:
            st = r.seq
            if r.mode == SLOW:
                st.slow_steps += 1
                st.retained_sum += 1.0
            else:
                read = st.read_acc / (self.L * self.hkv) + (r.new_len - r.ws)
                st.retained_sum += min(1.0, read / max(r.new_len, 1))

    # -- telemetry ---------------------------------------------------------------------------
    telemetry = staticmethod(sfi_telemetry)
