"""Continuous batching for the native engine: iteration-level scheduling over a pool of slots.

`ContinuousEngine` wraps a `NativeEngine`. Requests are `submit`ted at any time; every `step()`

1. ends cancelled sequences (their slot frees at once) and admits waiting requests into free
   slots (at most `slots` sequences run at a time);
2. runs one decode step for every running sequence (one forward for all of them);
3. prefills joining prompts, at most `prefill_chunk` prompt tokens per step, so running streams
   keep a steady pace while a long prompt joins. A prompt is cut into chunks of `prefill_chunk`
   tokens when its policy stack allows it (`PolicyStack.chunked_prefill`: dense); otherwise it is
   prefilled whole in one step. Chunk boundaries depend only on the prompt, never on what else
   runs, so a sequence computes the same thing alone or beside others.

Each sequence owns its KV cache (allocated when it joins, with its policy's capacity, freed
when it leaves: running caches are never re-copied when the batch changes; a dense sequence's
cache starts at its prompt plus `grow` entries and doubles when full, so many slots do not
reserve every sequence's whole context up front; an evicting sequence's cache shrinks to its
steady-state capacity, budget plus interval, once it has compacted below it, so the memory its
prompt took returns while it decodes) and its own policy
stack, which sees a one-slot `BatchState` exactly as the static engine's batch of one. The
decoder stack's projections and MLPs run once for all rows of a step; each layer's attention
(`_Rows.route`) goes to each row's own cache and stack, so sequences of different lengths are
never padded against each other in attention, and sequences with different policies may share a
step. Decode rows whose stack is dense through the C++ CPU kernel (`PolicyStack.kernel_dense`)
attend together, one `ragged_decode` call per layer over their own caches (the same arithmetic as
the kernel's one-sequence call, bit for bit); every other row goes through its own stack.

On CUDA (or with `static_step=True` anywhere) dense sequences, and those of a policy with a pooled
form (`Policy.pooled_form`), that fit a slot of `pool_len` entries decode instead in the pooled,
fixed-shape step of `pooled_decode.py`: their caches
live in one pool allocated once per engine, the step reads its rows through persistent index
tensors, and on CUDA it is captured once per batch-size bucket (1, 2, 4, ... up to `slots`) and
replayed as the batch changes. They prefill into their slot eagerly, as above. Sequences of other
policies (eviction, steering, ...) or longer than a slot keep the eager path described above; a
step with both runs the replay and one eager forward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cotserve.engine.native import Completion, Delta, GenRequest, NativeEngine, _Slot
from cotserve.engine.pooled_decode import PooledDecode, PoolRow, PoolSlot, SlotPool, capturable
from cotserve.engine.textproc import IncrementalDetokenizer, StopStringMatcher
from cotserve.errors import RequestError
from cotserve.kernels import cpu_decode
from cotserve.kv.batch import BatchState
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.policies.base import PolicyStack, grouped_attention
from cotserve.policies.interface import Axis
from cotserve.policies.registry import build_policy


@dataclass
class _Seq:
    """One sequence in the pool: its decode-loop state, its one-slot batch and its timings."""

    slot: _Slot
    stack: PolicyStack
    view: BatchState | None = None  # allocated on admission
    state: str = "waiting"  # waiting | prefill | decode
    filled: int = 0  # prompt tokens prefilled so far
    steps: int = 0  # decode steps run
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    prefill_s: float = 0.0  # time in prefill forwards that carried this sequence
    rows_sum: int = 0  # running rows summed over this sequence's decode steps
    kv_before: torch.Tensor | None = None
    kv_after_prefill: int = 0
    kv_peak: int = 0
    grows: bool = False  # its cache starts small and grows as it decodes (dense)
    steady: int = 0  # > 0: an evicting sequence's capacity once compacted (its cache shrinks to it)
    alloc_peak: int = 0  # the most K+V bytes its cache had allocated
    pool_slot: int | None = None  # its slot in the pool when it decodes in the pooled step
    kind: str = ""  # its rows' kind in the pooled step: "dense" or the policy whose pooled form it joined


class _Rows:
    """The rows of one forward: what the decoder stack sees as its batch. Attention and steering
    go to each row's own one-slot batch and policy stack."""

    def __init__(self, seqs: list[_Seq], mode: str, lean: bool, starts: list[int] | None = None,
                 lengths: list[int] | None = None):
        self.seqs = seqs
        self.mode = mode
        self.lean = lean
        self.starts = starts or [0] * len(seqs)
        self.lengths = lengths or [1] * len(seqs)
        self.hidden: torch.Tensor | None = None
        self.policy = self  # the decoder stack calls batch.policy.steer(...)
        self.scaling = seqs[0].view.scaling if seqs and seqs[0].view is not None else 1.0
        self._steer = [s.stack.steers() for s in seqs]
        # for logits hooks written against BatchState
        self.tokens = [s.view.tokens[0] for s in seqs if s.view is not None]
        self.prompt_lens = torch.tensor([s.slot.prompt_len for s in seqs])
        # decode rows attended together through the C++ kernel, over their own caches
        self.joint: list[int] = []
        if mode == "decode":
            self.joint = [j for j, s in enumerate(seqs) if s.stack.kernel_dense()]
        if self.joint:
            caches = [seqs[j].view.cache for j in self.joint]  # type: ignore[union-attr]
            self.joint_k = [c.k for c in caches]
            self.joint_v = [c.v for c in caches]
            self.joint_at = [int(c.lens[0, 0]) for c in caches]  # the row each new entry goes to
            self.joint_lens = torch.tensor(self.joint_at)
            self.joint_set = set(self.joint)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def steer(self, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        if not any(self._steer):
            return hidden
        hidden = hidden.clone()
        for j, s in enumerate(self.seqs):
            if self._steer[j]:
                n = self.lengths[j]
                hidden[j : j + 1, :n] = s.stack.steer(layer, hidden[j : j + 1, :n], s.view)
        return hidden

    def route(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of every row through its own cache and policy stack: q [B, Hq, T, D],
        k/v [B, Hkv, T, D] -> [B, Hq, T, D]."""
        if self.mode == "decode":
            b, hq, _, d = q.shape
            hkv = k.shape[1]
            joint = None
            if self.joint:
                rows = self.joint if len(self.joint) < b else slice(None)
                joint = cpu_decode.ragged_decode(q[rows].reshape(-1, hkv, hq // hkv, d), k[rows, :, 0], v[rows, :, 0],
                                                 self.joint_k, self.joint_v, layer, self.joint_lens, self.scaling)
                joint = joint.view(-1, hq, 1, d)
                if len(self.joint) == b:
                    return joint
            outs = []
            at = 0
            for j, s in enumerate(self.seqs):
                if self.joint and j in self.joint_set:
                    assert joint is not None
                    outs.append(joint[at : at + 1])
                    at += 1
                    continue
                view = s.view
                assert view is not None
                view.cache.write_decode(layer, k[j : j + 1], v[j : j + 1], view.positions)
                outs.append(s.stack.decode_attention(layer, q[j : j + 1], view))
            return torch.cat(outs, 0)
        out = torch.zeros_like(q)
        for j, s in enumerate(self.seqs):
            view = s.view
            assert view is not None
            start, n = self.starts[j], self.lengths[j]
            qj, kj, vj = q[j : j + 1, :, :n], k[j : j + 1, :, :n], v[j : j + 1, :, :n]
            if start == 0 and n == s.slot.prompt_len:  # the whole prompt: the static engine's path
                view.cache.write_prefill(layer, kj, vj, view.prompt_lens)
                out[j : j + 1, :, :n] = s.stack.prefill_attention(layer, qj, kj, vj, view)
            else:  # one chunk: causal over the cached chunks before it and itself
                view.cache.write_chunk(layer, kj, vj, start)
                total = start + n
                keys = view.cache.k[layer, :, :, :total]
                vals = view.cache.v[layer, :, :, :total]
                rows = torch.arange(start, total, device=q.device).view(-1, 1)
                valid = torch.arange(total, device=q.device).view(1, -1) <= rows  # [n, total]
                out[j : j + 1, :, :n] = grouped_attention(qj.contiguous(), keys, vals, valid.view(1, 1, n, total),
                                                          view.scaling)
        return out


class ContinuousEngine:
    """Iteration-level scheduling over `slots` sequences of a `NativeEngine` (module docstring).

    Not thread-safe: one thread calls `submit`, `cancel` and `step` (the worker's loop)."""

    def __init__(self, engine: NativeEngine, slots: int | None = None, prefill_chunk: int = 256, grow: int = 256,
                 static_step: bool | None = None, pool_len: int = 4096,
                 pool_capacity: Mapping[str, int] | None = None):
        if prefill_chunk < 1 or grow < 1 or pool_len < 2:
            raise ValueError("prefill_chunk and grow must be at least 1, pool_len at least 2")
        self.grow = grow
        self.engine = engine
        self.slots = slots or engine.max_batch
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        self.prefill_chunk = prefill_chunk
        self.device = engine.device
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # admitted: prefilling or decoding, in admission order
        self._cancel: set[str] = set()
        self.steps = 0
        # the pooled fixed-shape step (pooled_decode.py): by default on CUDA with the engine's CUDA
        # graphs (and Triton, a power-of-two head dim), captured per batch-size bucket; static_step=True runs it on any device (eagerly
        # where it is not captured: how the tests check it on a CPU); False: never
        cuda = self.device.type == "cuda"
        can_capture = cuda and engine.cuda_graphs and capturable(engine)
        self.static_step = can_capture if static_step is None else static_step
        self.capture = self.static_step and can_capture
        self.pool_len = pool_len  # cache entries per pool slot: longer sequences decode eagerly
        # per pooled kind (a policy's name): entries per KV head its pooled form holds for one
        # sequence (SFI's selected set, `k`); a kind left out takes its form's default
        self.pool_capacity = dict(pool_capacity or {})
        self._pool: SlotPool | None = None  # made at the first admission (its KV at the first slot taken)
        self._pooled: PooledDecode | None = None

    # -- intake ----------------------------------------------------------------------------
    def submit(self, req: GenRequest, policy: str | PolicyStack | None = None,
               options: dict[str, Any] | None = None) -> None:
        """Queue a request; it joins the running batch at the next step with a free slot. Each
        request gets its own policy stack (a `PolicyStack` given here is used by this request only).
        Raises `RequestError` / `CotserveError` for a bad prompt or policy."""
        eng = self.engine
        eng.check_request(req)
        if any(s.slot.req.request_id == req.request_id for s in (*self.waiting, *self.running)):
            raise RequestError(f"request id {req.request_id!r} is already running")
        stack = policy if isinstance(policy, PolicyStack) else build_policy(policy, options)
        n = len(req.prompt_ids)
        max_new = min(req.sampling.max_tokens, eng.info.max_positions - n)
        slot = _Slot(req, n, max_new, req.sampling.make_generator(self.device),
                     IncrementalDetokenizer(eng.tokenizer), StopStringMatcher(list(req.sampling.stop)),
                     think=eng.thinking(req))
        self.waiting.append(_Seq(slot, stack))

    def cancel(self, request_id: str) -> None:
        """The sequence ends at the start of the next step (finish reason "cancelled")."""
        self._cancel.add(request_id)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def free_slots(self) -> int:
        """Slots that no running or waiting sequence will take."""
        return max(0, self.slots - len(self.running) - len(self.waiting))

    @property
    def pooled_step(self) -> PooledDecode:
        """The pooled step and its slot pool, allocated at first use."""
        if self._pooled is None:
            self._pool = SlotPool(self.engine, self.slots, self.pool_len, self.pool_capacity)
            self._pooled = PooledDecode(self.engine, self._pool, self.capture)
        return self._pooled

    def _pool_cache(self, s: _Seq, capacity: int) -> KVCache | None:
        """A slot of the pool for a sequence that can decode in the pooled step, else None."""
        if not self.static_step:
            return None
        pool = self.pooled_step.pool
        kind = pool.kind(s.stack, capacity)
        if kind is None:
            return None
        s.pool_slot, s.kind = pool.acquire(), kind
        return pool.cache.slot_view(s.pool_slot)

    def _admit(self, s: _Seq) -> None:
        eng = self.engine
        info = eng.info
        n = s.slot.prompt_len
        capacity = s.stack.capacity([n], s.slot.max_new)
        cache = self._pool_cache(s, capacity)
        if cache is not None:
            pass  # a slot of the pool: fixed size, the whole sequence fits
        elif s.stack.parts and all(p.name == "dense" for p in s.stack.parts):
            # dense holds no per-entry state of its own: its cache starts at the prompt plus
            # `grow` entries and grows as it decodes (`_grow`), so a pool of many slots does not
            # reserve every sequence's whole context up front
            capacity = min(capacity, n + self.grow)
            s.grows = True
        elif s.stack.parts and all(p.axis == Axis.EVICT for p in s.stack.parts):
            # an evicting sequence needs its prompt's room only until its cache first compacts to
            # the budget; then `_shrink` hands the rest back
            asked = [c for p in s.stack.parts if (c := p.capacity([1], s.slot.max_new)) is not None]
            if asked and min(asked) < capacity:  # a prompt longer than the steady state
                s.steady = min(asked)
        if cache is None:
            cache = KVCache(CacheShape(info.num_layers, 1, info.num_kv_heads, capacity, info.head_dim),
                            eng.dtype, self.device)
        s.alloc_peak = cache.allocated_bytes_per_slot()
        pool_slot = None
        if s.pool_slot is not None:
            pool = self.pooled_step.pool
            pool_slot = PoolSlot(pool, s.pool_slot, pool.forms.get(s.kind))
        s.view = BatchState(info=info, cache=cache, policy=s.stack, scaling=eng.scaling,
                            prompt_lens=torch.tensor([n], device=self.device),
                            tokens=[list(s.slot.req.prompt_ids)],
                            active=torch.ones(1, dtype=torch.bool, device=self.device),
                            extras={0: s.slot.req.extras}, lean=True, pool_slot=pool_slot)
        try:
            s.stack.begin(s.view)
            if s.pool_slot is not None and not s.stack.graph_safe():
                raise RuntimeError(f"policy {s.stack.name} took a pool slot but cannot decode in the pooled step")
        except Exception:
            self._drop(s)  # its pool slot goes back
            raise
        s.state = "prefill"
        s.t_admit = time.perf_counter()
        self.running.append(s)

    # -- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Delta]:
        """One iteration: cancellations, admissions, a decode step for the running sequences, a
        bounded prefill for the joining ones. Returns this step's deltas (the last delta of a
        request carries its `Completion`)."""
        deltas: list[Delta] = []
        if self._cancel:
            for s in [s for s in (*self.waiting, *self.running) if s.slot.req.request_id in self._cancel]:
                s.slot.finish = "cancelled"
                deltas.append(self._final(s))
                self._drop(s)
            self._cancel.clear()
        while self.waiting and len(self.running) < self.slots:
            self._admit(self.waiting.popleft())
        if not self.running:
            return deltas
        lean = not self.engine._layers_hooked()
        decoding = [s for s in self.running if s.state == "decode"]
        if decoding:
            deltas.extend(self._decode(decoding, lean))
        joining = [s for s in self.running if s.state == "prefill"]
        if joining:
            deltas.extend(self._prefill(joining, lean))
        self.steps += 1
        return deltas

    def _drop(self, s: _Seq) -> None:
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        if s.pool_slot is not None:  # its pool slot is free for the next sequence at once
            self.pooled_step.pool.release(s.pool_slot)
            s.pool_slot = None
        s.view = None  # the cache goes with it

    def _emit(self, s: _Seq, tok: int, text: str) -> Delta:
        lps = None if s.slot.last_lp is None else [s.slot.last_lp]
        if s.slot.finish is None:
            return Delta(s.slot.req.request_id, [tok], text, logprobs=lps)
        d = self._final(s, tok, text)
        self._drop(s)
        return d

    def _shrink(self, s: _Seq) -> None:
        """After a forward: once an evicting sequence's cache holds less than its steady-state
        capacity (budget plus the eviction interval), reallocate it to that size."""
        cache = s.view.cache  # type: ignore[union-attr]
        if s.steady and cache.capacity > s.steady and int(cache.lens.max()) < s.steady:
            cache.shrink(s.steady)
            s.steady = 0

    def _grow(self, s: _Seq) -> None:
        """Room for this step's entry in a dense sequence's cache (see `_admit`): double, up to
        the sequence's full length."""
        cache = s.view.cache  # type: ignore[union-attr]
        if int(cache.lens[0].max()) >= cache.capacity:
            full = s.stack.capacity([s.slot.prompt_len], s.slot.max_new)
            cache.grow(min(full, 2 * cache.capacity))
            s.alloc_peak = max(s.alloc_peak, cache.allocated_bytes_per_slot())

    def _decode(self, seqs: list[_Seq], lean: bool) -> list[Delta]:
        """One decode step of the running sequences: those in the pool through the pooled step
        (captured on CUDA), the others through the eager step, each its own forward."""
        pooled = [s for s in seqs if s.pool_slot is not None]
        eager = [s for s in seqs if s.pool_slot is None]
        deltas = self._decode_pooled(pooled, lean, len(seqs)) if pooled else []
        if eager:
            deltas.extend(self._decode_eager(eager, lean, len(seqs)))
        return deltas

    def _decode_pooled(self, seqs: list[_Seq], lean: bool, total: int) -> list[Delta]:
        eng = self.engine
        step = self.pooled_step
        rows = [PoolRow(s.pool_slot, s.kind, s.slot.out_ids[-1], s.slot.prompt_len + len(s.slot.out_ids) - 1)
                for s in seqs if s.pool_slot is not None]
        step.before_step(rows)  # the pooled forms' host work (SFI: the refreshes due)
        for s in seqs:
            view = s.view
            assert view is not None and s.pool_slot is not None
            view.mode = "decode"
            view.step = s.steps
            s.stack.before_step(view)  # a pooled form's policy plans its row (SFI)
        hidden = step.run(rows, lean)
        entry = 2 * eng.info.num_layers * eng.info.num_kv_heads * eng.info.head_dim * step.pool.cache.k.element_size()
        for j, (s, row) in enumerate(zip(seqs, rows, strict=True)):
            view = s.view
            assert view is not None
            view.hidden = hidden[j : j + 1]
            s.kv_peak = max(s.kv_peak, (row.position + 1) * entry)  # nothing evicted in the pool: no device read
            s.stack.after_forward(view)
            s.steps += 1
            s.rows_sum += total
        logits = eng.logits(hidden[:, -1], _Rows(seqs, "logits", lean))  # type: ignore[arg-type]
        return self._sample(seqs, logits)

    def _decode_eager(self, seqs: list[_Seq], lean: bool, total: int) -> list[Delta]:
        eng = self.engine
        for s in seqs:
            if s.grows:
                self._grow(s)
        ids = torch.tensor([[s.slot.out_ids[-1]] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([s.slot.prompt_len + len(s.slot.out_ids) - 1 for s in seqs], device=self.device)
        for j, s in enumerate(seqs):
            view = s.view
            assert view is not None
            view.mode = "decode"
            view.step = s.steps
            view.positions = positions[j : j + 1]
            s.stack.before_step(view)
        rows = _Rows(seqs, "decode", lean)
        hidden = eng.forward(ids, positions.view(-1, 1), rows)  # type: ignore[arg-type]
        for at, j in enumerate(rows.joint):  # the kernel wrote their new rows: the bookkeeping of write_decode
            cache = seqs[j].view.cache  # type: ignore[union-attr]
            cache.pos[:, 0, :, rows.joint_at[at]] = positions[j]
            cache.lens += 1
        for j, s in enumerate(seqs):
            view = s.view
            assert view is not None
            view.hidden = hidden[j : j + 1]
            s.kv_peak = max(s.kv_peak, int(view.cache.nbytes_per_slot()[0]))
            s.stack.after_forward(view)
            if s.steady:
                self._shrink(s)
            s.steps += 1
            s.rows_sum += total
        logits = eng.logits(hidden[:, -1], rows)  # type: ignore[arg-type]
        return self._sample(seqs, logits)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[Delta]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for j, s in enumerate(seqs):
            tok, text = self.engine._advance(s.slot, logits[j], greedy[j])
            assert s.view is not None
            s.view.tokens[0].append(tok)
            out.append(self._emit(s, tok, text))
        return out

    def _prefill(self, joining: list[_Seq], lean: bool) -> list[Delta]:
        eng = self.engine
        chosen: list[_Seq] = []
        starts: list[int] = []
        lengths: list[int] = []
        used = 0
        for s in joining:
            left = s.slot.prompt_len - s.filled
            n = min(left, self.prefill_chunk) if s.stack.chunked_prefill() else left
            if chosen and used + n > self.prefill_chunk:
                break
            chosen.append(s)
            starts.append(s.filled)
            lengths.append(n)
            used += n
        t0 = time.perf_counter()
        tmax = max(lengths)
        ids = torch.full((len(chosen), tmax), eng.eos_default(), dtype=torch.long, device=self.device)
        for j, s in enumerate(chosen):
            ids[j, : lengths[j]] = torch.tensor(s.slot.req.prompt_ids[starts[j] : starts[j] + lengths[j]],
                                                device=self.device)
        pos = torch.tensor(starts, device=self.device).view(-1, 1) + torch.arange(tmax, device=self.device)
        for s in chosen:
            assert s.view is not None
            s.view.mode = "prefill"
        rows = _Rows(chosen, "prefill", lean, starts, lengths)
        hidden = eng.forward(ids, pos, rows)  # type: ignore[arg-type]
        done: list[tuple[int, _Seq]] = []
        for j, s in enumerate(chosen):
            view = s.view
            assert view is not None
            view.hidden = hidden[j : j + 1, : lengths[j]]
            s.filled += lengths[j]
            complete = s.filled == s.slot.prompt_len
            kv_before = int(view.cache.nbytes_per_slot()[0])
            s.stack.after_forward(view)
            if complete:
                s.kv_after_prefill = int(view.cache.nbytes_per_slot()[0])
                s.kv_peak = max(kv_before, s.kv_after_prefill)
                if s.steady:
                    self._shrink(s)
                done.append((j, s))
        dt = time.perf_counter() - t0
        for s in chosen:
            s.prefill_s += dt
        if not done:
            return []
        last = torch.stack([hidden[j, lengths[j] - 1] for j, _ in done])
        seqs = [s for _, s in done]
        logits = eng.logits(last, _Rows(seqs, "prefill", lean))  # type: ignore[arg-type]
        now = time.perf_counter()
        for s in seqs:
            s.state = "decode"
            s.t_first = now
        return self._sample(seqs, logits)

    # -- results ---------------------------------------------------------------------------
    def _final(self, s: _Seq, tok: int | None = None, text: str = "") -> Delta:
        slot = s.slot
        now = time.perf_counter()
        n = len(slot.out_ids)
        decode_s = now - s.t_first if s.t_first else 0.0
        tele: dict[str, Any] = {
            "policy": s.stack.name,
            "scheduler": "continuous",
            "queue_s": round((s.t_admit or now) - s.t_submit, 4),
            "ttft_s": round(s.t_first - s.t_submit, 4) if s.t_first else None,
            "prefill_s": round(s.prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tok_s": round((n - 1) / decode_s, 2) if decode_s > 0 and n > 1 else 0.0,
            "batch_size": round(s.rows_sum / s.steps, 2) if s.steps else 1,
            # how its decode steps ran: cuda_graph (the pooled step, replayed), static (the pooled
            # step, uncaptured) or eager (its own cache and policy stack)
            "decode_step": ("cuda_graph" if self.capture else "static") if s.kind else "eager",
            "padding_fraction": 0.0,
        }
        view = s.view
        if view is not None:
            tele.update({
                "kv_bytes_after_prefill": s.kv_after_prefill,
                "kv_bytes_peak": s.kv_peak,
                "kv_bytes_allocated": view.cache.allocated_bytes_per_slot(),
                "kv_bytes_allocated_peak": s.alloc_peak,
                "kv_bytes_final": int(view.cache.nbytes_per_slot()[0]),
            })
            tele.update(s.stack.telemetry(0))
        comp = Completion(request_id=slot.req.request_id, text=slot.stops.text, token_ids=list(slot.out_ids),
                          finish_reason=slot.finish or "stop", prompt_tokens=slot.prompt_len,
                          completion_tokens=n, telemetry=tele, greedy_ids=list(slot.greedy_ids),
                          logprobs=torch.stack(slot.logprob_rows) if slot.logprob_rows else None)
        lps = [slot.last_lp] if tok is not None and slot.last_lp is not None else None
        return Delta(slot.req.request_id, [] if tok is None else [tok], text, finished=True,
                     finish_reason=comp.finish_reason, result=comp, logprobs=lps)

    # -- conveniences ----------------------------------------------------------------------
    def run(self, on_step: Callable[[int], None] | None = None) -> Iterator[list[Delta]]:
        """Step until every submitted request has finished; yields each step's deltas.
        `on_step(i)` runs before the i-th step of this run (tests submit requests mid-run through it)."""
        first = self.steps
        while True:
            if on_step is not None:
                on_step(self.steps - first)
            if self.idle:
                return
            yield self.step()

    def generate(self, requests: list[GenRequest], policy: str | PolicyStack | None = None,
                 options: dict[str, Any] | None = None) -> list[Completion]:
        """Run requests to completion (each with its own copy of the policy); results in order."""
        for r in requests:
            self.submit(r, _fresh(policy), options)
        results: dict[str, Completion] = {}
        for deltas in self.run():
            for d in deltas:
                if d.result is not None:
                    results[d.request_id] = d.result
        return [results[r.request_id] for r in requests]


def _fresh(policy: str | PolicyStack | None) -> str | PolicyStack | None:
    """A policy stack object holds per-sequence state: each request needs its own."""
    if isinstance(policy, PolicyStack):
        import copy

        return copy.deepcopy(policy)
    return policy
