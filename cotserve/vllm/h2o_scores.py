"""H2O's accumulated attention scores on vLLM: the eviction runtime's per-request score buffers.

The native policy (`cotserve.policies.h2o`) gives each cached entry, per layer and KV head, the sum
of the attention probabilities it has received: the prompt's causal attention from its real rows
(column sums), then every decode step's probabilities, a GQA group's query heads reduced into
their KV head (`group_reduce` sum | max). Here the same, on vLLM's paged cache:

* prefill (eager on every backend): each chunk vLLM computes adds the attention its query rows
  pay to the entries so far (`attention_parts.chunk_colsums`, keys read from the paged cache); per
  query head, in a per-request buffer [L, Hq, prefill_len], since `max` reduces the prompt's column
  sums over the group only once they are complete (as the native policy does);
* decode: each step's probabilities of an h2o row over its physical entries are added into the
  persistent buffer `acc` [L, slots + 1, Hkv, max_len] (float32; the last slot is scratch) at the
  request's slot: on the CPU in torch (`decode_probs`, keys read through the paged-cache reader),
  on CUDA by `kernels.h2o_paged.h2o_paged_accumulate` (a fixed grid over the persistent row tensors
  `row_mode`/`row_slot`/`row_tok`/`row_len`, which `plan_step` fills outside the graph), so it
  runs inside vLLM's FULL CUDA graphs;
* a compaction keeps, per layer and KV head, the entries the native rule picks from these scores
  (`candidates`) and moves their scores with them to the front (`compacted`, the native
  `followers`); the first decode step of a request whose prompt was not compacted moves the
  prompt's reduced column sums into `acc`.

Physical entries of an h2o request never exceed `max_len` while it decodes: its prompt compacts to
`budget` before the first decode step when longer, then it holds at most `budget + interval`
(requests asking for more are refused when they arrive, `batch_rows.h2o_max_len`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cotserve.kernels.h2o_paged import MAX, SUM, h2o_paged_accumulate
from cotserve.policies.attention_parts import chunk_colsums, decode_probs, reduce_group


@dataclass
class H2OState:
    """One h2o request's scores outside `acc`: the prompt's column sums until its first decode step,
    and the scores it held when its slot went to another request."""

    reduce: str  # the policy's group_reduce: sum | max
    prefill: torch.Tensor | None  # [L, Hq, prefill_len] float32, per query head
    parked: torch.Tensor | None = None  # [L, Hkv, n] float32


class H2OScores:
    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, scaling: float, device: torch.device,
                 slots: int, max_rows: int, max_len: int):
        self.L, self.hq, self.hkv = num_layers, num_heads, num_kv_heads
        self.scaling = scaling
        self.device = device
        self.max_len = max_len
        self.acc = torch.zeros(num_layers, slots + 1, num_kv_heads, max_len, dtype=torch.float32, device=device)
        self.rows = torch.zeros(4, max_rows, dtype=torch.int32, device=device)  # mode, slot, token, length
        self.row_mode, self.row_slot, self.row_tok, self.row_len = self.rows
        self._rows_host = self.rows.cpu().pin_memory() if device.type == "cuda" else self.rows.clone()
        self._rows_n = 0
        # the step's prefill chunks: (row, first token, count, entries after it, state)
        self.chunks: list[tuple[int, int, int, int, H2OState]] = []
        self.decode: list[tuple[int, int, int, int, int]] = []  # the step's decode rows: (row, mode, slot, token, length)

    # -- per request -------------------------------------------------------------------------------
    def admit(self, slot: int, group_reduce: str, prefill_len: int) -> H2OState:
        self.acc[:, slot].zero_()
        return H2OState(group_reduce, torch.zeros(self.L, self.hq, prefill_len, dtype=torch.float32,
                                                  device=self.device))

    def scores_of(self, h: H2OState, slot: int, n: int) -> torch.Tensor:
        """The accumulated scores [L, Hkv, n] of the request's physical entries 0 .. n - 1."""
        if h.prefill is not None:
            return reduce_group(h.prefill[:, :, :n], self.hkv, h.reduce)
        return self.acc[:, slot, :, :n]

    def candidates(self, h: H2OState, slot: int, n: int, keep_last: int) -> torch.Tensor:
        """Scores [L, Hkv, n - keep_last] of the entries a compaction chooses among (the native `score`)."""
        return self.scores_of(h, slot, n)[..., : n - keep_last]

    def compacted(self, h: H2OState, slot: int, n: int, keep: torch.Tensor) -> None:
        """The request kept entries `keep` [L, Hkv, m] (sorted) of its n: their scores move to the front."""
        kept = torch.gather(self.scores_of(h, slot, n), 2, keep)
        self.acc[:, slot].zero_()
        self.acc[:, slot, :, : keep.shape[-1]] = kept
        h.prefill = None

    def park(self, h: H2OState, slot: int, n: int) -> None:
        """The slot goes to another request: keep this one's scores aside."""
        if h.prefill is None:
            h.parked = self.acc[:, slot, :, :n].clone()

    def unpark(self, h: H2OState, slot: int) -> None:
        self.acc[:, slot].zero_()
        if h.parked is not None:
            self.acc[:, slot, :, : h.parked.shape[-1]] = h.parked
            h.parked = None

    # -- per step (metadata builder) ---------------------------------------------------------------
    def plan_step(self, rows: list[tuple[int, int, int, int, int, H2OState, int]]) -> None:
        """The step's h2o rows (batch row, first token, token count, logical length before, physical
        length before, state, slot): prefill chunks for the layers' torch path, decode rows into the
        persistent row tensors."""
        self.chunks, self.decode = [], []
        for row, tok, ntok, before, phys_before, h, slot in rows:
            if h.prefill is not None and before + ntok <= h.prefill.shape[-1]:
                self.chunks.append((row, tok, ntok, before + ntok, h))
                continue
            if h.prefill is not None:  # the first decode step of a prompt that was not compacted
                self.acc[:, slot, :, :phys_before] = self.scores_of(h, slot, phys_before)
                h.prefill = None
            n = phys_before + ntok
            if n > self.max_len:
                raise RuntimeError(f"h2o: a request holds {n} entries, over the score buffers' {self.max_len} "
                                   "($COTSERVE_VLLM_H2O_MAX_LEN)")
            self.decode.append((row, SUM if h.reduce == "sum" else MAX, slot, tok, n))
        self._fill_rows()

    def _fill_rows(self) -> None:
        n = len(self.decode)
        if n == 0 and self._rows_n == 0:
            return
        host = self._rows_host
        host.zero_()
        for row, mode, slot, tok, length in self.decode:
            if row >= host.shape[1]:
                raise RuntimeError(f"h2o: batch row {row} is past the {host.shape[1]} rows the kernel covers")
            host[0, row], host[1, row], host[2, row], host[3, row] = mode, slot, tok, length
        self._rows_n = n
        self.rows.copy_(host, non_blocking=self.device.type == "cuda" and host.is_pinned())

    # -- per layer (attention forward, after the step's KV is written) ------------------------------
    def layer(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, paged,
              key_cache: torch.Tensor | None = None, rows: int | None = None) -> None:
        """Add this layer's attention of the step's h2o rows (q [tokens, Hq, D]). `paged` reads the
        cache (`PagedRW.read`); with `key_cache` (CUDA: [blocks, block, Hkv, D]) the decode rows go
        through the kernel, launched whatever the rows (graph-safe)."""
        for row, tok, ntok, end, h in self.chunks:  # the chunk's rows over the entries 0 .. end - 1
            k, _ = paged.read(kv_cache, block_table[row], 0, end)
            qc = q[tok:tok + ntok].transpose(0, 1).unsqueeze(0)  # [1, Hq, c, D]
            h.prefill[layer, :, :end] += chunk_colsums(qc, k.unsqueeze(0).to(qc.dtype), self.scaling)[0]
        if key_cache is not None:
            h2o_paged_accumulate(q, key_cache, block_table, self.row_mode, self.row_slot, self.row_tok, self.row_len,
                                 self.acc[layer], self.scaling, rows=rows)
            return
        for row, mode, slot, tok, n in self.decode:
            k, _ = paged.read(kv_cache, block_table[row], 0, n)
            probs = decode_probs(q[tok].view(1, self.hq, 1, -1), k.unsqueeze(0).to(q.dtype),
                                 torch.ones(1, n, dtype=torch.bool, device=q.device), self.scaling)
            self.acc[layer, slot, :, :n] += probs[0].sum(1) if mode == SUM else probs[0].amax(1)
