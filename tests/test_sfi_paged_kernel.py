"""SFI's paged fast-step kernel (kernels/sfi_paged.py) against its torch reference, on random
inputs: scattered blocks, windows crossing blocks, compact entries masked by the window, rows of
other modes left untouched. On the CPU the Triton kernel runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import sfi_paged as sp

pytestmark = pytest.mark.skipif(not sp.HAVE_TRITON, reason="triton not installed")


def _case(seed: int, dtype=torch.float32, hkv=2, g=3, d=32, c=40, bs=16, rows=4, slots=3, nblocks=24):
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * g
    tokens = rows + 2
    q = torch.randn(tokens, hq, d, generator=gen).to(dtype)
    ck = torch.randn(slots, hkv, c, d, generator=gen).to(dtype)
    cv = torch.randn(slots, hkv, c, d, generator=gen).to(dtype)
    kc = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=gen).to(dtype)
    maxb = 6
    bt = torch.stack([torch.randperm(nblocks, generator=gen)[:maxb] for _ in range(rows)]).to(torch.int32)
    lens = torch.randint(20, maxb * bs, (rows,), generator=gen)
    ws = torch.clamp(lens - torch.randint(1, 40, (rows,), generator=gen), min=0)
    cpos = torch.randint(-1, int(lens.max()), (slots, hkv, c), generator=gen)
    mode = torch.tensor([1, 0, 1, 3][:rows], dtype=torch.int32)
    slot = torch.tensor([2, 0, 0, 1][:rows], dtype=torch.int32)
    tok = torch.tensor([0, 2, 3, 5][:rows], dtype=torch.int32)
    return (q, ck, cv, cpos.to(torch.int32), kc, vc, bt, mode, slot, tok, ws.to(torch.int32), lens.to(torch.int32))


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference(seed, splits):
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = _case(seed)
    poison = torch.full_like(q, 7.0)
    ref = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3)
    out = sp.sfi_paged_fast(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3, block_n=16,
                            splits=splits)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    fast_toks = [int(t) for t, m in zip(tok, mode, strict=True) if int(m) == 1]
    untouched = [t for t in range(q.shape[0]) if t not in fast_toks]
    assert torch.all(out[untouched] == 7.0)  # only fast rows are written
    assert not torch.any(out[fast_toks] == 7.0)


def _kernel_and_reference(case, splits: int, **given):
    """The Triton kernel's output and the reference's on `case`, both over a poisoned output, with the
    same extra arguments (`row_cws`, `ccount`)."""
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = case
    poison = torch.full_like(q, 7.0)
    ref = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3,
                                      **given)
    out = sp.sfi_paged_fast(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3, block_n=16,
                            splits=splits, **given)
    return out, ref


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_reads_no_compact_entry_past_the_slots_count(splits):
    """`ccount` bounds each slot's compact entries: those at or past it are not read even where their
    positions say valid; the kernel agrees with the reference, a count of C is the plain form, and a
    smaller one changes what is read."""
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = _case(6)
    mode = torch.tensor([1, 0, 1, 1], dtype=torch.int32)  # fast rows on slots 2, 0 and 1
    c = ck.shape[2]
    cpos = torch.randint(0, 8, cpos.shape, generator=torch.Generator().manual_seed(1)).to(torch.int32)  # all valid
    count = torch.tensor([c, 5, 23], dtype=torch.int32)  # slot 0 whole; 1 cut inside its first block, 2 later
    out, ref = _kernel_and_reference((q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens), splits, ccount=count)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    poison = torch.full_like(q, 7.0)
    plain = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3)
    full = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3,
                                       ccount=torch.full_like(count, c))
    assert torch.equal(full, plain)
    fast = [int(t) for t, m in zip(tok, mode, strict=True) if int(m) == 1]
    cut = [int(t) for t, m, s in zip(tok, mode, slot, strict=True) if int(m) == 1 and int(count[int(s)]) < c]
    assert len(cut) == 2
    for t in cut:  # each cut slot's row reads fewer entries
        assert not torch.allclose(ref[t], plain[t], atol=1e-3)
    whole = [t for t in fast if t not in cut]
    assert torch.allclose(out[whole], plain[whole], atol=1e-4, rtol=1e-4)


def test_ring_write_reference():
    """The twin the fused writes are tested against: rows of a strided q (vLLM's is a view into the
    fused qkv) land in their (slot, index); tokens past the end are clamped to the last."""
    gen = torch.Generator().manual_seed(3)
    t, hq, d, slots, w = 5, 4, 8, 3, 6
    q = torch.randn(t, hq * d + 2 * d, generator=gen)[:, : hq * d].view(t, hq, d)
    ring = torch.zeros(slots + 1, w, hq, d)
    sp.ring_write_reference(q, ring, torch.tensor([0, 4, 9]), torch.tensor([1, 0, 2]), torch.tensor([5, 0, 2]))
    assert torch.equal(ring[1, 5], q[0]) and torch.equal(ring[0, 0], q[4]) and torch.equal(ring[2, 2], q[4])
    assert int((ring.abs().sum((-1, -2)) > 0).sum()) == 3


@pytest.mark.parametrize("splits,strided_ring", [(1, False), (2, False), (1, True)])
def test_kernel_does_the_steps_ring_writes_in_the_same_launch(splits, strided_ring):
    """With `ring`, the fast-step launch also does the step's ring writes, spread over its programs:
    more writes than programs, from a strided q (vLLM's is a view into the fused qkv), into a ring
    whose heads may lie apart, tokens past the end clamped, scratch-slot writes skipped; the ring
    ends as `ring_write_reference` leaves it and the attention output is unchanged."""
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = _case(3)
    t, hq, d = q.shape
    qkv = torch.cat([q.reshape(t, hq * d), torch.randn(t, 2 * d)], dim=1)
    qv = qkv[:, : hq * d].view(t, hq, d)
    slots, w = 3, 5
    nw = 23  # more writes than the launch's 4 x 2 (x splits) programs
    gen = torch.Generator().manual_seed(4)
    w_tok = torch.randint(0, t + 3, (nw,), generator=gen)
    w_slot = torch.randint(0, slots + 1, (nw,), generator=gen)
    w_idx = torch.randperm(nw, generator=gen) % w
    pairs = set()
    for i in range(nw):  # one write per (slot, index), as a step makes them (their order is the launch's own)
        key = (int(w_slot[i]), int(w_idx[i]))
        if key in pairs:
            w_slot[i] = slots
        pairs.add(key)
    assert int((w_slot < slots).sum()) >= 10 and int((w_slot == slots).sum()) >= 1
    want = torch.zeros(slots + 1, w, hq, d)
    sp.ring_write_reference(qv, want, w_tok, w_slot, w_idx)
    got = torch.zeros(slots + 1, w, hq, d + 8)[..., :d] if strided_ring else torch.zeros(slots + 1, w, hq, d)
    poison = torch.full_like(q, 7.0)
    out = sp.sfi_paged_fast(qv, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3, block_n=16,
                            splits=splits, ring=(got, w_tok, w_slot, w_idx))
    plain = sp.sfi_paged_fast(qv, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3,
                              block_n=16, splits=splits)
    assert torch.equal(got[:slots], want[:slots]) and torch.all(got[slots] == 0)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_per_head_cutoff_matches_reference(splits):
    """A compacted request's cutoff differs per KV head (true positions): each head reads exactly the
    compact entries older than its own cutoff, and the kernel agrees with the reference."""
    case = _case(5)
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = case
    gen = torch.Generator().manual_seed(9)
    cws = torch.randint(0, int(lens.max()), (mode.shape[0], ck.shape[1]), generator=gen).to(torch.int32)
    out, ref = _kernel_and_reference(case, splits, row_cws=cws)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    poison = torch.full_like(q, 7.0)
    same = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3,
                                       row_cws=ws.view(-1, 1).expand(-1, ck.shape[1]).contiguous())
    plain = sp.sfi_paged_fast_reference(q, poison.clone(), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3)
    assert torch.equal(same, plain)  # the window start as every head's cutoff is the plain form
    assert not torch.allclose(ref, plain, atol=1e-3)  # and the per-head cutoffs change what is read


def test_reference_is_attention_over_the_union():
    """The reference equals plain softmax attention over (compact entries before the window) U window."""
    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = _case(5)
    out = sp.sfi_paged_fast_reference(q, torch.zeros_like(q), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 1.0)
    row = 0
    s, t, w, n = int(slot[row]), int(tok[row]), int(ws[row]), int(lens[row])
    bs = kc.shape[1]
    h, g = 1, q.shape[1] // ck.shape[1]
    keys = [ck[s, h, i] for i in range(ck.shape[2]) if 0 <= int(cpos[s, h, i]) < w]
    vals = [cv[s, h, i] for i in range(ck.shape[2]) if 0 <= int(cpos[s, h, i]) < w]
    for p in range(w, n):
        b = int(bt[row, p // bs])
        keys.append(kc[b, p % bs, h])
        vals.append(vc[b, p % bs, h])
    k, v = torch.stack(keys), torch.stack(vals)
    for j in range(g):
        qh = q[t, h * g + j]
        want = torch.softmax(k @ qh, -1) @ v
        assert torch.allclose(out[t, h * g + j], want, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_cuda_bf16():
    """Real shapes on the GPU (Qwen3-4B heads, vLLM's 16-entry blocks), bf16 in, float32 reference."""
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(11)
    rows, slots, hkv, g, d, c, bs, nblocks = 8, 8, 8, 4, 128, 2112, 16, 4096
    q = torch.randn(rows, hkv * g, d, generator=gen).to(dev, torch.bfloat16)
    ck = torch.randn(slots, hkv, c, d, generator=gen).to(dev, torch.bfloat16)
    cv = torch.randn(slots, hkv, c, d, generator=gen).to(dev, torch.bfloat16)
    kv = torch.randn(nblocks, hkv, bs, 2 * d, generator=gen).to(dev, torch.bfloat16)  # vLLM's [B, H, N, 2D]
    kc, vc = kv.transpose(1, 2).split(d, dim=-1)
    maxb = 400
    bt = torch.stack([torch.randperm(nblocks, generator=gen)[:maxb] for _ in range(rows)]).to(dev, torch.int32)
    lens = torch.randint(3000, maxb * bs, (rows,), generator=gen)
    ws = lens - 256
    cpos = torch.randint(-1, 3000, (slots, hkv, c), generator=gen)
    mode = torch.tensor([1, 1, 0, 1, 2, 1, 1, 1], dtype=torch.int32)
    slot = torch.randperm(slots, generator=gen).to(torch.int32)
    tok = torch.arange(rows, dtype=torch.int32)
    args = [t.to(dev) for t in (cpos.to(torch.int32),)]
    ref = sp.sfi_paged_fast_reference(q, torch.zeros_like(q), ck, cv, args[0], kc, vc, bt, mode, slot, tok,
                                      ws.to(torch.int32), lens.to(torch.int32), 0.088)
    out = sp.sfi_paged_fast(q, torch.zeros_like(q), ck, cv, args[0], kc, vc, bt, mode.to(dev), slot.to(dev),
                            tok.to(dev), ws.to(dev, torch.int32), lens.to(dev, torch.int32), 0.088)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, err
    cws = torch.randint(0, 3000, (rows, hkv), generator=gen).to(torch.int32)  # a compacted request's cutoffs
    ref = sp.sfi_paged_fast_reference(q, torch.zeros_like(q), ck, cv, args[0], kc, vc, bt, mode, slot, tok,
                                      ws.to(torch.int32), lens.to(torch.int32), 0.088, row_cws=cws)
    for splits in (None, 1):
        out = sp.sfi_paged_fast(q, torch.zeros_like(q), ck, cv, args[0], kc, vc, bt, mode.to(dev), slot.to(dev),
                                tok.to(dev), ws.to(dev, torch.int32), lens.to(dev, torch.int32), 0.088,
                                splits=splits, row_cws=cws.to(dev))
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, err
