"""Length grouping (`cotserve.grouping`): batches of neighbours in length, and the queue's group
around its oldest job. Torch-free."""

from __future__ import annotations

import random

import pytest

from cotserve.grouping import closest_in_length, length_groups


def test_length_groups_sorts_and_cuts_into_batches_of_at_most_n():
    items = [("a", 7), ("b", 2), ("c", 9), ("d", 2), ("e", 5), ("f", 1), ("g", 7)]
    groups = length_groups(items, lambda it: it[1], 3)
    assert [[name for name, _ in g] for g in groups] == [["f", "b", "d"], ["e", "a", "g"], ["c"]]
    assert length_groups([], len, 4) == []
    with pytest.raises(ValueError):
        length_groups(items, lambda it: it[1], 0)


def test_length_groups_never_mixes_keys_and_keeps_key_order():
    items = [("x", 5, "p"), ("y", 1, "q"), ("z", 3, "p"), ("w", 2, "q"), ("v", 4, "p")]
    groups = length_groups(items, lambda it: it[1], 2, key=lambda it: it[2])
    assert [[name for name, *_ in g] for g in groups] == [["z", "v"], ["x"], ["y", "w"]]


@pytest.mark.parametrize("seed", range(5))
def test_length_groups_random_inputs_keep_every_item_once_in_length_order(seed):
    rng = random.Random(seed)
    items = [(i, rng.randint(1, 20), rng.choice("ab")) for i in range(rng.randint(1, 40))]
    n = rng.randint(1, 6)
    groups = length_groups(items, lambda it: it[1], n, key=lambda it: it[2])
    assert sorted(it for g in groups for it in g) == sorted(items)
    for key in "ab":
        flat = [it for g in groups for it in g if it[2] == key]
        assert flat == sorted((it for it in items if it[2] == key), key=lambda it: it[1])  # stable
    for g in groups:
        assert 1 <= len(g) <= n and len({it[2] for it in g}) == 1
    # only the last batch of a key may be short
    for key in "ab":
        sizes = [len(g) for g in groups if g[0][2] == key]
        assert all(s == n for s in sizes[:-1])


def test_closest_in_length_takes_the_anchor_then_its_neighbours():
    others = [("a", 3), ("b", 14), ("c", 9), ("d", 30), ("e", 11), ("f", 9)]
    assert closest_in_length(("o", 10), others, 4) == ["o", "c", "f", "e"]  # 9, 9 (tie: earlier), 11
    assert closest_in_length(("o", 10), others, 1) == ["o"]
    assert closest_in_length(("o", 10), [], 3) == ["o"]
    assert closest_in_length(("o", 10), others, 99)[-1] == "d"  # everything, farthest last
    assert closest_in_length(("o", 10), [("long", 12), ("short", 8)], 2) == ["o", "short"]


def test_closest_in_length_with_a_budget_ends_at_the_first_neighbour_that_does_not_fit():
    others = [("a", 9), ("b", 11), ("c", 8)]
    cost = {"o": 10, "a": 9, "b": 30, "c": 8}.__getitem__
    assert closest_in_length(("o", 10), others, 9, budget=40, need=cost) == ["o", "a"]  # b (30) ends it
    assert closest_in_length(("o", 10), others, 9, budget=100, need=cost) == ["o", "a", "b", "c"]
    assert closest_in_length(("o", 10), others, 9, budget=1, need=cost) == ["o"]  # the anchor always
