"""The eviction runtime's writes into vLLM's paged caches (CPU layouts and FlashAttention's): a
compaction's entries land at a request's first physical slots, read back exactly, and nothing
else changes (other blocks, the rest of the last block written)."""

from __future__ import annotations

import pytest
import torch

from cotserve.vllm.cpu_paged import CPUPagedKV
from cotserve.vllm.flash_paged import FlashPagedKV

BS, H, D, NB = 16, 3, 8, 12


def _check(rw, cache: torch.Tensor) -> None:
    blocks = torch.tensor([7, 2, 9, 4, 0])
    before = cache.clone()
    n = 4 * BS + 5
    k0, v0 = (x.clone() for x in rw.read(cache, blocks, 0, n))
    m = 2 * BS + 3  # the kept entries: a permutation of some of the old ones, as a compaction makes
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:m].sort().values
    rw.write_front(cache, blocks, k0[:, keep], v0[:, keep])
    k1, v1 = rw.read(cache, blocks, 0, n)
    assert torch.equal(k1[:, :m], k0[:, keep]) and torch.equal(v1[:, :m], v0[:, keep])
    # the rest of the last block written keeps its contents; later blocks and other requests' are untouched
    assert torch.equal(k1[:, m:], k0[:, m:]) and torch.equal(v1[:, m:], v0[:, m:])
    others = [b for b in range(NB) if b not in blocks[:3].tolist()]
    assert torch.equal(cache[others], before[others])


@pytest.mark.parametrize("layout", [("plain", "plain"), ("transposed", "plain"), ("transposed", "transposed")])
def test_cpu_paged_write_front(layout):
    cache = torch.randn(NB, H, BS, 2 * D)  # vLLM's CPU cache: [blocks, H, block, 2 D]
    _check(CPUPagedKV(BS, layout), cache)


def test_flash_paged_write_front():
    cache = torch.randn(NB, BS, H, 2 * D).transpose(1, 2)  # FlashAttention's [blocks, H, block, 2 D], NHD in memory
    _check(FlashPagedKV(BS, D), cache)


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_many_requests_at_once_equal_one_by_one(kind):
    if kind == "cpu":
        rw, cache = CPUPagedKV(BS, ("transposed", "plain")), torch.randn(NB, H, BS, 2 * D)
    else:
        rw, cache = FlashPagedKV(BS, D), torch.randn(NB, BS, H, 2 * D).transpose(1, 2)
    blocks = torch.tensor([[7, 2, 9], [4, 0, 11]])
    n, m = 2 * BS + 9, BS + 5
    k, v = rw.read_many(cache, blocks, n)
    for r in range(2):
        k1, v1 = rw.read(cache, blocks[r], 0, n)
        assert torch.equal(k[r], k1) and torch.equal(v[r], v1)
    one = cache.clone()
    for r in range(2):
        rw.write_front(one, blocks[r], k[r, :, -m:], v[r, :, -m:])
    rw.write_front_many(cache, blocks, k[:, :, -m:].contiguous(), v[:, :, -m:].contiguous())
    assert torch.equal(cache, one)
