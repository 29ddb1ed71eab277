"""H2O's paged accumulation kernel (kernels/h2o_paged.py) against its torch reference, and the
reference against the native policy's decode step, on random inputs: scattered blocks, lengths
crossing blocks, sum and max group reductions, rows of mode 0 left untouched. On the CPU the
Triton kernel runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels import h2o_paged as hp
from cotserve.policies.attention_parts import decode_probs

pytestmark = pytest.mark.skipif(not hp.HAVE_TRITON, reason="triton not installed")


def _case(seed: int, hkv=2, g=3, d=32, bs=16, slots=4, max_len=100, nblocks=24):
    gen = torch.Generator().manual_seed(seed)
    rows = 4
    q = torch.randn(rows + 2, hkv * g, d, generator=gen)
    kc = torch.randn(nblocks, bs, hkv, d, generator=gen)
    bt = torch.stack([torch.randperm(nblocks, generator=gen)[:6] for _ in range(rows)]).to(torch.int32)
    lens = torch.randint(1, max_len, (rows,), generator=gen).to(torch.int32)
    mode = torch.tensor([hp.SUM, 0, hp.MAX, hp.SUM], dtype=torch.int32)
    slot = torch.tensor([2, 0, 0, 1], dtype=torch.int32)
    tok = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    acc = torch.rand(slots, hkv, max_len, generator=gen)
    return q, kc, bt, mode, slot, tok, lens, acc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference(seed):
    q, kc, bt, mode, slot, tok, lens, acc = _case(seed)
    ref = hp.h2o_paged_accumulate_reference(q, kc, bt, mode, slot, tok, lens, acc.clone(), 0.3)
    out = hp.h2o_paged_accumulate(q, kc, bt, mode, slot, tok, lens, acc.clone(), 0.3, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], acc[3])  # no flagged row owns slot 3: untouched
    for row in (0, 2, 3):  # flagged rows: exactly their first row_len entries changed
        s, n = int(slot[row]), int(lens[row])
        assert torch.all(out[s, :, :n] > acc[s, :, :n]) and torch.equal(out[s, :, n:], acc[s, :, n:])


def test_kernel_on_a_strided_cache_view():
    """vLLM's FlashAttention cache is [blocks, H, block, 2 D]; the kernel reads its K half as a view."""
    q, kc, bt, mode, slot, tok, lens, acc = _case(4)
    kv = torch.cat([kc, torch.randn_like(kc)], -1).transpose(1, 2).contiguous()  # [blocks, H, block, 2 D]
    view = kv.transpose(1, 2)[..., : kc.shape[-1]]
    out = hp.h2o_paged_accumulate(q, view, bt, mode, slot, tok, lens, acc.clone(), 0.3, block_n=32)
    ref = hp.h2o_paged_accumulate_reference(q, kc, bt, mode, slot, tok, lens, acc.clone(), 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["sum", "max"])
def test_reference_is_the_native_decode_step(how):
    """One row: the reference adds what the native h2o adds in a decode step (`decode_probs` over the
    cache, the group's sum or max)."""
    q, kc, bt, _, _, _, _, _ = _case(7)
    n, bs = 70, kc.shape[1]
    pos = torch.arange(n)
    keys = kc[bt[0, pos // bs].long(), pos % bs].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, n, D]
    probs = decode_probs(q[1].view(1, -1, 1, q.shape[-1]), keys, torch.ones(1, n, dtype=torch.bool), 0.3)
    want = probs.sum(2) if how == "sum" else probs.amax(2)  # [1, Hkv, n]
    mode = torch.tensor([hp.SUM if how == "sum" else hp.MAX], dtype=torch.int32)
    acc = torch.zeros(1, kc.shape[2], 80)
    hp.h2o_paged_accumulate_reference(q, kc, bt[:1], mode, torch.tensor([0]), torch.tensor([1]), torch.tensor([n]),
                                      acc, 0.3)
    torch.testing.assert_close(acc[:, :, :n], want, atol=1e-6, rtol=1e-5)
    assert torch.all(acc[:, :, n:] == 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_in_a_cuda_graph_follows_its_row_tensors():
    """Captured once, replayed after the row tensors change (as the metadata builder changes them
    between steps): each replay adds what the reference adds for the rows as they are then. bf16
    keys (the cache dtype on CUDA), float32 scores."""
    dev = torch.device("cuda")
    q, kc, bt, mode, slot, tok, lens, acc = (t.to(dev) for t in _case(9, hkv=8, g=4, d=128, max_len=96))
    q, kc = q.to(torch.bfloat16), kc.to(torch.bfloat16)
    slot = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=dev)  # one row a slot, as in the runtime
    rows = torch.stack([mode, slot, tok, lens.clamp(max=90)])  # persistent, as the runtime's (room to grow)
    r_mode, r_slot, r_tok, r_len = rows
    live = acc.clone()
    hp.h2o_paged_accumulate(q, kc, bt, r_mode, r_slot, r_tok, r_len, live.clone(), 0.1)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hp.h2o_paged_accumulate(q, kc, bt, r_mode, r_slot, r_tok, r_len, live, 0.1)
    live.copy_(acc)
    for _ in range(3):
        want = hp.h2o_paged_accumulate_reference(q.float(), kc.float(), bt, r_mode, r_slot, r_tok, r_len,
                                                 live.clone(), 0.1)
        graph.replay()
        torch.testing.assert_close(live, want, atol=2e-2, rtol=2e-2)
        r_mode.copy_(torch.roll(r_mode, 1))  # the next step's rows: other modes, lengths grown by one
        r_len.add_(1)
