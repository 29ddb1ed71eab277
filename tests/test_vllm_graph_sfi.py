"""The CUDA backend's graph-safe SFI runtime (`cotserve.vllm.graph_sfi`) against the eager runtime
that the CPU backend uses (`cotserve.vllm.sfi_runtime`, built from the native policy's functions).

Runs on the CPU with tensors in vLLM 0.26's FlashAttention cache layout ([blocks, H, block, 2 D]):
the batched refresh (several requests at once) must select and pack exactly what the per-request
eager refresh selects, and the paged fast step must equal the eager fast step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cotserve.kernels.sfi_paged import sfi_paged_fast_reference
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger
from cotserve.vllm.batch_rows import BatchRows
from cotserve.vllm.graph_sfi import GraphSFI, SlotState
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


def test_start_up_warm_up_writes_nothing_a_step_reads(setup):
    """The start-up warm-up (CUDA forward, first step not being captured) launches SFI's kernels on
    one mode-0 row into scratch outputs: the step's output and the row tensors stay as they were,
    and it runs once."""
    gen, caches, cfg, g = setup
    kc, vc = caches[0].transpose(1, 2).split(D, dim=-1)  # [blocks, block, H, D] views, as the backend's
    g.ring.normal_(generator=gen)  # query rows the step would read: the warm-up's writes go to the scratch slot
    g.cpos.random_(0, 100, generator=gen)
    # (the free slot it warms the re-pack on, slot 0, is marked empty: admission marks it so again)
    rows = (g.row_mode, g.row_slot, g.row_tok, g.row_ws, g.row_len, g.row_cws, g.ring[:, : g.slots], g.cpos[:, 1:])
    before = [t.clone() for t in rows]
    q = torch.randn(5, HQ, D, generator=gen)
    out = torch.full((5, HQ, D), 7.0)
    blocks = torch.randperm(NB, generator=gen)[:12].view(1, -1).to(torch.int32)
    launched = []
    warm = g._warm
    g._warm = lambda c, slot=0: (launched.append((c, slot)), warm(c, slot))
    g.warm_up(0, q, out, kc, vc, blocks)
    g.warm_up(0, q, out, kc, vc, blocks)
    assert g.warmed_up and launched == [(SFIConfig(), 0)]
    assert torch.equal(out, torch.full((5, HQ, D), 7.0))
    assert all(torch.equal(a, b) for a, b in zip(rows, before, strict=True))


@pytest.mark.parametrize("floats", [None, HQ * 8 * 150 * 2])
def test_batched_refresh_equals_eager_selection(setup, monkeypatch, floats):
    """`floats`: a refresh budget that holds two requests' logits, so the three go in two parts."""
    gen, caches, cfg, g = setup
    if floats is not None:
        monkeypatch.setattr("cotserve.policies.sfi.paged.REFRESH_FLOATS", floats)
    parts: list[int] = []
    refresh = g.refresh
    g.refresh = lambda states, blocks, bs: (parts.append(len(states)), refresh(states, blocks, bs))
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
        states.append(SlotState(cfg, RefreshTrigger(), n, slot=slot, ring_pos=ring_pos, refresh_n=n))
        plan = RowPlan(j, 1, 0, 8, seq, n, bootstrap=True)
        for layer in range(L):
            eager._bootstrap(layer, seq, plan, caches[layer], blocks[j], FlashPaged())
        eager._select(seq, FlashPaged(), caches, blocks[j])
        states[-1].eager = seq
    g.reserve_logits(3 * L * HQ * 8 * 160)  # what the three need at once: no refresh allocates logits
    before = g.logits_buffer(1, 1).data_ptr()
    g.refresh_all([(st, blocks[j]) for j, st in enumerate(states)], BS)
    assert parts == ([3] if floats is None else [2, 1])
    assert g.logits_buffer(1, 1).data_ptr() == before  # every part's every chunk reused the one buffer
    for st in states:
        seq = st.eager
        m = int((seq.cpos[0, 0] >= 0).sum())
        assert m == 4 + 24
        got = g.cpos[:, st.slot, :, :m].long()
        assert torch.equal(torch.sort(got, -1).values, torch.sort(seq.cpos[:, :, :m], -1).values)
        assert torch.equal(g.ck[:, st.slot, :, :m], seq.ck[:, :, :m])
        assert torch.equal(g.cv[:, st.slot, :, :m], seq.cv[:, :, :m])
        assert torch.all(g.cpos[:, st.slot, :, m:] == -1)
        assert int(g.ccount[st.slot]) == m  # the entries the fast step reads, sinks and selection


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
    for t in (g.ck, g.cv, g.ring):
        t.normal_()
    g.cpos.random_(0, 100)
    g.ccount.fill_(50)
    before = [t.clone() for t in (g.ck, g.cv, g.cpos, g.ring)]
    admitted = g.free[0]
    g._warm(cfg, admitted)
    g._warm(cfg, admitted)
    assert len(g._warmed) == 1
    others = [s for s in range(g.slots) if s != admitted]
    for t, was in zip((g.ck, g.cv, g.cpos), before, strict=False):
        assert torch.equal(t[:, others], was[:, others])
    assert torch.equal(g.ring, before[3])  # the rings are only read
    # the admitted slot: no entry copied, its positions say empty (set again at admission)
    assert torch.equal(g.ck[:, admitted], before[0][:, admitted]) and torch.all(g.cpos[:, admitted] == -1)
    assert int(g.ccount[admitted]) == 0 and all(int(g.ccount[s]) == 50 for s in others)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton's compiled-kernel caches)")
def test_no_compilation_after_the_warm_up_cuda():
    """After the warm-ups (admission, and the start-up one), refreshes at any length (bootstrap and
    slow-step rows) and fast steps at any batch size compile no new kernel variant: nothing is
    compiled inside a decode step."""
    from cotserve.kernels import sfi_paged as sp
    from cotserve.kernels import sfi_refresh as sr
    from cotserve.kernels import sfi_select as ss

    dev = torch.device("cuda")
    layers = [SimpleNamespace(kv_cache=torch.randn(700, 8, 16, 256, device=dev, dtype=torch.bfloat16))
              for _ in range(2)]
    g = GraphSFI(layers, 32, 8, 128, 0.088, torch.bfloat16, dev, slots=2, max_rows=8, rows=BatchRows())
    cfg = SFIConfig()
    kernels = (ss._head_kernel, ss._mix_kernel, sr._ring_logits_kernel, sr._pack_kernel)

    def compiled():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]

    g._warm(cfg)
    kc0, vc0 = layers[0].kv_cache.transpose(1, 2).split(128, dim=-1)  # [blocks, block, H, D] views
    bt = torch.zeros(8, 40, dtype=torch.int32, device=dev)
    g.warm_up(0, torch.zeros(8, 32, 128, device=dev, dtype=torch.bfloat16),
              torch.zeros(8, 32, 128, device=dev, dtype=torch.bfloat16), kc0, vc0, bt)
    torch.cuda.synchronize()
    kernels = (*kernels, sp._sfi_fast_kernel, sp._sfi_fast_split_kernel, sp._sfi_combine_kernel)
    before = compiled()
    for n in (4097, 4104, 5000, 4096, 2500):
        # a block table of an odd width, as a step's may be: its rows 1..3 are not 16-byte aligned
        table = torch.randint(0, 700, (4, -(-n // 16) | 1), device=dev, dtype=torch.int32)
        for row in range(4):
            for lo in (n - 16, n - 1):
                ring_pos = [n - 16 + ((i - n) % 16) for i in range(16)]
                st = SlotState(cfg, RefreshTrigger(), n, slot=0, ring_pos=ring_pos, refresh_n=n, refresh_lo=lo)
                g.refresh_all([(st, table[row])], 16)
    for rows in range(1, 9):  # the fast step at every batch size, q a view into a fused qkv as vLLM's is
        qkv = torch.zeros(rows, (32 + 16) * 128, device=dev, dtype=torch.bfloat16)
        g.attend_fast(0, qkv[:, : 32 * 128].view(rows, 32, 128), torch.zeros(rows, 32, 128, device=dev,
                      dtype=torch.bfloat16), kc0, vc0, bt[:rows], rows=rows, row_cws=g.row_cws[0])
    torch.cuda.synchronize()
    assert compiled() == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (stream synchronization)")
def test_step_and_refresh_never_wait_for_the_gpu_cuda():
    """A decode step's plan and its refreshes queue their work and return: no synchronizing call
    (a blocking copy, `.item()`, a pageable upload), so under vLLM's asynchronous scheduling the next
    step is planned while the GPU still runs this one. PyTorch's sync debug mode raises on any
    synchronizing call; the host tensors are uploaded from pinned memory."""
    from cotserve.policies.sfi.paged import to_device
    from cotserve.vllm.batch_rows import RowRequest

    dev = torch.device("cuda")
    layers = [SimpleNamespace(kv_cache=torch.randn(700, 8, 16, 256, device=dev, dtype=torch.bfloat16))
              for _ in range(2)]
    g = GraphSFI(layers, 32, 8, 128, 0.088, torch.bfloat16, dev, slots=2, max_rows=4, rows=BatchRows())
    cfg = SFIConfig(k=256, recent=64)
    n = 3000
    req = RowRequest(prompt_ids=list(range(n)), output_ids=[], sfi=cfg)
    g.rows.rows[0] = req
    blocks = torch.randperm(700, device=dev)[:200].view(1, -1).to(torch.int32)

    def step(ntok: int, length: int):
        cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, ntok]), block_table_tensor=blocks,
                             seq_lens=to_device([length], torch.int32, dev))  # as vLLM's, from pinned memory
        g.refresh_due(cm, 16)
        return g.step(cm, 16)

    step(n, n)  # admission warms the kernels up (compiling may synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 6):  # the bootstrap's refresh, then fast and (forced) slow steps
            req.output_ids.append(5)
            if i == 3:
                req.state.trigger.reset(-10**6)
            step(1, n + i)
        x = to_device([1, 2, 3], torch.int32, dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert x.tolist() == [1, 2, 3] and g.refreshes >= 1 and req.state.k_eff == 256


def _compacted_positions(gen, n: int, first_tail: int, tail: int = 40) -> torch.Tensor:
    """True positions [L, HKV, n] of a compacted request's physical entries: per head, the sinks,
    then a sorted sample of older positions (what an eviction kept), then a tail of consecutive
    positions from `first_tail` on (the entries written after that compaction)."""
    rows = []
    for _ in range(L * HKV):
        kept = torch.sort(torch.randperm(first_tail - 4, generator=gen)[: n - 4 - tail] + 4).values
        rows.append(torch.cat([torch.arange(4), kept, torch.arange(first_tail, first_tail + tail)]))
    return torch.stack(rows).view(L, HKV, n)


def test_compacted_refresh_equals_eager_selection(setup):
    """A request whose cache an eviction policy compacted: the refresh masks rows, weighs the
    prior and fills the compact positions by the entries' true positions, and selects and packs
    exactly what the eager runtime (the CPU backend's, from the native policy's functions) does."""
    gen, caches, cfg, g = setup
    n, first_tail, slot = 150, 300, 1
    tpos = _compacted_positions(gen, n, first_tail)
    qpos = first_tail + 39  # the newest entry's true position
    blocks = torch.randperm(NB, generator=gen)[:12].to(torch.int32)
    q = torch.randn(L, 8, HQ, D, generator=gen)
    ring_pos = [-1] * 8
    seq = SeqState(cfg=cfg, trigger=RefreshTrigger(), prompt_len=10, ring=torch.zeros(L, HQ, 8, D),
                   ring_pos=[-1] * 8, ck=torch.zeros(L, HKV, 28, D), cv=torch.zeros(L, HKV, 28, D),
                   cpos=torch.full((L, HKV, 28), -1, dtype=torch.long))
    for p in range(qpos - 7, qpos + 1):
        g.ring[:, slot, p % 8] = q[:, p % 8]
        seq.ring[:, :, p % 8] = q[:, p % 8]
        ring_pos[p % 8] = p
        seq.ring_pos[p % 8] = p
    eager = SFIRuntime(L, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"))
    paged = FlashPaged()
    for layer in range(L):
        k, _ = paged.read(caches[layer], blocks, 0, n)
        idx, row_pos = eager._rows(seq, qpos + 1 - cfg.obs_window, qpos + 1)
        qrows = seq.ring[layer, :, idx]
        logits = torch.matmul(qrows.reshape(HKV, (HQ // HKV) * len(idx), -1) * 0.25, k.transpose(-1, -2)).float()
        eager._stash(layer, seq, logits.view(HKV, HQ // HKV, len(idx), n), row_pos, n, tpos[layer])
    seq.refresh_pos = tpos
    eager._select(seq, paged, caches, blocks)
    st = SlotState(cfg, RefreshTrigger(), 10, slot=slot, ring_pos=ring_pos, refresh_n=n, refresh_lo=qpos + 1 - 8,
                   refresh_hi=qpos + 1, refresh_pos=tpos, refresh_blocks=blocks)
    g.refresh_all([(st, st.refresh_blocks)], BS)
    m = 4 + 24
    got = g.cpos[:, slot, :, :m].long()
    assert torch.equal(got, seq.cpos[:, :, :m])  # true positions, both sorted ascending
    assert bool((got[..., 4:] > 400).sum() == 0) and bool((got[..., 4:] >= first_tail).any())
    assert torch.equal(g.ck[:, slot, :, :m], seq.ck[:, :, :m])
    assert torch.equal(g.cv[:, slot, :, :m], seq.cv[:, :, :m])
    assert st.refresh_n == 0 and st.refresh_pos is None and st.refresh_blocks is None
    # against the same evidence read as if positions were indices, the selection differs
    g2 = GraphSFI([SimpleNamespace(kv_cache=c) for c in caches], HQ, HKV, D, 0.25, torch.float32,
                  torch.device("cpu"), slots=4, max_rows=8, max_k=32, rows=BatchRows())
    g2.ring.copy_(g.ring)
    g2.refresh_all([(SlotState(cfg, RefreshTrigger(), 10, slot=slot, ring_pos=ring_pos, refresh_n=n,
                               refresh_lo=qpos + 1 - 8, refresh_hi=qpos + 1), blocks)], BS)
    assert not torch.equal(g2.cpos[:, slot, :, :m].long(), got)


def test_compacted_fast_step_equals_eager_fast_step(setup):
    """The fast step of a compacted request: the window by cache index, the compact entries cut
    per KV head at the true position of its first window entry, as the eager runtime reads them."""
    gen, caches, cfg, g = setup
    n, first_tail, slot, layer = 150, 300, 2, 1
    tpos = _compacted_positions(gen, n, first_tail, tail=10)
    blocks = torch.randperm(NB, generator=gen)[:12].to(torch.int32)
    paged = FlashPaged()
    k, v = paged.read(caches[layer], blocks, 0, n)
    # compact entries (copies) picked among all physical entries, by true position
    pick = torch.stack([torch.sort(torch.randperm(n - 4, generator=gen)[:24] + 4).values for _ in range(HKV)])
    pick = torch.cat([torch.arange(4).expand(HKV, 4), pick], -1)
    g.cpos[layer, slot, :, :28] = torch.gather(tpos[layer], 1, pick).to(torch.int32)
    g.ck[layer, slot, :, :28] = torch.gather(k, 1, pick.unsqueeze(-1).expand(-1, -1, D))
    g.cv[layer, slot, :, :28] = torch.gather(v, 1, pick.unsqueeze(-1).expand(-1, -1, D))
    seq = SeqState(cfg=cfg, trigger=RefreshTrigger(), prompt_len=10, ck=g.ck[:, slot, :, :28].clone(),
                   cv=g.cv[:, slot, :, :28].clone(), cpos=g.cpos[:, slot, :, :28].long().clone())
    ws = n - cfg.recent  # inside the kept entries: a different true position per head
    wpos = tpos[:, :, ws:ws + 1]
    assert len(set(wpos[layer].flatten().tolist())) > 1
    q = torch.randn(3, HQ, D, generator=gen)
    eager = SFIRuntime(L, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"))
    plan = RowPlan(0, FAST, 1, 1, seq, n, ws, qpos=first_tail + 9, epos=tpos, wpos=wpos)
    want = eager._fast(layer, seq, plan, q[1], caches[layer], blocks, paged)
    kc, vc = caches[layer].transpose(1, 2).split(D, dim=-1)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cws = wpos[layer].view(1, HKV).to(torch.int32)
    out = sfi_paged_fast_reference(q, torch.zeros_like(q), g.ck[layer], g.cv[layer], g.cpos[layer], kc, vc,
                                   blocks.view(1, -1), i32(1), i32(slot), i32(1), i32(ws), i32(n), 0.25, row_cws=cws)
    assert torch.allclose(out[1], want, atol=1e-5)
    plain = sfi_paged_fast_reference(q, torch.zeros_like(q), g.ck[layer], g.cv[layer], g.cpos[layer], kc, vc,
                                     blocks.view(1, -1), i32(1), i32(slot), i32(1), i32(ws), i32(n), 0.25)
    assert not torch.allclose(plain[1], want, atol=1e-4)  # the index cutoff would read other entries


def test_step_plans_a_compacted_request_in_physical_terms(setup):
    """The step plan of an evicting SFI request: length and window start physical, each head's
    compact cutoff the true position of its window's first entry; a slow step keeps the block row
    and the entries' true positions for the refresh that runs before the next compaction."""
    from cotserve.policies.registry import build_policy
    from cotserve.vllm.batch_rows import RowRequest
    from cotserve.vllm.evict_runtime import EvictRuntime

    gen, caches, cfg, g = setup
    rows = g.rows
    ev = EvictRuntime(L, HQ, HKV, D, 0.25, torch.float32, torch.device("cpu"), slots=2, max_tokens=64)
    pol = build_policy("skipkv+sfi", {"skipkv.budget": 100, "sfi.k": 24, "sfi.recent": 16, "sfi.sinks": 4,
                                       "sfi.obs_window": 8})
    req = RowRequest(prompt_ids=list(range(200)), output_ids=[5] * 60, sfi=cfg, evict=pol.parts[0])
    rows.rows[0] = req
    est = ev._admit(req)
    est.pos = _compacted_positions(gen, 140, 220, tail=5)[..., :130]  # the last compaction kept 130 entries
    est.tail_start, est.n_phys = 225, 141  # 11 entries since, this step's included
    st = g._admit(req)
    st.kv_len, st.steps = 260, 60
    blocks = torch.randperm(NB, generator=gen)[:12].to(torch.int32)
    cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, 1]), block_table_tensor=blocks.view(1, -1),
                         seq_lens=torch.tensor([141], dtype=torch.int32))
    st.trigger = SimpleNamespace(step=lambda steps, after: False)  # a fast step
    g.step(cm, BS, evict=ev)
    ws = 141 - cfg.recent
    assert (int(g.row_mode[0]), int(g.row_len[0]), int(g.row_ws[0])) == (1, 141, ws)
    assert torch.equal(g.row_cws[:, 0].long(), ev.positions(est, 141)[:, :, ws])
    assert len(set(g.row_cws[:, 0].flatten().tolist())) > 1  # a cutoff per layer and head
    assert st.ring_pos[260 % len(st.ring_pos)] == 260  # the ring keeps true positions
    est.n_phys = 142
    st.trigger = SimpleNamespace(step=lambda steps, after: True)  # a slow step
    cm.seq_lens = torch.tensor([142], dtype=torch.int32)
    g.step(cm, BS, evict=ev)
    assert (int(g.row_mode[0]), int(g.row_len[0])) == (2, 142)
    assert (st.refresh_n, st.refresh_hi, st.refresh_lo) == (142, 262, 262 - cfg.obs_window)
    assert torch.equal(st.refresh_pos, ev.positions(est, 142))
    assert torch.equal(st.refresh_blocks, blocks)


def test_a_context_too_short_to_skip_decodes_densely_then_selects(setup):
    """While a request's context is at most sinks + k + recent entries a fast step would read them
    all: its steps are dense (mode 0, FlashAttention over the whole history, no refresh) and its
    query rows still fill the ring; the first step past that length is slow and selects. A batch
    with no SFI request writes nothing but FlashAttention's lengths."""
    from cotserve.vllm.batch_rows import RowRequest

    gen, caches, cfg, g = setup
    limit = cfg.sinks + cfg.k + cfg.recent  # 44
    prompt = 30
    req = RowRequest(prompt_ids=list(range(prompt)), output_ids=[], sfi=cfg)
    g.rows.rows[0] = req
    blocks = torch.randperm(NB, generator=gen)[:8].to(torch.int32)

    def step(ntok: int, length: int):
        cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, ntok]),
                             block_table_tensor=blocks.view(1, -1), seq_lens=torch.tensor([length], dtype=torch.int32))
        g.refresh_due(cm, BS)
        return g.step(cm, BS)

    step(prompt, prompt)  # the prompt in one chunk: too short for a bootstrap selection
    st = req.state
    assert st.refresh_n == 0 and int(g.row_mode[0]) == 0
    modes, kinds = [], []
    for n in range(prompt + 1, limit + 3):
        req.output_ids.append(5)
        fa = step(1, n)
        modes.append(int(g.row_mode[0]))
        kinds.append((g.step_refreshes, g.step_slow))  # what the step clock is told
        assert g.step_sfi == 1  # one SFI row, dense while short, then slow, then fast
        if n <= limit:
            assert int(fa[0]) == n and st.refresh_n == 0  # dense: the whole history, nothing refreshed
    assert modes[: limit - prompt] == [0] * (limit - prompt)
    assert modes[limit - prompt] == 2  # the first step past the length: slow, it selects
    assert kinds[: limit - prompt] == [(0, 0)] * (limit - prompt) and kinds[limit - prompt] == (0, 1)
    assert kinds[limit - prompt + 1][0] == 1  # its refresh ran before the next step
    # the selection ran at the next step's build, over the ring's rows of the dense steps; then SFI reads sparsely
    assert modes[limit - prompt + 1] in (1, 2) and st.k_eff == cfg.k and st.refresh_lo == limit + 1 - cfg.obs_window
    assert st.short_steps == limit - prompt and g.telemetry(st)["sfi_short_dense_steps"] == limit - prompt
    assert all(p >= 0 for p in st.ring_pos)  # the dense steps' query rows are in the ring

    g.rows.rows.clear()  # an all-dense batch: nothing of SFI to plan
    g.step(SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, 1]), block_table_tensor=blocks.view(1, -1),
                           seq_lens=torch.tensor([9], dtype=torch.int32)), BS)
    g.row_mode.fill_(7)  # were the row tensors rewritten, this would be undone
    fa = g.step(SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, 1]),
                                block_table_tensor=blocks.view(1, -1), seq_lens=torch.tensor([10], dtype=torch.int32)), BS)
    assert int(fa[0]) == 10 and int(g.row_mode[0]) == 7
    assert (g.step_slow, g.step_sfi) == (0, 0)  # the step clock sees a step without SFI


def test_an_engine_without_sfi_slots_decodes_sfi_densely_and_reserves_nothing(monkeypatch):
    """In a plain `vllm serve` with prefix caching on no request runs SFI (it may read a cached
    prefix): the CUDA engine makes no SFI slot (its compact buffers are one small unused slot) and
    reserves no working memory for refreshes; a request that still asks for SFI decodes densely,
    and the fast kernel's pointers stay valid. Started by cotserve, SFI requests compute their whole
    prompt, so the slots are made beside prefix caching."""
    from types import SimpleNamespace as NS

    from cotserve.policies.sfi.paged import REFRESH_FLOATS
    from cotserve.vllm import gpu_memory
    from cotserve.vllm.batch_rows import RowRequest

    monkeypatch.delenv("COTSERVE_VLLM_SFI_SLOTS", raising=False)
    monkeypatch.delenv("COTSERVE_VLLM_SCRATCH_MIB", raising=False)
    ours = gpu_memory.started_by_cotserve(NS(additional_config={gpu_memory.COTSERVE_CONFIG: {"engine": True}}))
    assert ours and not gpu_memory.started_by_cotserve(NS(additional_config={}))
    assert gpu_memory.sfi_slots(256, prefix_caching=True, by_cotserve=False) == 0
    assert gpu_memory.sfi_slots(256, prefix_caching=True, by_cotserve=True) == 64
    assert gpu_memory.sfi_slots(16, prefix_caching=False, by_cotserve=False) == 16
    monkeypatch.setenv("COTSERVE_VLLM_SFI_SLOTS", "8")
    assert gpu_memory.sfi_slots(256, prefix_caching=False, by_cotserve=False) == 8
    assert gpu_memory.sfi_slots(256, prefix_caching=True, by_cotserve=False) == 0  # nothing to serve it with
    assert gpu_memory.scratch_bytes(torch.bfloat16, sfi=False, evict=False) == 0
    assert gpu_memory.scratch_bytes(torch.bfloat16, sfi=True, evict=False) == 4 * REFRESH_FLOATS
    assert gpu_memory.scratch_bytes(torch.bfloat16, sfi=False, evict=True) > 0

    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(NB, HKV, BS, 2 * D, generator=gen) for _ in range(L)]
    g = GraphSFI([SimpleNamespace(kv_cache=c) for c in caches], HQ, HKV, D, 0.25, torch.float32,
                 torch.device("cpu"), slots=0, max_rows=4, max_k=0, rows=BatchRows())
    assert g.ck.shape[1] == 1 and g.C == 64 and g.ring.shape[1] == 1  # the ring's one slot is the scratch one
    cfg = SFIConfig(k=24, recent=16, sinks=4)
    req = RowRequest(prompt_ids=list(range(90)), output_ids=[], sfi=cfg)
    g.rows.rows[0] = req
    blocks = torch.randperm(NB, generator=gen)[:8].to(torch.int32)
    cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, 90]), block_table_tensor=blocks.view(1, -1),
                         seq_lens=torch.tensor([90], dtype=torch.int32))
    fa = g.step(cm, BS)
    assert req.sfi is None and req.state is None and int(fa[0]) == 90 and int(g.row_mode[0]) == 0
    q = torch.randn(1, HQ, D, generator=gen)
    out = torch.zeros_like(q)
    kc, vc = caches[0].transpose(1, 2).split(D, dim=-1)
    sfi_paged_fast_reference(q, out, g.ck[0], g.cv[0], g.cpos[0], kc, vc, blocks.view(1, -1), g.row_mode[:1],
                             g.row_slot[:1], g.row_tok[:1], g.row_ws[:1], g.row_len[:1], 0.25)
    assert torch.equal(out, torch.zeros_like(q))  # a dense row: the fast kernel leaves it to FlashAttention


def test_allocator_counters_only_on_cuda():
    from cotserve.vllm.telemetry import allocator_counters

    assert allocator_counters(torch.device("cpu")) == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_counters_count_device_allocations_cuda():
    from cotserve.vllm.telemetry import ALLOCATOR_COUNTERS, allocator_counters

    dev = torch.device("cuda")
    torch.cuda.empty_cache()  # blocks earlier tests left cached could serve the request below
    before = allocator_counters(dev)
    assert set(before) == set(ALLOCATOR_COUNTERS)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # nothing cached: a new cudaMalloc
    assert allocator_counters(dev)["cuda_device_allocs"] > before["cuda_device_allocs"]
    del x


def test_logits_buffer_is_one_padded_storage(setup):
    """The refreshes' logits: views with rows padded to 16 entries (one compiled kernel variant) of
    one storage, grown only when a refresh needs more than it holds."""
    g = setup[3]
    a = g.logits_buffer(2, 3, 20)
    assert a.shape == (2, 3, 20) and a.stride() == (96, 32, 1)
    b = g.logits_buffer(1, 5)
    assert b.data_ptr() == a.data_ptr()
    c = g.logits_buffer(4096, 33)  # more than it holds: a bigger storage
    assert c.shape == (4096, 33) and c.stride(0) == 48
    assert g.logits_buffer(1, 1).data_ptr() == c.data_ptr()


@pytest.mark.parametrize("width", [12, 13])
def test_a_refresh_hands_the_kernels_aligned_block_rows(setup, width):
    """Triton compiles a kernel per pointer alignment, and the warm-up compiled it for an aligned block
    row: a one-request refresh passes its row of the step's block table as a view only where that row
    is 16-byte aligned, else a copy (also aligned); several requests' rows are stacked (a copy)."""
    gen, caches, cfg, g = setup
    handed = []
    refresh = g.refresh
    g.refresh = lambda states, blocks, bs: (handed.append(blocks), refresh(states, blocks, bs))
    table = torch.stack([torch.randperm(NB, generator=gen)[:width] for _ in range(4)]).to(torch.int32)
    n = 150

    def state(slot):
        return SlotState(cfg, RefreshTrigger(), n, slot=slot, ring_pos=[n - 8 + ((i - n) % 8) for i in range(8)],
                         refresh_n=n, refresh_lo=n - cfg.obs_window)

    for row in range(4):
        g.refresh_all([(state(1), table[row])], BS)
    g.refresh_all([(state(1), table[1]), (state(2), table[2])], BS)
    assert all(b.data_ptr() % 16 == 0 for b in handed)
    views = [b.data_ptr() == table[row].data_ptr() for row, b in zip(range(4), handed, strict=False)]
    assert views == [row * width * 4 % 16 == 0 for row in range(4)]  # a view exactly where it is aligned
    assert torch.equal(handed[-1], table[1:3]) and all(torch.equal(b[0], table[r]) for r, b in enumerate(handed[:4]))


class _Ops(TorchDispatchMode):
    """Counts the torch operators that compute (views and allocations aside); paused inside kernels
    (Triton's interpreter runs them with torch operators of its own)."""

    SKIP = {"view", "slice", "select", "unsqueeze", "expand", "permute", "transpose", "as_strided", "_unsafe_view",
            "empty", "empty_strided", "alias", "detach", "lift_fresh", "unbind"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in self.SKIP:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_refresh_issues_few_launches(setup, monkeypatch):
    """A refresh is issued by the host between two steps: its launches are host time the next step
    can wait on. One request's refresh over every layer makes four Triton launches (the logits read
    from the ring, the selector's two kernels, the re-pack with positions) and two torch operators
    (the top-K and its sort) besides the copy of its rows and slot to the device."""
    from cotserve.kernels import sfi_refresh, sfi_select

    gen, caches, cfg, g = setup
    mode, launched = _Ops(), []

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def call(*args, **kwargs):
                launched.append(self.name)
                mode.paused += 1
                try:
                    return run(*args, **kwargs)
                finally:
                    mode.paused -= 1
            return call

    for module, name in ((sfi_refresh, "_ring_logits_kernel"), (sfi_refresh, "_pack_kernel"),
                         (sfi_select, "_head_kernel"), (sfi_select, "_mix_kernel")):
        monkeypatch.setattr(module, name, Counted(getattr(module, name), name))
    n = 150
    blocks = torch.randperm(NB, generator=gen)[:12].view(1, -1).to(torch.int32)
    g.ring.normal_(generator=gen)
    st = SlotState(cfg, RefreshTrigger(), n, slot=1, ring_pos=[n - 8 + ((i - n) % 8) for i in range(8)], refresh_n=n,
                   refresh_lo=n - cfg.obs_window)
    g._warm(cfg, 1)
    launched.clear()
    with mode:
        g.refresh_all([(st, blocks[0])], BS)
    assert sorted(launched) == ["_head_kernel", "_mix_kernel", "_pack_kernel", "_ring_logits_kernel"]
    assert sorted(mode.ops) == ["sort", "topk"], mode.ops
    assert torch.all(g.cpos[:, 1, :, : 4 + 24] >= 0) and torch.all(g.cpos[:, 1, :, 4 + 24 :] == -1)


def test_layer_views_are_kept_until_vllm_binds_new_caches(setup):
    """The refresh's per-layer views and offset tables are taken once; when vLLM binds a new cache
    tensor to a layer (a new engine cache), they are taken again and read the new tensor."""
    gen, caches, _, g = setup
    views = g.paged_layers()
    assert g.paged_layers() is views
    assert views.keys[1].data_ptr() == caches[1].data_ptr()
    fresh = torch.randn_like(caches[1])
    g.layers[1].kv_cache = fresh
    again = g.paged_layers()
    assert again is not views and again.keys[1].data_ptr() == fresh.data_ptr()
    assert int(again.key_off[1]) * fresh.element_size() == fresh.data_ptr() - caches[0].data_ptr()


def test_a_request_that_found_every_slot_busy_takes_the_next_one_that_frees(caplog):
    """With one slot and two SFI requests, the second decodes densely (no state, one warning) until
    the first leaves; then it takes the freed slot at its current length, decodes densely for
    `obs_window` steps while its query rows fill the ring, selects at the next step (slow), and
    reads sparsely only after that selection filled the compact buffer. An evicting request that
    finds no slot decodes densely to its end, as before."""
    from cotserve.vllm.batch_rows import RowRequest

    g, step = _one_slot_engine(11)
    cfg = SFIConfig(k=24, recent=16, sinks=4, obs_window=8, dense_heads=0)
    prompt = 60  # past sinks + k + recent (44): the first request bootstraps at its prompt's end
    a = RowRequest(prompt_ids=list(range(prompt)), output_ids=[], sfi=cfg)
    b = RowRequest(prompt_ids=list(range(prompt)), output_ids=[], sfi=cfg)
    g.rows.rows[0], g.rows.rows[1] = a, b

    with caplog.at_level("WARNING", logger="cotserve.vllm.graph_sfi"):
        step([prompt, prompt], [prompt, prompt])
        n = prompt
        for _ in range(3):  # both decode; the second waits, densely
            n += 1
            a.output_ids.append(5)
            b.output_ids.append(5)
            assert step([1, 1], [n, n])[1] == 0
    assert a.state.slot == 0 and b.state is None and b.sfi is cfg and b.sfi_waiting
    assert sum("slots are busy" in r.getMessage() for r in caplog.records) == 1

    g.rows.remove(0)  # the first request finished: its slot frees at the next step's plan
    modes, lens = [], []
    for _ in range(cfg.obs_window + 3):
        n += 1
        b.output_ids.append(5)
        modes.append(step([0, 1], [0, n])[1])
        lens.append(n)
        if len(modes) == 1:
            st = b.state
            assert st is not None and st.slot == 0 and st.kv_len == n and not b.sfi_waiting
        _never_sparse_before_a_selection(g, modes)
        if len(modes) == cfg.obs_window + 1:  # the slow step: its refresh covers the ring's rows
            assert (st.refresh_lo, st.refresh_hi) == (n - cfg.obs_window, n)
            assert all(p in st.ring_pos for p in range(n - cfg.obs_window, n))
    assert modes[: cfg.obs_window] == [0] * cfg.obs_window  # dense while the ring fills
    assert modes[cfg.obs_window] == 2  # then slow: it selects over those rows
    assert st.k_eff == cfg.k and modes[cfg.obs_window + 1] == 1 and st.kv_len == lens[-1]
    assert int((g.cpos[0, 0, 0] >= 0).sum()) == cfg.sinks + cfg.k  # the selection filled the slot
    tele = g.telemetry(st)
    assert tele["sfi_catch_up_dense_steps"] == cfg.obs_window and "sfi_short_dense_steps" not in tele
    assert tele["sfi_wait_dense_steps"] == 3  # the three decode steps it waited for the slot, dense
    assert tele["sfi_steps"] == 3 + len(modes)

    c = RowRequest(prompt_ids=list(range(prompt)), output_ids=[], sfi=cfg, evict=object())
    g.rows.rows[0] = c  # the slot is busy: an evicting request gives SFI up
    step([prompt, 1], [prompt, n + 1])
    assert c.sfi is None and c.state is None and not c.sfi_waiting


def _one_slot_engine(seed: int):
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(NB, HKV, BS, 2 * D, generator=gen) for _ in range(L)]
    g = GraphSFI([SimpleNamespace(kv_cache=c) for c in caches], HQ, HKV, D, 0.25, torch.float32,
                 torch.device("cpu"), slots=1, max_rows=4, max_k=32, rows=BatchRows())
    blocks = torch.stack([torch.randperm(NB, generator=gen)[:8] for _ in range(2)]).to(torch.int32)

    def step(ntoks: list[int], lens: list[int]) -> list[int]:
        qsl = torch.tensor([0, *torch.tensor(ntoks).cumsum(0).tolist()])
        cm = SimpleNamespace(num_reqs=len(ntoks), query_start_loc_cpu=qsl, block_table_tensor=blocks[: len(ntoks)],
                             seq_lens=torch.tensor(lens, dtype=torch.int32))
        g.refresh_due(cm, BS)
        g.step(cm, BS)
        return [int(m) for m in g.row_mode[: len(ntoks)]]

    return g, step


def _never_sparse_before_a_selection(g, modes_of_row: list[int]) -> None:
    """A sparse read (mode 1) only once a selection filled the one slot's compact buffer."""
    if modes_of_row[-1] == 1:
        assert bool((g.cpos[:, 0] >= 0).any()), "a sparse read over an empty compact buffer"


@pytest.mark.parametrize("left", [3, 40])
def test_a_late_request_in_its_prompt_bootstraps_only_with_enough_prompt_rows(left):
    """A request that gets the slot while its prompt is still being computed in chunks: with at
    least `prefill_window` prompt rows still to come it bootstraps at the prompt's end as usual;
    with fewer (`left` = 3) it skips the bootstrap and catches up in its decode steps. Either way
    no step reads sparsely before a selection."""
    from cotserve.vllm.batch_rows import RowRequest

    g, step = _one_slot_engine(12)
    cfg = SFIConfig(k=24, recent=16, sinks=4, obs_window=8, prefill_window=16, dense_heads=0)
    prompt = 100
    a = RowRequest(prompt_ids=list(range(60)), output_ids=[], sfi=cfg)
    b = RowRequest(prompt_ids=list(range(prompt)), output_ids=[], sfi=cfg)
    g.rows.rows[0], g.rows.rows[1] = a, b
    first = prompt - left
    step([60, first], [60, first])  # b's first chunk: no slot
    assert b.state is None and b.sfi_waiting
    g.rows.remove(0)
    modes = [step([0, left], [0, prompt])[1]]  # its last chunk: the slot is free now
    st = b.state
    assert st is not None and st.kv_len == prompt
    assert (st.refresh_n > 0) == (left >= cfg.prefill_window)  # the bootstrap, only with enough rows
    n = prompt
    for _ in range(cfg.obs_window + 3):
        n += 1
        b.output_ids.append(5)
        modes.append(step([0, 1], [0, n])[1])
        _never_sparse_before_a_selection(g, modes)
    assert 1 in modes and st.k_eff == cfg.k
    if left < cfg.prefill_window:
        assert modes[1 : 1 + cfg.obs_window] == [0] * cfg.obs_window and modes[1 + cfg.obs_window] == 2


def test_a_request_recomputed_after_a_preemption_is_planned_as_a_prefill():
    """After a preemption vLLM computes the prompt and the output so far again (`prefill_len`): those
    chunks are prefill for SFI (the bootstrap at their end), never a decode step with a stale or empty
    compact buffer; a row of several tokens past the prefill is dense and refills the ring."""
    from cotserve.vllm.batch_rows import RowRequest

    g, step = _one_slot_engine(13)
    cfg = SFIConfig(k=24, recent=16, sinks=4, obs_window=8, dense_heads=0)
    req = RowRequest(prompt_ids=list(range(60)), output_ids=[5] * 30, sfi=cfg, prefill_len=90)
    g.rows.rows[0] = req
    modes = [step([50], [50])[0], step([40], [90])[0]]  # the recompute, in two chunks
    st = req.state
    assert st.prompt_len == 90 and modes == [0, 0] and st.refresh_n == 90  # prefill, then the bootstrap
    n = 90
    for _ in range(3):
        n += 1
        req.output_ids.append(5)
        modes.append(step([1], [n])[0])
        _never_sparse_before_a_selection(g, modes)
    assert modes[-1] == 1
    n += 3
    modes.append(step([3], [n])[0])  # several tokens past the prefill: dense, and the ring refills
    assert modes[-1] == 0 and st.catch_up == cfg.obs_window - 1


def test_the_fast_launch_writes_the_plans_ring_rows(setup):
    """The step's query rows reach the rings through the fast-step launch (`attend_fast`): a prefill
    step of three prompts (48 ring writes, more than the ring-write tensors hold: the rest eager),
    then a decode step; every request's ring then holds exactly its own rows at its positions."""
    from cotserve.vllm.batch_rows import RowRequest

    gen, caches, cfg, g = setup
    reqs = [RowRequest(prompt_ids=list(range(60)), output_ids=[], sfi=cfg) for _ in range(3)]
    for i, r in enumerate(reqs):
        g.rows.rows[i] = r
    blocks = torch.stack([torch.randperm(NB, generator=gen)[:8] for _ in range(3)]).to(torch.int32)
    kc, vc = caches[1].transpose(1, 2).split(D, dim=-1)
    lens = [60, 60, 60]

    def step(ntok: int) -> torch.Tensor:
        cm = SimpleNamespace(num_reqs=3, query_start_loc_cpu=torch.arange(4) * ntok, block_table_tensor=blocks,
                             seq_lens=torch.tensor(lens, dtype=torch.int32))
        g.refresh_due(cm, BS)
        g.step(cm, BS)
        q = torch.randn(3 * ntok, HQ, D, generator=gen)
        g.attend_fast(1, q, torch.zeros_like(q), kc, vc, blocks, rows=3)
        return q

    q = step(60)
    assert g.extra_writes  # some writes went eager
    for i, r in enumerate(reqs):
        w = len(r.state.ring_pos)
        for p in range(60 - cfg.prefill_window, 60):
            assert torch.equal(g.ring[1, r.state.slot, p % w], q[i * 60 + p])
    for i in range(3):
        reqs[i].output_ids.append(5)
        lens[i] += 1
    q = step(1)
    for i, r in enumerate(reqs):
        assert torch.equal(g.ring[1, r.state.slot, 60 % len(r.state.ring_pos)], q[i])
    assert torch.all(g.ring[0] == 0)  # another layer's rings: untouched by this layer's launch


def test_a_shrinking_batch_leaves_no_fast_row_or_ring_write_behind(setup):
    """The plan sends only the rows and ring writes this step or the last one used: a prefill's many
    ring writes, then a batch that loses two of its fast rows, leave no write outside the scratch slot
    and no row flagged fast beyond what the step asked for."""
    from cotserve.vllm.batch_rows import RowRequest

    gen, caches, cfg, g = setup
    reqs = [RowRequest(prompt_ids=list(range(60)), output_ids=[], sfi=cfg) for _ in range(3)]
    for i, r in enumerate(reqs):
        g.rows.rows[i] = r
    blocks = torch.stack([torch.randperm(NB, generator=gen)[:8] for _ in range(3)]).to(torch.int32)
    lens = [60, 60, 60]

    def step(rows: int, ntok: int):
        qsl = torch.arange(rows + 1) * ntok
        cm = SimpleNamespace(num_reqs=rows, query_start_loc_cpu=qsl, block_table_tensor=blocks[:rows],
                             seq_lens=torch.tensor(lens[:rows], dtype=torch.int32))
        g.refresh_due(cm, BS)
        return g.step(cm, BS)

    step(3, 60)  # the prompts: 16 ring writes each, those beyond the tensors' room eager
    assert int((g.w_slot != g.slots).sum()) == g.nw and len(g.extra_writes) == 3 * cfg.prefill_window - g.nw
    for _ in range(2):
        for i in range(3):
            reqs[i].output_ids.append(5)
            lens[i] += 1
        fa = step(3, 1)
    assert g.row_mode[:3].tolist() == [1, 1, 1] and fa.tolist() == [1, 1, 1]
    assert g.w_slot[:3].tolist() == [r.state.slot for r in reqs] and bool((g.w_slot[3:] == g.slots).all())
    del g.rows.rows[1], g.rows.rows[2]
    reqs[0].output_ids.append(5)
    lens[0] += 1
    fa = step(1, 1)
    assert g.row_mode[:3].tolist() == [1, 0, 0] and fa.tolist() == [1]
    assert int(g.w_slot[0]) == reqs[0].state.slot and bool((g.w_slot[1:] == g.slots).all())
    assert int(g.row_len[0]) == lens[0] and g.row_len[1:3].tolist() == [0, 0]
