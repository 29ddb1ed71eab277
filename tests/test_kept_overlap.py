"""tools/kept_overlap.py: the share of kept entries two engines have in common, per layer and KV head."""

from __future__ import annotations


def test_overlap_is_the_mean_and_smallest_shared_share_over_heads(load_tool):
    overlap = load_tool("kept_overlap").overlap
    same = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert overlap(same, same) == (1.0, 1.0)
    other = [[[0, 1, 2, 3], [4, 5, 8, 9]], [[6, 4, 2, 0], [1, 3, 5, 7]]]  # order does not matter
    assert overlap(same, other) == (0.875, 0.5)
