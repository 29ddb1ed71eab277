"""SFI's decode step for the native engine's CUDA graphs: the paged runtime on cotserve's KV cache.

The eager policy (`policy.py`) plans every step in Python and launches several ops per layer, so
the engine cannot capture its step and a GPU waits on the host. Here every per-step decision is
made once before the step (`plan`, outside the graph) and written into persistent row tensors;
each layer's attention inside the captured step is the same launch whatever happens: the paged
fast kernel (`kernels/sfi_paged.py`), which also writes the step's queries into their rings and
reads, per row, the compact entries older than the row's window start plus the window, rows [ws, n).

A slow step is the same launch with the window start at 0: the compact entries are all masked and
the row attends densely over its whole history, as the paper's slow step does. Its refresh (the
evidence of the ring's query rows over the history, selector steps 2-5, the re-pack) runs at the
next `plan`, before the next step reads the compact buffers, with `PagedSFI.refresh`: the same
functions vLLM's CUDA backend runs. The bootstrap (the prompt's last `prefill_window` queries)
runs at the end of the prefill.

The native cache `k[layer]` [slots, H, capacity, D] is read as pages through a transposed view
[slots, capacity, H, D]: one page per slot, `block_table[b] = [b]`. Used for SFI alone (no
eviction or steering in the stack, no fallback heads); `SFIPolicy` picks it with `kernel=auto`
when the engine captures CUDA graphs, or with `kernel=paged` (on a CPU, through
TRITON_INTERPRET=1: how the tests run it against the eager policy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies.boundaries import sentence_end_ids
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.paged import W_MAX, PagedSFI, SlotState
from cotserve.policies.sfi.state import ring_size

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


def supported(cfg: SFIConfig) -> bool:
    """Options the paged runtime implements: no fallback heads, a ring of at most W_MAX rows."""
    return cfg.dense_heads == 0 and ring_size(cfg) <= W_MAX


def plan_slot(st: SlotState, step: int, tokens: list[int], boundaries: frozenset[int]) -> tuple[int, int, int]:
    """One sequence's decision for decode step `step` (its trigger: slow or fast), with its
    counters and ring bookkeeping updated. Returns the row's window start (0 on a slow step: the
    whole history as the window), its length after the step's entry and the ring index of the
    step's query row."""
    cfg = st.cfg
    n = st.kv_len + 1
    st.kv_len = n
    slow = st.trigger.step(step, len(tokens) >= 2 and tokens[-2] in boundaries)
    st.steps += 1
    pos = n - 1
    ring_idx = pos % len(st.ring_pos)
    st.ring_pos[ring_idx] = pos
    ws = 0 if slow else max(0, n - cfg.recent)
    if slow:
        st.slow_steps += 1
        st.retained_sum += 1.0
        st.refresh_n, st.refresh_lo = n, n - cfg.obs_window
    else:  # an upper bound: compact entries the window covers are counted as read
        read = min(st.k_eff + min(cfg.sinks, n), ws) + (n - ws)
        st.retained_sum += min(1.0, read / n)
    return ws, n, ring_idx


class NativeGraphSFI(PagedSFI):
    """The paged SFI runtime over one native batch (module docstring); slot b = batch row b."""

    def __init__(self, cfg: SFIConfig, batch: BatchState):
        cache, info = batch.cache, batch.info
        shape = cache.shape
        super().__init__(shape.layers, info.num_heads, shape.kv_heads, shape.head_dim, batch.scaling, cache.k.dtype,
                         cache.device, slots=shape.slots, max_rows=shape.slots, max_k=max(cfg.k, 1),
                         max_sinks=cfg.sinks)
        self.cfg = cfg
        self.cache = cache
        self.block_table = torch.arange(shape.slots, dtype=torch.int32, device=cache.device).view(-1, 1)
        tok = info.tokenizer
        self.boundaries = sentence_end_ids(tok) if tok is not None else frozenset()
        self.states = [SlotState.start(cfg, int(n), slot=b) for b, n in enumerate(batch.prompt_lens.tolist())]
        # the row tensors and the step's ring writes as views of two packed buffers: one copy each per step
        b_n, dev = shape.slots, cache.device
        self.rows_t = torch.zeros(5, b_n, dtype=torch.int32, device=dev)
        self.row_mode, self.row_slot, self.row_tok, self.row_ws, self.row_len = self.rows_t.unbind(0)
        self.nw = b_n
        self.writes_t = torch.zeros(3, b_n, dtype=torch.long, device=dev)
        self.w_tok, self.w_slot, self.w_idx = self.writes_t.unbind(0)
        self.w_slot.fill_(self.slots)  # scratch
        self._warm(cfg, 0)

    def _cache_objects(self) -> tuple:
        return (self.cache.k, self.cache.v)

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[layer].transpose(1, 2), self.cache.v[layer].transpose(1, 2)

    # -- prefill (eager) ---------------------------------------------------------------------
    def prefill(self, layer: int, q: torch.Tensor, batch: BatchState) -> None:
        """Keep each prompt's last query rows (q [B, Hq, T, D]) in the ring; after the last layer,
        the bootstrap refresh from its last `prefill_window` rows."""
        w = ring_size(self.cfg)
        for st in self.states:
            n = st.prompt_len
            pos = torch.arange(max(0, n - w), n, device=q.device)
            self.ring[layer, st.slot, pos % w] = q[st.slot, :, pos].transpose(0, 1).to(self.ring.dtype)
        if layer == self.L - 1:
            for st in self.states:
                n = st.prompt_len
                for p in range(max(0, n - w), n):
                    st.ring_pos[p % w] = p
                st.kv_len = n
                st.refresh_n, st.refresh_lo = n, n - self.cfg.prefill_window
            self._refresh_due()

    def _refresh_due(self) -> None:
        due = [(st, self.block_table[st.slot]) for st in self.states if st.refresh_n]
        if due:
            self.refresh_all(due, self.cache.capacity)
            self.refreshes += len(due)

    # -- per decode step, before the (captured) forward ---------------------------------------
    def plan(self, batch: BatchState) -> None:
        """Finish the refreshes due from the previous step, decide slow or fast per slot with its
        trigger, and fill the row tensors and the step's ring writes."""
        self._refresh_due()
        b_n = len(self.states)
        rows = [[0] * b_n for _ in range(5)]  # mode, slot, token, window start, length
        writes = [[0] * b_n, [self.slots] * b_n, [0] * b_n]  # token, slot (scratch: none), ring index
        active = batch.active.tolist() if batch.active is not None else [True] * b_n
        for b, st in enumerate(self.states):
            if not active[b]:
                continue
            ws, n, ring_idx = plan_slot(st, batch.step, batch.tokens[b], self.boundaries)
            writes[0][b], writes[1][b], writes[2][b] = b, b, ring_idx
            rows[0][b], rows[1][b], rows[2][b], rows[3][b], rows[4][b] = 1, b, b, ws, n
        self.rows_t.copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.writes_t.copy_(torch.tensor(writes, dtype=torch.long), non_blocking=True)

    # -- inside the step (captured) -------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One layer's decode attention, q [B, Hq, 1, D] -> [B, Hq, 1, D]; the step's key and value
        are already in the cache. One launch (ring writes and attention), fixed shapes: graph-safe."""
        q3 = q[:, :, 0].contiguous()
        out = torch.empty_like(q3)  # rows of finished slots (mode 0) are left as they are: ignored
        kc, vc = self._kv(layer)
        self.attend_fast(layer, q3, out, kc, vc, self.block_table)
        return out.unsqueeze(2)
