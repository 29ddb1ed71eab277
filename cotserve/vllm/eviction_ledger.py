"""When an evicting request compacts, and which of its KV blocks go back to vLLM's pool.

Both halves of vLLM keep one `EvictionLedger` per evicting request and feed it the same facts
(the request's logical KV length before a step and the step's token count), so they agree
without talking to each other:

* the scheduler (`scheduler.EvictingScheduler`) nulls the freed entries of the request's block
  list and returns those blocks to the pool, where the next `schedule()` can hand them to any
  request;
* the worker (`evict_runtime.EvictRuntime`) compacts the kept entries into the first physical
  slots and reads and writes the request through its live blocks only.

Rules. The request's prefill is its first `prefill_len` tokens (the prompt; after a preemption,
prompt plus the output so far). Decode step `s` (0 = the first sampled token's forward) is the
step whose KV length before it is `prefill_len + s`. A compaction is due before step `s` when the
native policy's own threshold says so after the previous forward (`Policy.threshold` with
mode "prefill" for s = 0, else mode "decode" and step s - 1) and the request holds more entries
than that threshold; it keeps `budget` entries per layer and KV head. With `evicted` entries
gone in all, the block list (logical, `ceil(len / block_size)` entries, as vLLM allocates it)
holds `evicted // block_size` holes (null blocks): each compaction turns the last live entries
into holes. The live entries always cover the physical length (proof in the docstring of
`live_blocks_cover`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class EvictionLedger:
    """One evicting request's compaction schedule and block holes (see the module docstring)."""

    policy: Any  # a native eviction policy (`cotserve.policies.eviction.ScoredEviction`)
    prefill_len: int
    evicted: int = 0  # entries gone, per layer and KV head
    holes: list[int] = field(default_factory=list)  # block-list indices nulled, ascending
    compactions: int = 0
    peak: int = 0  # most entries held after a step's write, before a compaction
    _live: tuple[int, int, list[int]] | None = field(default=None, repr=False)  # (holes, entries, live indices)

    def after_step(self, logical_after: int) -> None:
        self.peak = max(self.peak, self.physical(logical_after))

    def physical(self, logical_len: int) -> int:
        return logical_len - self.evicted

    def due(self, logical_before: int, ntok: int) -> bool:
        """Is a compaction due before the step that starts at `logical_before` entries?"""
        s = logical_before - self.prefill_len
        if ntok != 1 or s < 0:
            return False
        view = SimpleNamespace(mode="prefill", step=0) if s == 0 else SimpleNamespace(mode="decode", step=s - 1)
        limit = self.policy.threshold(view)
        return limit is not None and self.physical(logical_before) > limit

    def compact(self, logical_before: int, ntok: int, block_size: int) -> list[int]:
        """Record a compaction before this step; return the block-list indices that become holes
        (the list then holds `ceil((logical_before + ntok) / block_size)` entries)."""
        self.evicted = logical_before - self.policy.budget
        self.compactions += 1
        want = self.evicted // block_size
        n = cdiv(logical_before + ntok, block_size)
        have = set(self.holes)
        live = [i for i in range(n) if i not in have]
        new = live[len(live) - (want - len(self.holes)):] if want > len(self.holes) else []
        self.holes = sorted(have.union(new))
        return new

    def live_blocks(self, n_entries: int) -> list[int]:
        """Block-list indices that hold the request's entries, in physical order, for a list of
        `n_entries` entries (kept from call to call: holes change only at a compaction, and indices
        past the last hole are live)."""
        cache = self._live
        if cache is None or cache[0] != len(self.holes) or cache[1] > n_entries:
            have = set(self.holes)
            self._live = cache = (len(self.holes), n_entries, [i for i in range(n_entries) if i not in have])
        elif cache[1] < n_entries:
            cache[2].extend(range(cache[1], n_entries))
            self._live = cache = (cache[0], n_entries, cache[2])
        return cache[2]


def live_blocks_cover(logical_len: int, evicted: int, block_size: int) -> bool:
    """The invariant: ceil(L / b) - floor(E / b) >= ceil((L - E) / b) for L >= E >= 0. With
    E = a b + r (0 <= r < b): ceil((L - E) / b) = ceil((L - r) / b) - a <= ceil(L / b) - a."""
    return cdiv(logical_len, block_size) - evicted // block_size >= cdiv(logical_len - evicted, block_size)
