"""SFI's refresh kernels (kernels/sfi_refresh.py) against their torch twins, on random inputs: the
ring's rows as queries (scattered slots and ring indices), every layer through one launch, causal
masking by index, the re-pack of sinks and selection with (true) positions. On the CPU the Triton
kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import sfi_refresh as sr

pytestmark = pytest.mark.skipif(not sr.HAVE_TRITON, reason="triton not installed")


def _layers(gen, n_layers=4, nb=20, h=3, bs=16, d=32, dtype=torch.float32):
    """Each layer's cache its own allocation, in vLLM's [blocks, H, block, 2D] layout, viewed as
    [blocks, block, H, D] keys and values (as the vLLM backend views them)."""
    kvs = [torch.randn(nb, h, bs, 2 * d, generator=gen).to(dtype) for _ in range(n_layers)]
    keys, values = zip(*(kv.transpose(1, 2).split(d, dim=-1) for kv in kvs), strict=True)
    return list(keys), list(values)


def _ring(gen, n_layers=4, slots=3, w=8, hq=6, d=32, dtype=torch.float32):
    return torch.randn(n_layers, slots + 1, w, hq, d, generator=gen).to(dtype)


@pytest.mark.parametrize("l0,nl,causal", [(0, 4, True), (1, 2, False), (3, 1, True)])
def test_ring_logits_read_the_rings_rows_over_each_layer_in_one_launch(l0, nl, causal):
    """Layers l0 .. l0+nl-1 of separately allocated caches, read through the first layer's pointer and
    the offset table, with the query rows gathered from scattered slots and ring indices, match the
    torch twin; causal rows see nothing after their position."""
    gen = torch.Generator().manual_seed(10 + l0)
    keys, values = _layers(gen)
    ring = _ring(gen)
    n = 101
    slots = torch.tensor([2, 0], dtype=torch.int32)
    ridx = torch.tensor([5, 1, 7, 0, 3], dtype=torch.int32)  # ring indices, not in position order
    row_pos = torch.tensor([60, 56, 62, 55, 58], dtype=torch.int32)
    bt = torch.stack([torch.randperm(20, generator=gen)[:10] for _ in range(2)]).to(torch.int32)
    layers = sr.PagedLayers.of(keys, values)
    g, r = 2, 5
    out, norms = torch.empty(2, nl, 3, g * r, n), torch.empty(2, nl, 3, n)
    sr.ring_logits_layers(ring, slots, ridx, row_pos, 0.3, layers, l0, nl, bt, n, out, norms, causal, block_n=16)
    want, wnorm = sr.ring_logits_reference(ring, slots, ridx, row_pos, 0.3, keys[l0 : l0 + nl], l0, bt, n, causal)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), fin)
    assert torch.allclose(out[fin], want[fin], atol=1e-4) and torch.allclose(norms, wnorm, atol=1e-4)
    if causal:  # row g * R + 1 (position 56) sees entries 0..56 only
        assert fin[0, 0, 0, 1, 56] and not fin[0, 0, 0, 1, 57:].any() and fin[0, 0, 0, 2, :63].all()
    else:
        assert fin.all()
    # the twin itself: query head h * G + g of ring index ridx[r], scaled, against layer l0's keys
    q = ring[l0, 2, 7, 1 * g + 1] * 0.3
    k = keys[l0][bt[0, 40 // 16].long(), 40 % 16, 1]
    assert torch.allclose(want[0, 0, 1, 1 * r + 2, 40], q @ k, atol=1e-5)


def test_ring_logits_half_precision_match_the_twin():
    """In a half-precision dtype (float16: Triton's interpreter has no bfloat16) the rows are scaled
    in that dtype, as the twin scales them."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(4)
    keys, values = _layers(gen, dtype=dtype)
    ring = _ring(gen, dtype=dtype)
    slots, ridx = torch.tensor([1], dtype=torch.int32), torch.arange(8, dtype=torch.int32)
    row_pos = torch.arange(92, 100, dtype=torch.int32)
    bt = torch.randperm(20, generator=gen)[:10].view(1, -1).to(torch.int32)
    out, norms = torch.empty(1, 4, 3, 16, 100), torch.empty(1, 4, 3, 100)
    sr.ring_logits_layers(ring, slots, ridx, row_pos, 0.125, sr.PagedLayers.of(keys, values), 0, 4, bt, 100, out,
                          norms, True, block_n=32)
    want, wnorm = sr.ring_logits_reference(ring, slots, ridx, row_pos, 0.125, keys, 0, bt, 100, True)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), fin)
    assert torch.allclose(out[fin], want[fin], atol=1e-3, rtol=1e-3) and torch.allclose(norms, wnorm, rtol=1e-3)


@pytest.mark.parametrize("with_tpos", [False, True])
def test_pack_selection_copies_sinks_and_selection_with_positions(with_tpos):
    gen = torch.Generator().manual_seed(5 + with_tpos)
    keys, values = _layers(gen)
    j, h, d, bs, slots, c, ns, k = 2, 3, 32, 16, 3, 48, 4, 29
    bt = torch.stack([torch.randperm(20, generator=gen)[:8] for _ in range(j)]).to(torch.int32)
    keep = torch.stack([torch.stack([torch.stack([(ns + torch.randperm(8 * bs - ns, generator=gen)[:k]).sort().values
                                                  for _ in range(h)]) for _ in range(4)]) for _ in range(j)])
    tpos = (torch.arange(8 * bs) * 3 + 7).expand(4, h, -1).contiguous() if with_tpos else None
    sl = torch.tensor([2, 0], dtype=torch.int32)
    want = [torch.zeros(4, slots, h, c, d), torch.zeros(4, slots, h, c, d),
            torch.full((4, slots, h, c), 5, dtype=torch.int32)]
    got = [t.clone() for t in want]
    count_got, count_want = torch.full((slots,), 3, dtype=torch.int32), torch.full((slots,), 3, dtype=torch.int32)
    sr.pack_selection_layers(keep, ns, tpos, bt, sr.PagedLayers.of(keys, values), *got, sl, block=16, ccount=count_got)
    sr.pack_selection_reference(keep, ns, tpos, bt, keys, values, *want, sl, ccount=count_want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the entries in use, sinks + k, at the two slots packed; slot 1 untouched
    assert count_got.tolist() == count_want.tolist() == [ns + k, 3, ns + k]
    ck, _, cpos = want
    m = ns + k
    # entry 0 is a sink (position 0), entry ns the first kept one, -1 after them; slot 1 untouched
    first = 7 if with_tpos else 0
    assert int(cpos[1, 2, 0, 0]) == first and torch.all(cpos[:, 2, :, m:] == -1) and torch.all(cpos[:, 1] == 5)
    kept = int(keep[0, 1, 0, 0])
    assert int(cpos[1, 2, 0, ns]) == (kept * 3 + 7 if with_tpos else kept)
    assert torch.equal(ck[1, 2, 0, ns], keys[1][bt[0, kept // bs].long(), kept % bs, 0])
    assert not torch.equal(ck[0, 2], ck[1, 2]) and torch.all(ck[:, 1] == 0)


def test_pack_of_nothing_marks_the_slot_empty_and_copies_nothing():
    """What the admission's warm-up launches: no entry copied, the slot's positions all -1."""
    gen = torch.Generator().manual_seed(8)
    keys, values = _layers(gen)
    ck, cv = torch.full((4, 2, 3, 16, 32), 2.0), torch.full((4, 2, 3, 16, 32), 2.0)
    cpos = torch.full((4, 2, 3, 16), 9, dtype=torch.int32)
    keep = torch.zeros(1, 4, 3, 16, dtype=torch.long)[..., :0]
    count = torch.tensor([7, 7], dtype=torch.int32)
    sr.pack_selection_layers(keep, 0, None, torch.zeros(1, 1, dtype=torch.int32), sr.PagedLayers.of(keys, values),
                             ck, cv, cpos, torch.tensor([1], dtype=torch.int32), block=16, ccount=count)
    assert torch.all(cpos[:, 1] == -1) and torch.all(cpos[:, 0] == 9) and count.tolist() == [7, 0]
    assert torch.all(ck == 2.0) and torch.all(cv == 2.0)


def test_pack_refuses_a_selection_larger_than_the_compact_buffer():
    gen = torch.Generator().manual_seed(9)
    keys, values = _layers(gen)
    ck = cv = torch.zeros(4, 2, 3, 16, 32)
    cpos = torch.full((4, 2, 3, 16), -1, dtype=torch.int32)
    keep = torch.arange(4, 17).expand(1, 4, 3, 13).contiguous()
    with pytest.raises(ValueError, match="do not fit"):
        sr.pack_selection_layers(keep, 4, None, torch.zeros(1, 2, dtype=torch.int32), sr.PagedLayers.of(keys, values),
                                 ck, cv, cpos, torch.tensor([0], dtype=torch.int32))
    assert torch.all(cpos == -1)


def test_layer_offsets_refuse_layers_that_differ():
    gen = torch.Generator().manual_seed(1)
    keys, _ = _layers(gen)
    assert sr.layer_offsets(keys)[0] == 0 and len(set(sr.layer_offsets(keys))) == 4
    with pytest.raises(ValueError, match="uniform"):
        sr.layer_offsets([keys[0], keys[1][:10]])
    with pytest.raises(ValueError, match="uniform"):
        sr.layer_offsets([keys[0], keys[1].to(torch.float16)])


def test_layer_offsets_refuse_layers_less_than_16_elements_apart():
    """The kernels promise the compiler 16-element alignment of each layer's offset (vectorized loads)."""
    base = torch.zeros(4 * 64 + 8)
    a, b = base[:64].view(4, 16), base[72 : 72 + 64].view(4, 16)
    with pytest.raises(ValueError, match="16 elements"):
        sr.layer_offsets([a, b])
    assert sr.layer_offsets([a, base[64:128].view(4, 16)]) == [0, 64]
