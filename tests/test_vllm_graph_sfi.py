"""The CUDA backend's graph-safe SFI runtime (`cotserve.vllm.graph_sfi`) against the eager runtime
that the CPU backend uses (`cotserve.vllm.sfi_runtime`, built from the native policy's functions).

Runs on the CPU with tensors in vLLM 0.26's FlashAttention cache layout ([blocks, H, block, 2 D]):
the batched refresh (several requests at once) must select and pack exactly what the per-request
eager refresh selects, and the paged fast step must equal the eager fast step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cotserve.kernels.sfi_paged import sfi_paged_fast_reference
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger
from cotserve.vllm.graph_sfi import GraphSFI, SlotState
from cotserve.vllm.requests import BatchRows
from cotserve.vllm.sfi_runtime import FAST, RowPlan, SeqState, SFIRuntime

L, HQ, HKV, D, BS, NB = 3, 6, 2, 16, 16, 64


class FlashPaged:
    """`PagedKV` over the FlashAttention layout, for the eager runtime."""

    def read(self, kv_cache, blocks, start, end):
        k, v = kv_cache.transpose(1, 2).split(D, dim=-1)  # [blocks, block, H, D]
        pos = torch.arange(start, end)
        b = blocks[pos // BS].long()
        return k[b, pos % BS].transpose(0, 1), v[b, pos % BS].transpose(0, 1)


@pytest.fixture()
def setup():
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(NB, HKV, BS, 2 * D, generator=gen) for _ in range(L)]
    layers = [SimpleNamespace(kv_cache=c) for c in caches]
    cfg = SFIConfig(k=24, recent=16, sinks=4, obs_window=8, dense_heads=0)
    g = GraphSFI(layers, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"), slots=4, max_rows=8, max_k=32,
                 rows=BatchRows())
    return gen, caches, cfg, g


def test_batched_refresh_equals_eager_selection(setup):
    gen, caches, cfg, g = setup
    n = 150
    blocks = torch.stack([torch.randperm(NB, generator=gen)[:12] for _ in range(3)]).to(torch.int32)
    states = []
    eager = SFIRuntime(L, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"))
    for j in range(3):
        slot = j + 1
        ring_pos = [-1] * 8
        q = torch.randn(L, 8, HQ, D, generator=gen)
        seq = SeqState(cfg=cfg, trigger=RefreshTrigger(), prompt_len=n, ring=torch.zeros(L, HQ, 8, D),
                       ring_pos=[-1] * 8, ck=torch.zeros(L, HKV, 28, D), cv=torch.zeros(L, HKV, 28, D),
                       cpos=torch.full((L, HKV, 28), -1, dtype=torch.long))
        for p in range(n - 8, n):
            g.ring[:, slot, p % 8] = q[:, p % 8]
            seq.ring[:, :, p % 8] = q[:, p % 8]
            ring_pos[p % 8] = p
            seq.ring_pos[p % 8] = p
        states.append(SlotState(cfg, RefreshTrigger(), n, slot, ring_pos=ring_pos, refresh_n=n))
        plan = RowPlan(j, 1, 0, 8, seq, n, bootstrap=True)
        for layer in range(L):
            eager._bootstrap(layer, seq, plan, caches[layer], blocks[j], FlashPaged())
        eager._select(seq, FlashPaged(), caches, blocks[j])
        states[-1].eager = seq
    g.refresh_all([(st, blocks[j]) for j, st in enumerate(states)], BS)
    for st in states:
        seq = st.eager
        m = int((seq.cpos[0, 0] >= 0).sum())
        assert m == 4 + 24
        got = g.cpos[:, st.slot, :, :m].long()
        assert torch.equal(torch.sort(got, -1).values, torch.sort(seq.cpos[:, :, :m], -1).values)
        assert torch.equal(g.ck[:, st.slot, :, :m], seq.ck[:, :, :m])
        assert torch.equal(g.cv[:, st.slot, :, :m], seq.cv[:, :, :m])
        assert torch.all(g.cpos[:, st.slot, :, m:] == -1)


def test_paged_fast_step_equals_eager_fast_step(setup):
    gen, caches, cfg, g = setup
    n, slot, layer = 120, 2, 1
    blocks = torch.randperm(NB, generator=gen)[:10].to(torch.int32)
    keep = torch.stack([torch.sort(torch.randperm(n - 4, generator=gen)[:24] + 4).values for _ in range(HKV)])
    pos = torch.cat([torch.arange(4).expand(HKV, 4), keep], -1)
    paged = FlashPaged()
    k, v = paged.read(caches[layer], blocks, 0, n)
    g.cpos[layer, slot, :, :28] = pos.to(torch.int32)
    g.ck[layer, slot, :, :28] = torch.gather(k, 1, pos.unsqueeze(-1).expand(-1, -1, D))
    g.cv[layer, slot, :, :28] = torch.gather(v, 1, pos.unsqueeze(-1).expand(-1, -1, D))
    seq = SeqState(cfg=cfg, trigger=RefreshTrigger(), prompt_len=10, ck=g.ck[:, slot, :, :28].clone(),
                   cv=g.cv[:, slot, :, :28].clone(), cpos=g.cpos[:, slot, :, :28].long().clone())
    q = torch.randn(3, HQ, D, generator=gen)
    ws = n - cfg.recent
    eager = SFIRuntime(L, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"))
    want = eager._fast(layer, seq, RowPlan(0, FAST, 1, 1, seq, n, ws), q[1], caches[layer], blocks, paged)
    kc, vc = caches[layer].transpose(1, 2).split(D, dim=-1)
    out = torch.zeros_like(q)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    sfi_paged_fast_reference(q, out, g.ck[layer], g.cv[layer], g.cpos[layer], kc, vc, blocks.view(1, -1),
                             i32(1), i32(slot), i32(1), i32(ws), i32(n), 0.25)
    assert torch.allclose(out[1], want, atol=1e-5)


def test_warm_up_at_admission_leaves_other_slots_alone(setup):
    """The refresh kernels are compiled when a request is admitted; that warm-up writes only into
    the slot being admitted (replaced at its first refresh), once per set of options."""
    _, _, cfg, g = setup
    g.ck.normal_()
    before = g.ck.clone()
    admitted = g.free[0]
    g._warm(cfg)
    g._warm(cfg)
    assert len(g._warmed) == 1
    others = [s for s in range(g.slots) if s != admitted]
    assert torch.equal(g.ck[:, others], before[:, others])
    assert torch.equal(g.ck[1:], before[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton's compiled-kernel caches)")
def test_no_compilation_after_the_warm_up_cuda():
    """After the admission warm-up, refreshes at any length (bootstrap and slow-step rows) compile
    no new variant of the refresh kernels: nothing is compiled inside a decode step."""
    from cotserve.kernels import sfi_paged as sp
    from cotserve.kernels import sfi_select as ss

    dev = torch.device("cuda")
    layers = [SimpleNamespace(kv_cache=torch.randn(700, 8, 16, 256, device=dev, dtype=torch.bfloat16))
              for _ in range(2)]
    g = GraphSFI(layers, 32, 8, 128, 0.088, torch.bfloat16, dev, slots=2, max_rows=2, rows=BatchRows())
    cfg = SFIConfig()
    kernels = (ss._head_kernel, ss._mix_kernel, sp._paged_logits_kernel, sp._pack_kernel)

    def compiled():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]

    g._warm(cfg)
    torch.cuda.synchronize()
    before = compiled()
    for n in (4097, 4104, 5000, 4096, 2500):
        blocks = torch.randperm(700, device=dev)[: -(-n // 16)].view(1, -1).to(torch.int32)
        for lo in (n - 16, n - 1):
            ring_pos = [n - 16 + ((i - n) % 16) for i in range(16)]
            g.refresh([SlotState(cfg, RefreshTrigger(), n, 0, ring_pos=ring_pos, refresh_n=n, refresh_lo=lo)],
                      blocks, 16)
    torch.cuda.synchronize()
    assert compiled() == before
