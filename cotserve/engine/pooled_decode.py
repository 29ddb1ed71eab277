"""The continuous engine's pooled, fixed-shape decode step, captured in CUDA graphs per batch size.

Why: the continuous engine's running set changes at every step, and each sequence owns a growing
cache, so its eager decode step cannot be captured. Here the caches of the sequences that may
join a captured step live in one pool at fixed addresses, and the step reads its rows through
persistent index tensors, so one graph per batch-size bucket serves every running set of that
size:

* `SlotPool`: K/V `[layers, slots + 1, kv_heads, length, head_dim]` allocated once per engine, at
  the first sequence that takes a slot (one page of `length` entries per slot; the last slot is
  the pad slot, where padding rows write). A sequence takes a slot when it joins and gives it back
  when it finishes or is cancelled; it prefills into its slot eagerly through an ordinary one-slot
  view (`KVCache.slot_view`), so prefill and chunked prefill are today's code.
* `PooledDecode`: the decode forward for a bucket of b rows (b in 1, 2, 4, ... up to the pool's
  slots): row r reads its token, position and pool slot from persistent tensors (rows past the
  running set point at the pad slot). Per layer, inside the step: the new K/V go to
  `(slot, position)`; dense rows attend through the Triton decode kernel launched over every pool
  slot, a per-slot skip flag leaving out the slots of other rows (`kernels/decode_attention.py`;
  the torch twin on a CPU); the rows of a policy with a pooled form through that form's `attend`
  (`policies/interface.PooledForm`). On CUDA the step is captured once per (bucket, pooled kinds
  present) and replayed; elsewhere (`ContinuousEngine(static_step=True)` on a CPU) the same step
  runs eagerly, which is how the tests check it.

Which sequences join: a stack of one part whose sequence fits a slot (prompt + max_tokens + 1
entries): dense (`kernel=auto`, the engine's own rows), or a policy that answers the pooled hook
(`Policy.pooled_form`) with a runtime that `fits` the sequence's options. The pool asks the hook
once per policy name, at its first sequence, keeps the runtime in `SlotPool.forms` and never names
a policy. Every other sequence (eviction, steering, the other read policies, options a form does
not serve, a sequence longer than a slot) decodes through the engine's eager path, in a second
forward of the same step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cotserve.kernels.decode_attention import HAVE_TRITON, decode_attention
from cotserve.kv.cache import CacheShape, KVCache

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cotserve.engine.native import NativeEngine
    from cotserve.kv.batch import BatchState
    from cotserve.policies.base import PolicyStack
    from cotserve.policies.interface import PolicyConfig, PooledForm

DENSE = "dense"  # the engine's own rows: the dense launch over every slot


def buckets(slots: int) -> list[int]:
    """Batch sizes with a step of their own: powers of two below `slots`, then `slots`."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return [*out, slots]


def capturable(engine: NativeEngine) -> bool:
    """Whether the pooled step can be captured for this engine's model: Triton is installed (the
    torch twins of the kernels read lengths on the host) and the head dim is a power of two of at
    least 16 (the dense kernel's tiles)."""
    d = engine.info.head_dim
    return HAVE_TRITON and d >= 16 and d & (d - 1) == 0


class SlotPool:
    """KV slots at fixed addresses for the pooled step (module docstring), and the pooled forms of
    the policies whose sequences joined it, by policy name (the interface's `PoolView`)."""

    def __init__(self, engine: NativeEngine, slots: int, length: int, capacity: Mapping[str, int] | None = None):
        info = engine.info
        self.engine = engine
        self.slots = slots
        self.length = length
        self.pad = slots  # the pad slot's index
        self.num_heads = info.num_heads
        self.scaling = engine.scaling
        self.capacities = dict(capacity or {})
        self._cache: KVCache | None = None  # allocated when the first sequence takes a slot
        self.free = list(range(slots))
        # policy name -> its runtime, made at its first sequence (SFI's: cotserve/policies/sfi/pooled.py)
        self.forms: dict[str, PooledForm] = {}

    @property
    def cache(self) -> KVCache:
        if self._cache is None:
            info = self.engine.info
            self._cache = KVCache(CacheShape(info.num_layers, self.slots + 1, info.num_kv_heads, self.length,
                                             info.head_dim), self.engine.dtype, self.engine.device)
        return self._cache

    @property
    def k(self) -> torch.Tensor:
        return self.cache.k

    @property
    def v(self) -> torch.Tensor:
        return self.cache.v

    @property
    def tokenizer(self) -> Any:
        return self.engine.info.tokenizer

    def capacity(self, kind: str, default: int) -> int:
        """Entries per KV head the pooled form of `kind` holds for one sequence (the engine's
        setting, else the form's default), at most a slot's length."""
        return min(self.capacities.get(kind, default), self.length)

    def kind(self, stack: PolicyStack, need: int) -> str | None:
        """The rows' kind of a sequence of `need` cache entries with this stack in the pooled step:
        "dense", the name of a policy whose pooled form takes it, or None (the eager path)."""
        if need > self.length or len(stack.parts) != 1:
            return None
        part = stack.parts[0]
        if part.name == DENSE:
            return DENSE if getattr(part.config, "kernel", "auto") == "auto" else None
        form = self.forms.get(part.name)
        if form is None:
            form = part.pooled_form(self)
            if form is None:
                return None
            self.forms[part.name] = form
        return part.name if form.fits(part.config, need) else None

    def acquire(self) -> int:
        slot = min(self.free)
        self.free.remove(slot)
        c = self.cache
        c.pos[:, slot] = -1
        c.lens[:, slot] = 0
        return slot

    def release(self, slot: int) -> None:
        for form in self.forms.values():
            form.leave(slot)
        self.free.append(slot)


@dataclass
class PoolSlot:
    """A sequence's slot, as its one-slot `BatchState` carries it (`pool_slot`): a policy with a
    pooled form joins that form through it, in its `begin` (`form` None: a dense row)."""

    pool: SlotPool
    slot: int
    form: PooledForm | None = None

    def join(self, config: PolicyConfig, batch: BatchState) -> Any:
        assert self.form is not None, "a dense row joins no pooled form"
        return self.form.join(config, self.slot, int(batch.prompt_lens[0]))


@dataclass
class PoolRow:
    """One running sequence in a pooled step."""

    slot: int
    kind: str  # "dense" or the name of the policy whose pooled form it joined
    token: int  # its input token
    position: int  # that token's position (= its cache entries before the step)


Kinds = tuple[str, ...]  # the pooled forms' kinds present in a step, sorted ("dense" not among them)


class _StepBatch:
    """What the decoder stack sees as its batch in a pooled step: attention goes to
    `PooledDecode.attend`, no steering."""

    mode = "decode"

    def __init__(self, step: PooledDecode, rows: int, kinds: Kinds, lean: bool):
        self.step, self.rows, self.kinds, self.lean = step, rows, kinds, lean
        self.policy = self  # the decoder stack calls batch.policy.steer(...)
        self.hidden: torch.Tensor | None = None

    def steer(self, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        return hidden

    def route(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.step.attend(layer, q, k, v, self.rows, self.kinds)


def pooled_kinds(rows: list[PoolRow]) -> Kinds:
    """The kinds of pooled forms among these rows, in a fixed order (part of a graph's key)."""
    return tuple(sorted({r.kind for r in rows} - {DENSE}))


class PooledDecode:
    """The bucketed decode step over a `SlotPool`; with `capture`, one CUDA graph per (bucket,
    pooled kinds present), captured at its first use and replayed after (module docstring)."""

    def __init__(self, engine: NativeEngine, pool: SlotPool, capture: bool):
        self.engine = engine
        self.pool = pool
        self.capture = capture
        self.buckets = buckets(pool.slots)
        s, info, dev = pool.slots, engine.info, engine.device
        # per row: input token, position (= the write index), pool slot
        self.rows_t = torch.zeros(3, s, dtype=torch.long, device=dev)
        # per pool slot and KV head, for the dense launch: skip flag, entries after the step's write
        self.meta = torch.zeros(2, s + 1, info.num_kv_heads, dtype=torch.int32, device=dev)
        self.zeros = torch.zeros(s + 1, info.num_kv_heads, dtype=torch.int32, device=dev)
        self.q_slots = torch.zeros(s + 1, info.num_heads, info.head_dim, dtype=engine.dtype, device=dev)
        self.graphs: dict[tuple[int, Kinds], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0
        self.warmed: set[tuple[int, Kinds]] = set()
        self.bucket_steps: Counter[tuple[int, int]] = Counter()  # (running rows, bucket) -> steps
        self._mempool: Any = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def before_step(self, rows: list[PoolRow]) -> None:
        """The per-step host work of the pooled forms among these rows, before their policies'
        `before_step` (which plans each row)."""
        for kind in pooled_kinds(rows):
            self.pool.forms[kind].before_step()

    def run(self, rows: list[PoolRow], lean: bool) -> torch.Tensor:
        """One decode step of `rows` (each row's input token and position); returns the final-norm
        hidden states [len(rows), 1, hidden]. The caller has run `before_step` and the rows'
        policies' `before_step` (a pooled form's plan of each row)."""
        n = len(rows)
        b = self.bucket(n)
        kinds = pooled_kinds(rows)
        key = (b, kinds)
        self.bucket_steps[(n, b)] += 1
        captured = self.capture and lean  # a forward hook must fire: the module path, eagerly
        if key not in self.warmed or (captured and key not in self.graphs):
            self._warm_up(b, kinds, lean, captured)
        self._write(rows, kinds)
        if captured:
            graph, hidden = self.graphs[key]
            graph.replay()
        else:
            hidden = self._forward(b, kinds, lean)
        return hidden[:n]

    # -- per step, outside the graph ------------------------------------------------------------
    def _write(self, rows: list[PoolRow], kinds: Kinds) -> None:
        """Fill the persistent row tensors: the running rows first, then padding rows at the pad
        slot (token 0, position 0). No rows: every row a padding row, the pooled forms' plans kept
        (a capture's warm-up)."""
        pad = self.pool.slots - len(rows)
        cols = [r.token for r in rows] + [0] * pad, [r.position for r in rows] + [0] * pad, \
            [r.slot for r in rows] + [self.pool.pad] * pad
        self.rows_t.copy_(torch.tensor(cols, dtype=torch.long), non_blocking=True)
        meta = torch.zeros(2, self.pool.slots + 1, dtype=torch.int32)
        meta[0] = 1
        dense = [r for r in rows if r.kind == DENSE]
        if dense:
            idx = torch.tensor([r.slot for r in dense])
            meta[0, idx] = 0
            meta[1, idx] = torch.tensor([r.position + 1 for r in dense], dtype=torch.int32)
        self.meta.copy_(meta.unsqueeze(-1).expand_as(self.meta), non_blocking=True)
        order = [r.slot for r in rows]
        for kind in kinds:
            form = self.pool.forms[kind]
            if rows:
                form.write_rows(order)
            else:
                form.clear_rows()

    def _warm_up(self, b: int, kinds: Kinds, lean: bool, capture: bool) -> None:
        """The first step of a shape: one run with every row at the pad slot (Triton compilation,
        the allocator; it writes nothing of a sequence and keeps the step's plans), then, on CUDA,
        the capture. Uncaptured (a CPU) the warm-up run is the same, so the tests see it."""
        self._write([], kinds)
        self.warmed.add((b, kinds))
        if not capture:
            self._forward(b, kinds, lean)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (Triton compilation, allocator) off the graph
            self._forward(b, kinds, lean)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            hidden = self._forward(b, kinds, lean)
        self._mempool = graph.pool()  # the buckets' graphs share one memory pool (replayed one at a time)
        self.graphs[(b, kinds)] = (graph, hidden)
        self.captures += 1

    # -- the step (captured on CUDA) ----------------------------------------------------------------
    def _forward(self, b: int, kinds: Kinds, lean: bool) -> torch.Tensor:
        ids, pos, slots = self.rows_t[0, :b], self.rows_t[1, :b], self.rows_t[2, :b]
        hidden = self.engine.forward(ids.view(b, 1), pos.view(b, 1), _StepBatch(self, b, kinds, lean))  # type: ignore[arg-type]
        cache = self.pool.cache  # the new entries' positions and the slots' lengths
        cache.pos[:, slots, :, pos] = pos.view(b, 1, 1)
        cache.lens[:, slots] = (pos + 1).view(1, b)
        return hidden

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, kinds: Kinds
               ) -> torch.Tensor:
        """One layer's decode attention of the bucket's rows: q [b, Hq, 1, D], k/v [b, Hkv, 1, D]."""
        cache = self.pool.cache
        pos, slots = self.rows_t[1, :b], self.rows_t[2, :b]
        cache.k[layer, slots, :, pos] = k[:, :, 0]
        cache.v[layer, slots, :, pos] = v[:, :, 0]
        q3 = q[:, :, 0].to(cache.k.dtype).contiguous()
        # dense rows: one launch over every pool slot, the slots of other rows (and free ones) skipped
        self.q_slots.index_copy_(0, slots, q3)
        kl, vl = cache.k[layer], cache.v[layer]
        out = decode_attention(self.q_slots, kl, vl, self.zeros, kl, vl, self.zeros, self.meta[1], self.meta[0],
                               self.engine.scaling).index_select(0, slots)
        for kind in kinds:  # each pooled form overwrites its own rows
            self.pool.forms[kind].attend(layer, q3, out)
        return out.to(q.dtype).unsqueeze(2)
