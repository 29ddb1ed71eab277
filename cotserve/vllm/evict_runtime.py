"""Physical KV eviction per request on vLLM's paged cache: the worker's half.

The scoring is the native policies' (`cotserve.policies`): R-KV's token score (`rkv.rkv_scores`:
importance from the last `window` queries, key redundancy), SkipKV's sentence penalty
(`skipkv.SentenceTrack`, fed with the last layer's final-norm hidden states), and the selection
rule of every eviction policy (`scoring.protected_top`); streamingllm keeps sinks plus recent; h2o
ranks by the accumulated attention kept in `h2o_scores.H2OScores` (each layer adds the step's
attention of h2o rows, `accumulate`; the kept entries' scores move with them). The
schedule (when a request compacts, which of its blocks are freed) is `EvictionLedger`'s, which the
scheduler (`scheduler.EvictingScheduler`) applies to vLLM's block pool in the same step.

Per step, in the attention metadata builder (before the forward, outside any CUDA graph):

1. the previous step's final hidden states (`process.runtimes().hidden`) of SkipKV requests feed their
   sentence tracks;
2. a request due for a compaction keeps, per layer and KV head, `budget` entries chosen by its
   policy, written to the first physical slots of its live blocks (all layers scored at once: the
   layers are stacked as extra heads, the scores are per head);
3. for every request that has evicted, the metadata is rewritten to physical terms: its sequence
   length, its block-table row (live blocks only, in order) and the slots its new tokens are written
   to. RoPE positions stay the true ones (vLLM computes them from the logical length).

In each attention layer, one `index_put` copies the step's query rows of evicting requests into a
persistent ring (the last `window` per layer), graph-safe: the indices are filled by the builder.

On a CPU vLLM's block-table tensor is its own host copy, so the rewritten metadata goes into a
copy; on CUDA the persistent device tensors (which a captured graph reads) are rewritten in place,
from the host copy vLLM refreshes every step.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.rkv import rkv_scores
from cotserve.policies.scoring import protected_top
from cotserve.policies.skipkv import SentenceTrack
from cotserve.vllm.batch_rows import MAX_EVICT_WINDOW, BatchRows, RowRequest, h2o_max_len
from cotserve.vllm.compat import host_lens, metadata_with, set_host_lens
from cotserve.vllm.eviction_ledger import EvictionLedger, cdiv
from cotserve.vllm.h2o_scores import H2OScores
from cotserve.vllm.settings import settings
from cotserve.vllm.telemetry import write_telemetry

log = logging.getLogger(__name__)

# similarity matrices of the redundancy score: layers are scored in groups under this many floats
SCORE_FLOATS = 1 << 27
# K and V of the requests compacted together (read, gathered, stacked): at most about this many elements
GROUP_ELEMENTS = 1 << 30
# requests that left the batch keep their state (they may come back) up to this many per ring slot
ORPHANS_PER_SLOT = 16


class PagedRW(Protocol):
    def read_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [R, H, n, D] of the entries 0 .. n - 1 of R requests (blocks [R, >= ceil(n / block)])."""
        ...

    def write_front_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> None:
        """Write K and V [R, H, m, D] as the entries 0 .. m - 1 of R requests."""
        ...


@dataclass
class EvictState:
    """One evicting request's worker-side state."""

    ledger: EvictionLedger
    slot: int
    pos: torch.Tensor | None = None  # [L, Hkv, kept] true positions of the entries the last compaction kept
    tail_start: int = 0  # true position of the first entry after those (later entries follow one by one)
    n_phys: int = 0
    track: SentenceTrack | None = None
    hidden_rows: tuple[int, int, int] | None = None  # (token index, count, first position) of the last step
    ring_pos: list[int] = field(default_factory=list)  # position held at each ring index, -1 none
    h2o: Any = None  # h2o's scores outside the shared buffers (`h2o_scores.H2OState`)


def _token_ids(req: RowRequest, first: int, n: int) -> list[int]:
    """Token ids at positions first .. first + n - 1 of the request (prompt, then output)."""
    p = len(req.prompt_ids)
    if first >= p:
        return list(req.output_ids[first - p:first - p + n])
    return (req.prompt_ids[first:first + n] + list(req.output_ids[: max(0, first + n - p)]))[:n]


class EvictRuntime:
    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 dtype: torch.dtype, device: torch.device, slots: int, max_tokens: int, window: int = MAX_EVICT_WINDOW,
                 tokenizer=None, on_device_tables: bool = False, block_size: int | None = None,
                 max_rows: int | None = None):
        self.L, self.hq, self.hkv, self.d = num_layers, num_heads, num_kv_heads, head_dim
        self.scaling = scaling
        self.device = device
        self.slots = slots
        self.w = window
        self.delims = thought_delimiter_ids(tokenizer) if tokenizer is not None else frozenset()
        self.inplace = on_device_tables
        self.block_size = block_size  # the KV cache manager's (the scheduler's holes are counted in it)
        # query rings (+1 scratch slot for unused writes) and the step's ring writes
        self.ring = torch.zeros(num_layers, slots + 1, window, num_heads, head_dim, dtype=dtype, device=device)
        self.nw = max(1, min(max_tokens, slots * window))
        self.writes = torch.zeros(3, self.nw, dtype=torch.long, device=device)  # token, slot, ring index
        self.writes[1].fill_(slots)
        self.w_tok, self.w_slot, self.w_idx = self.writes[0], self.writes[1], self.writes[2]
        self._writes_host = self.writes.cpu().pin_memory() if device.type == "cuda" else self.writes.clone()
        self._writes_n = 0
        self.free = list(range(slots))
        self.owner: dict[int, RowRequest] = {}  # slot -> the request in the batch that holds it
        self.orphans: dict[int, tuple[list, EvictState]] = {}  # id(output list) -> (the list, state)
        self.active = False  # any evicting request this step
        # the open sentence's hidden-state sum of each ring slot's SkipKV request (host, float32): one
        # add per step for the whole batch; a request without a slot keeps it in its track
        self.osum: torch.Tensor | None = None
        self._live_rows: torch.Tensor | None = None  # [slots + 1, table width] live block-list indices
        self._live_keys: dict[int, tuple] = {}  # slot -> (state, compactions, live count) its row holds
        # cumulative cost, reported with each finished request (`bench capacity` reads it)
        self.plan_s = 0.0  # host time in `plan`, compactions included
        self.compact_s = 0.0  # compactions, to their end on the device
        self.compact_events = 0
        self.compacted = 0
        # h2o's accumulated scores: on CUDA made now (the decode kernel's buffers are in the graphs),
        # on the CPU at the first h2o request
        self.max_rows = max_rows or slots
        self.h2o: H2OScores | None = self._make_h2o() if on_device_tables else None
        self._paged: PagedRW | None = None

    def _make_h2o(self) -> H2OScores | None:
        n = h2o_max_len()
        if n <= 0:
            return None
        return H2OScores(self.L, self.hq, self.hkv, self.scaling, self.device, self.slots, self.max_rows, n)

    # -- per step (metadata builder) -------------------------------------------------------------
    def plan(self, rows: BatchRows, cm, block_size: int, kv_caches: list[torch.Tensor], paged: PagedRW,
             hidden: torch.Tensor | None):
        """Run due compactions and return the metadata in physical terms (see the module docstring)."""
        t0 = time.perf_counter()
        try:
            return self._plan(rows, cm, block_size, kv_caches, paged, hidden)
        finally:
            self.plan_s += time.perf_counter() - t0

    def _plan(self, rows: BatchRows, cm, block_size: int, kv_caches: list[torch.Tensor], paged: PagedRW,
              hidden: torch.Tensor | None):
        reqs = [(i, r) for i, r in rows.rows.items() if r.evict is not None and i < cm.num_reqs]
        present = {id(r) for r in rows.rows.values()}
        leaving = [r for r in self.owner.values() if id(r) not in present]
        # the last forward's hidden states, for the requests in it (those leaving the batch too)
        self._feed_hidden([r for _, r in reqs] + leaving, hidden)
        self._release(rows)
        self._paged = paged
        if not reqs:
            if self.active:  # point last step's ring writes at the scratch slot
                self._fill_writes([], [], [])
                if self.h2o is not None:
                    self.h2o.plan_step([])
            self.active = False
            return cm
        self.active = True
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        lens = host_lens(cm)[: cm.num_reqs].tolist()
        table = cm.block_table_tensor
        new_lens = list(lens)
        rows_now: list[tuple[int, RowRequest, EvictState, int, int]] = []  # (row, req, state, tok, ntok)
        groups: dict[tuple, list[tuple[RowRequest, EvictState, torch.Tensor]]] = {}
        if self.block_size is not None and block_size != self.block_size:
            raise RuntimeError(f"eviction: the attention kernel's block size {block_size} differs from the KV "
                               f"cache manager's {self.block_size}; the two halves would disagree on the blocks")
        for _, req in reqs:  # requests back in the batch first: they get their slots before new ones
            if req.evict_state is None:
                self._reattach(req)
        for i, req in reqs:
            tok, ntok = qsl[i], qsl[i + 1] - qsl[i]
            if ntok == 0:
                continue
            before = lens[i] - ntok
            st = req.evict_state
            if st is None:
                if before > 0:  # a running request whose state is gone: its blocks are the scheduler's
                    raise RuntimeError("eviction: a running request came back to the batch without its state "
                                       "(more requests left and returned than the runtime keeps)")
                st = self._admit(req)
            if before == 0 and st.n_phys:  # recomputed from scratch (vLLM preempted it)
                st = self._restart(req)
            led = st.ledger
            if led.due(before, ntok):  # read through the live blocks as they are before this compaction
                live = led.live_blocks(cdiv(before, block_size))[: cdiv(st.n_phys, block_size)]
                live = torch.tensor(live, dtype=torch.long, device=table.device)
                key = (req.evict.name, repr(req.evict.config), st.n_phys)
                groups.setdefault(key, []).append((req, st, table[i, live]))
                led.compact(before, ntok, block_size)
            rows_now.append((i, req, st, tok, ntok))
        if groups:
            t1 = time.perf_counter()
            for items in groups.values():
                n = items[0][1].n_phys
                per = max(1, GROUP_ELEMENTS // (3 * self.L * self.hkv * n * self.d))
                for a in range(0, len(items), per):
                    self._compact_group(items[a:a + per], kv_caches, paged)
                self.compacted += len(items)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.compact_s += time.perf_counter() - t1
            self.compact_events += 1
        rewrite: list[tuple] = []  # (row, live, tok, ntok, phys_before, state)
        w_tok, w_slot, w_idx = [], [], []
        h2o_rows: list[tuple] = []
        for i, _req, st, tok, ntok in rows_now:
            led = st.ledger
            before = lens[i] - ntok
            phys_before = before - led.evicted
            st.n_phys = phys_before + ntok
            st.hidden_rows = (tok, ntok, before)
            if st.h2o is not None:
                h2o_rows.append((i, tok, ntok, before, phys_before, st.h2o, st.slot))
            if led.evicted:
                new_lens[i] = st.n_phys
                rewrite.append((i, led.live_blocks(cdiv(lens[i], block_size)), tok, ntok, phys_before, st))
            m = min(ntok, self.w)
            for j in range(ntok - m, ntok):
                p = before + j
                w_tok.append(tok + j)
                w_slot.append(st.slot)
                w_idx.append(p % self.w)
                st.ring_pos[p % self.w] = p
        self._fill_writes(w_tok, w_slot, w_idx)
        if self.h2o is not None:
            self.h2o.plan_step(h2o_rows)
        if rewrite:
            cm = self._rewrite(cm, rewrite, new_lens, block_size)
        return cm

    def _admit(self, req: RowRequest) -> EvictState:
        pol = req.evict
        st = EvictState(EvictionLedger(pol, req.prefill_len), self._slot(), ring_pos=[-1] * self.w)
        if pol.name == "skipkv":
            st.track = SentenceTrack(self.delims, pol.config.sentence_threshold)
        if pol.name == "h2o":
            if self.h2o is None:
                self.h2o = self._make_h2o()
            if self.h2o is None:
                raise RuntimeError("h2o: its score buffers are left out ($COTSERVE_VLLM_H2O_MAX_LEN=0)")
            st.h2o = self.h2o.admit(st.slot, pol.config.group_reduce, req.prefill_len)
        req.evict_state = st
        self.owner[st.slot] = req
        self._live_keys.pop(st.slot, None)
        if self.osum is not None:
            self.osum[st.slot].zero_()
        return st

    def _slot(self) -> int:
        """A free query-ring slot; when none is, the slot of the request that left the batch longest
        ago (its state stays, without its ring: it refills within `window` steps if it comes back)."""
        if not self.free:
            for _, st in self.orphans.values():
                if st.slot >= 0:
                    self._park(st)
                    self.free.append(st.slot)
                    st.slot = -1
                    break
        if not self.free:  # cannot happen: at most max_num_seqs requests are in the batch
            raise RuntimeError(f"eviction: all {self.slots} query-ring slots are in use")
        return self.free.pop()

    def _reattach(self, req: RowRequest) -> EvictState | None:
        """The state of a request that left the batch and came back (vLLM removes a running request
        from its persistent batch in a step that does not schedule it, and re-adds it later with
        the same output list): its compactions and blocks are the scheduler's still."""
        got = self.orphans.pop(id(req.output_ids), None)
        if got is None or got[0] is not req.output_ids:
            return None
        st = got[1]
        if st.slot < 0:  # its ring slot went to another request meanwhile
            st.slot = self._slot()
            st.ring_pos = [-1] * self.w
            self._unpark(st)
        req.evict_state = st
        self.owner[st.slot] = req
        self._live_keys.pop(st.slot, None)
        return st

    def _restart(self, req: RowRequest) -> EvictState:
        if req.evict_state.slot >= 0:
            self.free.append(req.evict_state.slot)
            self.owner.pop(req.evict_state.slot, None)
        req.evict_state = None
        req.prefill_len = len(req.prompt_ids) + len(req.output_ids)
        return self._admit(req)

    def _release(self, rows: BatchRows) -> None:
        """A request that left the batch keeps its slot and state as an orphan (it may come back);
        an orphan's slot is reclaimed when a new request finds no free slot."""
        present = {id(r) for r in rows.rows.values()}
        gone = [slot for slot, r in self.owner.items() if id(r) not in present]
        for slot in gone:
            r = self.owner.pop(slot)
            self.orphans[id(r.output_ids)] = (r.output_ids, r.evict_state)
        while len(self.orphans) > ORPHANS_PER_SLOT * self.slots:  # the oldest have finished, surely
            _, st = self.orphans.pop(next(iter(self.orphans)))
            if st.slot >= 0:
                self.free.append(st.slot)
        if gone:
            write_telemetry({"evict_runtime": {"plan_host_s": round(self.plan_s, 3),
                                               "compact_s": round(self.compact_s, 3),
                                               "compaction_steps": self.compact_events,
                                               "compactions": self.compacted}})

    def positions(self, st: EvictState, n: int) -> torch.Tensor:
        """True positions [L, Hkv, n] of the request's physical entries 0 .. n - 1."""
        kept = 0 if st.pos is None else st.pos.shape[-1]
        tail = torch.arange(st.tail_start, st.tail_start + n - kept, device=self.device)
        tail = tail.expand(self.L, self.hkv, -1)
        return tail if st.pos is None else torch.cat([st.pos, tail], dim=-1)

    def _feed_hidden(self, reqs: list[RowRequest], hidden: torch.Tensor | None) -> None:
        """The previous step's final hidden states of SkipKV requests into their sentence tracks:
        one gather and one host copy for the whole batch; a decode token's row is added to its
        request's open-sentence sum in one op for all (`osum`), and only a token that closes a
        sentence costs its track more (`SentenceTrack.count`, the arithmetic of `feed`)."""
        chunks, ones = [], []
        for req in reqs:
            st = req.evict_state
            if st is None or st.track is None or st.hidden_rows is None:
                continue
            tok, ntok, first = st.hidden_rows
            st.hidden_rows = None
            prefill = st.ledger.prefill_len  # the state's: a row object re-added by vLLM carries its own
            if first < prefill and not st.ledger.policy.config.prompt_sentences:
                st.track.skip(ntok)  # the paper's SkipKV cuts the output only
            elif hidden is not None and (first < prefill or first == st.track.next_pos):
                (ones if ntok == 1 and st.slot >= 0 else chunks).append((req, st, tok, ntok, first))
        if not chunks and not ones:
            return
        if self.osum is None or self.osum.shape[1] != hidden.shape[1]:
            self.osum = torch.zeros(self.slots + 1, hidden.shape[1], dtype=torch.float32)
        items = chunks + ones
        idx = torch.tensor([t for _, _, tok, ntok, _ in items for t in range(tok, tok + ntok)], device=hidden.device)
        rows = hidden.index_select(0, idx).float().cpu()
        at = 0
        for req, st, _, ntok, first in chunks:  # prompt chunks: the track's own feed
            if st.slot >= 0:
                self._park(st)
            st.track.feed(_token_ids(req, first, ntok), rows[at:at + ntok])
            if st.slot >= 0:
                self._unpark(st)
            at += ntok
        if ones:
            slots = torch.tensor([st.slot for _, st, _, _, _ in ones])
            self.osum[slots] += rows[at:]
            for req, st, _, _, first in ones:
                if st.track.count(_token_ids(req, first, 1)[0]):
                    st.track.close_with(self.osum[st.slot].clone())
                    self.osum[st.slot].zero_()

    def _park(self, st: EvictState) -> None:
        """The open-sentence sum of a state's slot into its track (the slot is about to change hands
        or its track to feed on its own); h2o's scores aside."""
        if st.h2o is not None:
            self.h2o.park(st.h2o, st.slot, st.n_phys)
        if st.track is not None and self.osum is not None:
            st.track.open_sum = self.osum[st.slot].clone() if st.track.open_n else None

    def _unpark(self, st: EvictState) -> None:
        """The track's open-sentence sum back into the state's (new) slot; h2o's scores likewise."""
        if st.h2o is not None:
            self.h2o.unpark(st.h2o, st.slot)
        if st.track is not None and self.osum is not None:
            if st.track.open_sum is None:
                self.osum[st.slot].zero_()
            else:
                self.osum[st.slot] = st.track.open_sum
            st.track.open_sum = None

    def _fill_writes(self, w_tok: list[int], w_slot: list[int], w_idx: list[int]) -> None:
        """The step's ring writes (token, slot, ring index); unused entries write the scratch slot."""
        n = min(len(w_tok), self.nw)
        host = self._writes_host
        if n < self._writes_n:  # entries the last step used and this one does not: back to the scratch slot
            host[:, n:self._writes_n] = torch.tensor([[0], [self.slots], [0]])
        if n:
            host[:, :n] = torch.tensor([w_tok[:n], w_slot[:n], w_idx[:n]])
        self._writes_n = n
        self.writes.copy_(host, non_blocking=self.device.type == "cuda" and host.is_pinned())

    # -- the compaction --------------------------------------------------------------------------
    def _compact_group(self, items: list[tuple[RowRequest, EvictState, torch.Tensor]], kv_caches: list[torch.Tensor],
                       paged: PagedRW) -> None:
        """Compact requests with the same policy, options and entry count at once: every layer of
        every request is scored as one stack of heads, read and written with one gather and one
        scatter per layer."""
        pol = items[0][0].evict
        st0 = items[0][1]
        n, budget = st0.n_phys, pol.budget
        first, last = pol.keep_first, pol.keep_last
        r = len(items)
        blocks = torch.stack([b for _, _, b in items])  # [R, blocks covering n]
        pos = torch.stack([self.positions(st, n) for _, st, _ in items])  # [R, L, Hkv, n]
        keys, vals = zip(*(paged.read_many(kv, blocks, n) for kv in kv_caches), strict=True)  # L x [R, Hkv, n, D]
        keep = torch.empty(r, self.L, self.hkv, budget, dtype=torch.long, device=self.device)
        choose = budget - first - min(last, budget - first) > 0
        if choose and pol.name == "h2o":  # accumulated attention (`h2o_scores`)
            scores = torch.stack([self.h2o.candidates(st.h2o, st.slot, n, last) for _, st, _ in items])
        elif choose:
            k_all = torch.stack(keys, dim=1)  # [R, L, Hkv, n, D]
            scores = self._scores(items, k_all, pos, n)  # [R, L, Hkv, candidates]
        heads = r * self.L * self.hkv
        per = max(1, SCORE_FLOATS // max(1, n))
        flat = scores.reshape(heads, -1) if choose else None
        out = keep.view(heads, budget)
        for h0 in range(0, heads, per):
            h1 = min(heads, h0 + per)
            out[h0:h1] = protected_top(flat[h0:h1] if choose else None, n, budget, first, last, h1 - h0, self.device)
        gi = keep.unsqueeze(-1).expand(-1, -1, -1, -1, self.d)  # [R, L, Hkv, budget, D]
        for layer, kv in enumerate(kv_caches):
            paged.write_front_many(kv, blocks, torch.gather(keys[layer], 2, gi[:, layer]),
                                   torch.gather(vals[layer], 2, gi[:, layer]))
        kept_pos = torch.gather(pos, 3, keep)
        for j, (_, st, _) in enumerate(items):
            if st.h2o is not None:  # the kept entries' scores move with them (the native `followers`)
                self.h2o.compacted(st.h2o, st.slot, n, keep[j])
        trace = settings().evict_trace
        for j, (_req, st, _) in enumerate(items):
            st.pos = kept_pos[j]
            st.tail_start = st.ledger.evicted + budget  # the step's new entry: logical position `before`
            st.n_phys = budget
            if trace:  # the kept entries' true positions [L][Hkv][budget], one JSON line per compaction
                with open(trace, "a") as f:
                    f.write(json.dumps({"policy": pol.name, "compaction": st.ledger.compactions,
                                        "positions": kept_pos[j].tolist()}) + "\n")

    def _scores(self, items, k_all: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
        """The policy's scores [R, L, Hkv, candidates] of every request, layer and KV head: the layers
        and requests are stacked as heads (the scores are per head), in groups of bounded memory;
        positions are taken relative to each request's newest entry so that one set of observation
        query positions serves all."""
        pol = items[0][0].evict
        r = len(items)
        w = pol.config.window
        qs, rel = [], []
        q_rel = None
        for j, (_, st, _) in enumerate(items):
            have = sorted((p, i) for i, p in enumerate(st.ring_pos) if p >= 0)[-w:]
            if not have:  # no observation query yet (its ring slot was reassigned while it was away)
                if r > 1:
                    return torch.cat([self._scores([it], k_all[j2:j2 + 1], pos[j2:j2 + 1], n)
                                      for j2, it in enumerate(items)])
                return self._scores_without_queries(st, k_all[0], pos[0], n)
            base = have[-1][0]
            qr = [p - base for p, _ in have]
            if q_rel is None:
                q_rel = qr
            elif qr != q_rel:  # observation windows of different shapes: score one by one
                return torch.cat([self._scores([it], k_all[j2:j2 + 1], pos[j2:j2 + 1], n)
                                  for j2, it in enumerate(items)])
            qs.append(self.ring[:, st.slot, [i for _, i in have]])  # [L, w, Hq, D]
            rel.append(pos[j] - base)
        q = torch.stack(qs).permute(0, 1, 3, 2, 4)  # [R, L, Hq, w, D]
        k_pos = torch.stack(rel)  # [R, L, Hkv, n]
        q_pos = torch.tensor(q_rel, device=self.device)
        per = max(1, SCORE_FLOATS // max(1, self.hkv * n * n))  # (request, layer) pairs per scoring call
        flat_q = q.reshape(r * self.L, self.hq, len(q_rel), self.d)
        flat_k = k_all.reshape(r * self.L, self.hkv, n, self.d)
        flat_p = k_pos.reshape(r * self.L, self.hkv, n)
        outs = []
        for a in range(0, r * self.L, per):
            b = min(r * self.L, a + per)
            qq = flat_q[a:b].reshape((b - a) * self.hq, len(q_rel), self.d)
            kk = flat_k[a:b].reshape((b - a) * self.hkv, n, self.d)
            pp = flat_p[a:b].reshape((b - a) * self.hkv, n)
            outs.append(rkv_scores(qq, q_pos, kk, pp, self.scaling, pol.config))
        scores = torch.cat(outs).view(r, self.L, self.hkv, -1)
        m = scores.shape[-1]
        for j, (_, st, _) in enumerate(items):
            if st.track is not None:
                scores[j] -= st.track.penalty_of(pos[j, ..., :m])
        return scores

    def _scores_without_queries(self, st: EvictState, k: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
        """R-KV's redundancy term alone (and SkipKV's penalty) for one request: [1, L, Hkv, candidates]."""
        from cotserve.policies.scoring import key_redundancy

        c = st.ledger.policy.config
        m = n - c.window
        red = key_redundancy(k.reshape(self.L * self.hkv, n, self.d), c.redundancy_threshold, c.redundancy_retain,
                             c.reference_quirk)[:, :m]
        scores = (-(1.0 - c.sigma) * red).view(1, self.L, self.hkv, m)
        if st.track is not None:
            scores[0] -= st.track.penalty_of(pos[..., :m])
        return scores

    # -- the metadata, in physical terms ---------------------------------------------------------
    def _rewrite(self, cm, rewrite, new_lens: list[int], block_size: int):
        """Sequence lengths, block-table rows and the new tokens' slots in physical terms, computed
        on the table's device (no host copy of the table)."""
        nr = cm.num_reqs
        table = cm.block_table_tensor
        dev = table.device
        width = min(table.shape[1], max(len(r[1]) for r in rewrite))
        # each slot's live block-list indices, on the host, rewritten only when they change
        if self._live_rows is None or self._live_rows.shape[1] != table.shape[1]:
            self._live_rows = torch.zeros(self.slots + 1, table.shape[1], dtype=torch.long)
            self._live_keys.clear()
        for _, live, _, _, _, st in rewrite:
            key = (id(st), st.ledger.compactions, len(live))
            if self._live_keys.get(st.slot) != key:
                m = min(len(live), table.shape[1])
                self._live_rows[st.slot, :m] = torch.tensor(live[:m])
                self._live_keys[st.slot] = key
        # every index this needs, in one host tensor and one copy to the table's device
        live_host = self._live_rows[[r[5].slot for r in rewrite], :width]
        flat: list[int] = [r[0] for r in rewrite]
        tok_row, tok_idx, tok_phys = [], [], []
        for j, (_, _, tok, ntok, phys_before, _) in enumerate(rewrite):
            tok_row.extend([j] * ntok)
            tok_idx.extend(range(tok, tok + ntok))
            tok_phys.extend(range(phys_before, phys_before + ntok))
        nrw, ntk = len(rewrite), len(tok_row)
        host = torch.cat([live_host.reshape(-1),
                          torch.tensor(flat + tok_row + tok_idx + tok_phys + new_lens, dtype=torch.long)])
        d = host if dev.type == "cpu" else host.to(dev)
        live_idx = d[:nrw * width].view(nrw, width)
        ridx = d[nrw * width:nrw * width + nrw]
        at = nrw * width + nrw
        rows_t, sidx, tp = d[at:at + ntk], d[at + ntk:at + 2 * ntk], d[at + 2 * ntk:at + 3 * ntk]
        tab = torch.gather(table[ridx, :], 1, live_idx)  # entries past a row's live blocks are never read
        slots = tab[rows_t, tp // block_size].to(cm.slot_mapping.dtype) * block_size + tp % block_size
        lens_t = host[at + 3 * ntk:].to(cm.seq_lens.dtype)
        if self.inplace:  # CUDA: the persistent tensors a captured graph reads
            cm.seq_lens[:nr].copy_(d[at + 3 * ntk:])
            table[ridx.unsqueeze(1), torch.arange(width, device=dev)] = tab
            out = metadata_with(cm)
        else:  # CPU: vLLM's block table tensor is its own host copy; rewrite copies
            seq_lens, new_table = cm.seq_lens.clone(), table.clone()
            seq_lens[:nr] = lens_t
            new_table[ridx.unsqueeze(1), torch.arange(width, device=dev)] = tab
            out = metadata_with(cm, seq_lens=seq_lens, block_table_tensor=new_table)
        cm.slot_mapping[sidx] = slots  # vLLM recomputes it every step; its KV write reads this tensor
        set_host_lens(out, cm, nr, lens_t)
        return out

    # -- per layer (attention forward) -----------------------------------------------------------
    def accumulate(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   key_cache: torch.Tensor | None = None, rows: int | None = None) -> None:
        """h2o's scores: add this layer's attention of the step's h2o rows (`H2OScores.layer`; with
        `key_cache`, CUDA's kernel over the persistent row tensors, launched every step)."""
        h = self.h2o
        if h is not None and (key_cache is not None or h.chunks or h.decode):
            h.layer(layer, q, kv_cache, block_table, self._paged, key_cache, rows)

    def record(self, layer: int, q: torch.Tensor) -> None:
        """Copy this step's query rows of evicting requests into their rings (q [tokens, Hq, D])."""
        self.ring[layer].index_put_((self.w_slot, self.w_idx), q[self.w_tok.clamp(max=q.shape[0] - 1)])
