"""SFI inside the continuous engine's pooled decode step (`cotserve/engine/pooled_decode.py`).

The continuous engine keeps, on CUDA, one KV pool per engine: `k[layer]` [slots + 1, H, length, D]
(the last slot is the pad slot: padding rows of a batch-size bucket write there) at fixed
addresses, and captures one decode step per batch-size bucket. Sequences join and leave the pool
while those graphs stay valid, so SFI's state must live at fixed addresses too, for every slot at
once: `PooledSFI` is the paged runtime (`paged.PagedSFI`: compact buffers, rings, row tensors,
the batched refresh) over the whole pool, the pool read as one page per slot (`block_table[row]
= [slot of that row]`).

The engine asks for it through the policy's one pooled hook (`SFIPolicy.pooled_form` ->
`pooled_form` here, `interface.PooledForm`): the pool builds it at the first SFI sequence that
joins (`PooledSFI.over`), with `k` entries per KV head from the engine's capacity setting for "sfi"
(`ContinuousEngine(pool_capacity={"sfi": k})`, default `DEFAULT_K`), and keeps it under "sfi".

A sequence joins at admission (`join`: its `SlotState`, returned wrapped in a `PooledSlotSFI`,
the object `SFIPolicy` keeps as its runtime), keeps its prompt's last query rows and takes its
bootstrap refresh at the end of its (eager) prefill, and leaves when it finishes. Each decode
step, outside the graph: the refreshes due from the previous step's slow steps run
(`refresh_due`, the form's `before_step`), each SFI sequence plans its row (`plan`: the same trigger and bookkeeping as
`graph.NativeGraphSFI`, `graph.plan_slot`), and the engine lays the rows out in its bucket's order
(`write_rows`: one copy each for the row tensors and the ring writes). Inside the graph, per
layer: the ring write and the paged fast kernel over the bucket's rows (`attend`); rows of other
sequences (dense, padding) carry mode 0 and are left to the engine's dense launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.options import SFIOptions, option_default
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.graph import plan_slot, supported
from cotserve.policies.sfi.paged import PagedSFI, SlotState
from cotserve.policies.sfi.state import ring_size, sfi_telemetry

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState
    from cotserve.policies.interface import PoolView

KIND = "sfi"  # the runtime's key in the pool and in its capacity setting (the policy's name)
MAX_SINKS = 16  # sinks a pooled sequence may ask for (the compact buffers' spare room)
DEFAULT_K = option_default(SFIOptions, "k")  # entries per KV head the pooled buffers hold, unless the engine sets it


def poolable(cfg: SFIConfig) -> bool:
    """Options the pooled step serves: the paged runtime's (`graph.supported`: no fallback heads,
    a ring of at most W_MAX rows), sinks within MAX_SINKS, and not `kernel=torch` (which asks for
    the eager torch form)."""
    return cfg.kernel != "torch" and supported(cfg) and cfg.sinks <= MAX_SINKS


def pooled_form(cfg: SFIConfig, pool: PoolView) -> PooledSFI | None:
    """SFI's pooled form over `pool` (`Policy.pooled_form`), or None for options it does not serve."""
    return PooledSFI.over(pool) if poolable(cfg) else None


class PooledSFI(PagedSFI):
    """The paged SFI runtime over every slot of a KV pool (module docstring)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float, max_k: int,
                 tokenizer=None):
        layers, slots_pad, kv_heads, _, head_dim = k.shape
        slots = slots_pad - 1
        super().__init__(layers, num_heads, kv_heads, head_dim, scale, k.dtype, k.device, slots=slots,
                         max_rows=slots, max_k=max(max_k, 1), max_sinks=MAX_SINKS)
        self.k, self.v = k, v
        self.boundaries = sentence_end_ids(tokenizer) if tokenizer is not None else frozenset()
        self.states: dict[int, SlotState] = {}  # pool slot -> its sequence's state
        self._planned: dict[int, tuple[int, int, int]] = {}  # pool slot -> (window start, length, ring index)
        dev = k.device
        # row tensors (mode, slot, token, window start, length, block) and ring writes (token, slot,
        # ring index) as views of two packed buffers: one copy each per step
        self.rows_t = torch.zeros(6, slots, dtype=torch.int32, device=dev)
        self.row_mode, self.row_slot, self.row_tok, self.row_ws, self.row_len, blocks = self.rows_t.unbind(0)
        self.block_table = blocks.view(slots, 1)
        self.nw = slots
        self.writes_t = torch.zeros(3, slots, dtype=torch.long, device=dev)
        self.w_tok, self.w_slot, self.w_idx = self.writes_t.unbind(0)
        self.w_slot.fill_(self.slots)  # the pad row of the rings: nothing kept

    @classmethod
    def over(cls, pool: PoolView) -> PooledSFI:
        return cls(pool.k, pool.v, pool.num_heads, pool.scaling, pool.capacity(KIND, DEFAULT_K), pool.tokenizer)

    def _cache_objects(self) -> tuple:
        return (self.k, self.v)

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)

    def fits(self, cfg: SFIConfig, length: int) -> bool:
        """Whether a sequence of at most `length` entries with these options fits the compact
        buffers (sinks plus the entries it may select)."""
        return poolable(cfg) and cfg.sinks + min(cfg.k, length) <= self.C

    # -- joining and leaving -------------------------------------------------------------------
    def join(self, cfg: SFIConfig, slot: int, prompt_len: int) -> PooledSlotSFI:
        st = SlotState.start(cfg, prompt_len, slot=slot)
        self.states[slot] = st
        self._warm(cfg, slot)
        return PooledSlotSFI(self, st)

    def leave(self, slot: int) -> None:
        self.states.pop(slot, None)
        self._planned.pop(slot, None)

    # -- prefill (eager, one sequence) -----------------------------------------------------------
    def prefill(self, st: SlotState, layer: int, q: torch.Tensor) -> None:
        """Keep the prompt's last query rows (q [Hq, T, D]) in the slot's ring; after the last
        layer, the bootstrap refresh from its last `prefill_window` rows."""
        w = ring_size(st.cfg)
        n = st.prompt_len
        pos = torch.arange(max(0, n - w), n, device=q.device)
        self.ring[layer, st.slot, pos % w] = q[:, pos].transpose(0, 1).to(self.ring.dtype)
        if layer == self.L - 1:
            for p in range(max(0, n - w), n):
                st.ring_pos[p % w] = p
            st.kv_len = n
            st.refresh_n, st.refresh_lo = n, n - st.cfg.prefill_window
            self._refresh([st])

    def _refresh(self, states: list[SlotState]) -> None:
        due = [(st, torch.tensor([st.slot], dtype=torch.int32, device=self.device)) for st in states
               if st.refresh_n]
        if due:
            self.refresh_all(due, self.k.shape[3])
            self.refreshes += len(due)

    # -- per decode step, before the (captured) forward -------------------------------------------
    def refresh_due(self) -> None:
        """The refreshes due from the previous step's slow steps, before any row reads the compact
        buffers again."""
        self._refresh(list(self.states.values()))

    def before_step(self) -> None:
        self.refresh_due()

    def plan(self, st: SlotState, step: int, tokens: list[int]) -> None:
        self._planned[st.slot] = plan_slot(st, step, tokens, self.boundaries)

    def write_rows(self, order: list[int]) -> None:
        """Lay the planned sequences out as rows: `order[r]` is the pool slot of row r (the pad
        slot or a sequence of another policy: mode 0, no ring write)."""
        self._lay_out([(r, slot, plan) for r, slot in enumerate(order)
                       if (plan := self._planned.pop(slot, None)) is not None])
        self._planned.clear()

    def clear_rows(self) -> None:
        """Every row mode 0 and every ring write to the pad row (a capture's warm-up), leaving the
        step's plans in place."""
        self._lay_out([])

    def _lay_out(self, planned: list[tuple[int, int, tuple[int, int, int]]]) -> None:
        r_n = self.max_rows
        rows = [[0] * r_n for _ in range(6)]  # mode, slot, token, window start, length, block
        writes = [[0] * r_n, [self.slots] * r_n, [0] * r_n]  # token, slot (the pad row: none), ring index
        for r, slot, (ws, n, ring_idx) in planned:
            rows[0][r], rows[1][r], rows[2][r], rows[3][r], rows[4][r], rows[5][r] = 1, slot, r, ws, n, slot
            writes[0][r], writes[1][r], writes[2][r] = r, slot, ring_idx
        self.rows_t.copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.writes_t.copy_(torch.tensor(writes, dtype=torch.long), non_blocking=True)

    # -- inside the step (captured) -------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """The SFI rows' attention of one layer: q, out [rows, Hq, D] (rows: the bucket's size);
        writes out[r] of every row with mode 1. The step's keys and values are in the pool."""
        kc, vc = self._kv(layer)
        self.attend_fast(layer, q, out, kc, vc, self.block_table, rows=q.shape[0])


class PooledSlotSFI:
    """One sequence's handle on the pooled runtime: what `SFIPolicy` calls as its runtime."""

    telemetry = staticmethod(sfi_telemetry)

    def __init__(self, pool: PooledSFI, state: SlotState):
        self.pool = pool
        self.states = [state]  # the policy's one-slot batch: slot 0 is this sequence

    @property
    def cv(self) -> torch.Tensor:
        return self.pool.cv

    def prefill(self, layer: int, q: torch.Tensor, batch: BatchState) -> None:
        self.pool.prefill(self.states[0], layer, q[0])

    def plan(self, batch: BatchState) -> None:
        self.pool.plan(self.states[0], batch.step, batch.tokens[0])

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pooled SFI sequence decodes in the engine's pooled step, not through its policy")
