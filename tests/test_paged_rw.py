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


def test_cpu_paged_write_front_in_a_permuted_layout():
    perm = torch.randperm(BS * D, generator=torch.Generator().manual_seed(1))  # any order of a block's entries
    cache = torch.randn(NB, H, BS, 2 * D)
    _check(CPUPagedKV(BS, (perm, perm.flip(0))), cache)


def _isa_works(isa: str, dtype: torch.dtype, bs: int) -> bool:
    from cotserve.vllm.compat import cpu_reshape_and_cache

    cache = torch.zeros(2, 1, 2 * bs, 64, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    x = torch.zeros(1, 1, 64, dtype=dtype)
    try:
        cpu_reshape_and_cache(x, x, kc, vc, torch.tensor([0]), isa)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)])
def test_the_detected_layout_reads_what_vllms_op_wrote(isa, dtype):
    pytest.importorskip("vllm")
    from cotserve.vllm.compat import cpu_reshape_and_cache
    from cotserve.vllm.cpu_paged import key_layout

    bs, h, d, nb = 32, 2, 64, 6
    if not _isa_works(isa, dtype, bs):
        pytest.skip(f"vLLM's CPU op has no {isa} path on this machine")
    layout = key_layout(isa, dtype, d, bs)
    assert "unknown" not in [x for x in layout if isinstance(x, str)], layout
    rw = CPUPagedKV(bs, layout)
    cache = torch.zeros(nb, h, 2 * bs, d, dtype=dtype)
    kc, vc = cache.view(nb, h, 2, bs, d)[:, :, 0], cache.view(nb, h, 2, bs, d)[:, :, 1]
    blocks = torch.tensor([4, 1, 5])
    n = 2 * bs + 7
    slots = torch.cat([torch.arange(bs) + b * bs for b in blocks.tolist()])[:n]
    k, v = torch.randn(n, h, d).to(dtype), torch.randn(n, h, d).to(dtype)
    cpu_reshape_and_cache(k, v, kc, vc, slots, isa)
    k1, v1 = rw.read(cache, blocks, 0, n)
    assert torch.equal(k1, k.transpose(0, 1)) and torch.equal(v1, v.transpose(0, 1))
    # written back through the reader, vLLM's layout is kept: the same bytes as the op's
    k2, v2 = k1.flip(1).contiguous(), v1.flip(1).contiguous()
    rw.write_front(cache, blocks, k2, v2)
    want = torch.zeros_like(cache)
    wk, wv = want.view(nb, h, 2, bs, d)[:, :, 0], want.view(nb, h, 2, bs, d)[:, :, 1]
    cpu_reshape_and_cache(k2.transpose(0, 1).contiguous(), v2.transpose(0, 1).contiguous(), wk, wv, slots, isa)
    assert torch.equal(cache[blocks], want[blocks])
