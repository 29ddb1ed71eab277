"""Length grouping (SkipKV, arXiv 2512.07993, Sec. 4.3): sequences of neighbouring prompt length
share a batch, so right-padding in prefill and ragged cache lengths in decode stay small.

Torch-free; every caller that forms batches by prompt length goes through here:

* `length_groups`: a list cut into batches. Items (of one key each, when `key` is given: one batch
  runs one policy variant) are sorted by length, stably, and cut into groups of at most `max_size`.
  The native engine (`NativeEngine.generate`) and the eval runner's local backend use it.
* `closest_in_length`: one group around an anchor: the anchor (the queue's oldest waiting job) plus
  up to `max_size - 1` others closest to it in length, ties to the shorter one, then to the earlier
  in `others`; with a token budget the group ends at the first neighbour that does not fit. The
  queue's claim (`queue.base.pick_group`; the Redis claim script is its twin in Lua, tested
  against it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")


def length_groups(items: Iterable[T], length: Callable[[T], int], max_size: int,
                  key: Callable[[T], Hashable] | None = None) -> list[list[T]]:
    """Batches of at most `max_size` items, each a run of neighbours in `length`. With `key`, items
    of different keys never share a batch; the keys come in the order they first appear. Items of
    equal length keep their input order."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    parts: dict[Hashable, list[T]] = {}
    for item in items:
        parts.setdefault(None if key is None else key(item), []).append(item)
    out: list[list[T]] = []
    for members in parts.values():
        order = sorted(members, key=length)
        out.extend(order[i : i + max_size] for i in range(0, len(order), max_size))
    return out


def closest_in_length(anchor: tuple[K, int], others: Sequence[tuple[K, int]], max_size: int,
                      budget: int | None = None, need: Callable[[K], int] | None = None) -> list[K]:
    """The anchor's id plus the ids of up to `max_size - 1` of `others` ((id, length) pairs) closest
    to the anchor's length: ties go to the shorter one, then to the earlier in `others`.

    With a `budget` (and `need`: id -> cost, the KV tokens a job may hold), the group also stops
    growing at the first neighbour, in that order, whose cost no longer fits in what the anchor and
    the neighbours taken so far leave of the budget; so the group stays a run of neighbouring
    lengths. The anchor is always taken, even when it alone exceeds the budget."""
    _, length = anchor
    ranked = sorted(others, key=lambda o: (abs(o[1] - length), o[1] > length, o[1]))
    picked = [anchor[0]]
    if budget is None or need is None:
        return picked + [oid for oid, _ in ranked[: max(0, max_size - 1)]]
    used = need(anchor[0])
    for oid, _ in ranked[: max(0, max_size - 1)]:
        cost = need(oid)
        if used + cost > budget:
            break
        picked.append(oid)
        used += cost
    return picked
