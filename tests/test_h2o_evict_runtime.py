"""h2o on the eviction runtime (no vLLM) against the native h2o policy, on random tensors.

The same keys and queries go through both: the native policy over its `KVCache` (prefill at once,
then decode steps), the runtime over a paged cache of FlashAttention's layout on CPU tensors,
with the metadata built the way vLLM's model runner builds it (the prefill in chunks, logical
lengths, slots from the table). The runtime's torch path computes each step's probabilities from
the paged cache. At every step both hold the same entries (true positions, every layer and KV
head), and their accumulated scores agree, through compactions at every step (interval 1) or
every few steps, with prompts longer and shorter than the budget, for both group reductions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cotserve.kernels import h2o_paged as hp
from cotserve.kv.batch import BatchState, ModelInfo
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.policies.base import PolicyStack
from cotserve.policies.registry import build_policy
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.evict_runtime import EvictRuntime
from cotserve.vllm.flash_paged import FlashPagedKV, split_kv

L, HQ, HKV, D, BS = 2, 6, 2, 8, 4
SCALE = D**-0.5


def _native(opts: dict, ks, vs, qp, qd, plen: int) -> tuple[list[tuple], int]:
    """The native h2o over one slot: per decode step, after its forward, the positions and scores."""
    pol = build_policy("h2o", opts).parts[0]
    steps = len(qd[0])
    cap = pol.capacity([plen], steps)
    cache = KVCache(CacheShape(L, 1, HKV, cap, D), torch.float32, torch.device("cpu"))
    info = ModelInfo(num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=HQ * D, max_positions=4096)
    batch = BatchState(info=info, cache=cache, policy=PolicyStack([pol]), scaling=SCALE,
                       prompt_lens=torch.tensor([plen]), tokens=[[0] * plen])
    pol.begin(batch)
    for layer in range(L):
        k, v = ks[layer][:plen].permute(1, 0, 2).unsqueeze(0), vs[layer][:plen].permute(1, 0, 2).unsqueeze(0)
        cache.write_prefill(layer, k, v, batch.prompt_lens)
        pol.prefill_attention(layer, qp[layer].permute(1, 0, 2).unsqueeze(0), k, v, batch)
    pol.after_forward(batch)
    batch.mode = "decode"
    out = []
    for s in range(steps):
        p = plen + s
        for layer in range(L):
            cache.write_decode(layer, ks[layer][p].view(1, HKV, 1, D), vs[layer][p].view(1, HKV, 1, D),
                               torch.tensor([p]))
            pol.decode_attention(layer, qd[layer][s].view(1, HQ, 1, D), batch)
        n = int(cache.lens[0, 0])  # after the step's forward, before its compaction (vLLM's: before the next step)
        out.append((cache.pos[:, 0, :, :n].clone(), pol.scores[:, 0, :, :n].clone()))
        done = pol.compactions[0]  # those before this step's (vLLM's runtime makes that one at the next step)
        pol.after_forward(batch)
        batch.step += 1
    return out, done


def _runtime(opts: dict, ks, vs, qp, qd, plen: int, chunks: list[int], kernel: bool = False
             ) -> tuple[list[tuple], EvictRuntime]:
    """The same through the eviction runtime: the prefill in `chunks`, then the decode steps; per
    step (after the step's forward) the positions and scores of the physical entries. `kernel`: the
    decode steps through CUDA's path (`kernels.h2o_paged` over the persistent row tensors)."""
    rt = EvictRuntime(L, HQ, HKV, D, SCALE, torch.float32, torch.device("cpu"), slots=2, max_tokens=256, max_rows=2)
    nblocks = 64
    caches = [torch.zeros(nblocks, BS, HKV, 2 * D).transpose(1, 2) for _ in range(L)]
    table = (torch.arange(nblocks, dtype=torch.int32).flip(0)[: nblocks - 1]).unsqueeze(0)  # scattered, reversed
    paged = FlashPagedKV(BS, D)
    rows = BatchRows()
    output: list[int] = []
    req = RowRequest(list(range(plen)), output, evict=build_policy("h2o", opts).parts[0], prefill_len=plen)
    rows.add(0, req)

    def step(before: int, ntok: int, q: list[torch.Tensor]) -> None:
        cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, ntok]),
                             seq_lens=torch.tensor([before + ntok], dtype=torch.int32), block_table_tensor=table.clone(),
                             slot_mapping=torch.tensor([int(table[0, p // BS]) * BS + p % BS
                                                        for p in range(before, before + ntok)]))
        got = rt.plan(rows, cm, BS, caches, paged, None)
        for layer in range(L):  # the forward: the new KV written at the given slots, then attention
            kc, vc = split_kv(caches[layer], D)
            for t in range(ntok):
                s = int(got.slot_mapping[t])
                kc[s // BS, s % BS] = ks[layer][before + t]
                vc[s // BS, s % BS] = vs[layer][before + t]
            rt.record(layer, q[layer])
            rt.accumulate(layer, q[layer], caches[layer], got.block_table_tensor,
                          key_cache=kc if kernel else None, rows=1 if kernel else None)

    at = 0
    for c in chunks:
        step(at, c, [qp[layer][at:at + c] for layer in range(L)])
        at += c
    assert at == plen
    out = []
    for s in range(len(qd[0])):
        output.append(0)
        step(plen + s, 1, [qd[layer][s].unsqueeze(0) for layer in range(L)])
        st = req.evict_state
        n = st.n_phys
        out.append((rt.positions(st, n), rt.h2o.acc[:, st.slot, :, :n].clone()))
    return out, rt


def _inputs(seed: int, plen: int, steps: int):
    gen = torch.Generator().manual_seed(seed)
    t = plen + steps
    ks = [torch.randn(t, HKV, D, generator=gen) * 2 for _ in range(L)]
    vs = [torch.randn(t, HKV, D, generator=gen) for _ in range(L)]
    qp = [torch.randn(plen, HQ, D, generator=gen) * 2 for _ in range(L)]
    qd = [torch.randn(steps, HQ, D, generator=gen) * 2 for _ in range(L)]
    return ks, vs, qp, qd


@pytest.mark.parametrize(("opts", "plen", "chunks"), [
    ({"budget": 16, "interval": 1}, 40, [25, 15]),  # the paper's one-out-per-step, prompt compacted first
    ({"budget": 16, "interval": 3, "group_reduce": "max"}, 40, [7, 33]),
    ({"budget": 24, "interval": 5, "recent_ratio": 0.25}, 11, [11]),  # prompt under budget: no prefill compaction
    ({"budget": 12, "interval": 1, "group_reduce": "max", "recent_ratio": 0.5}, 9, [4, 5]),
])
def test_runtime_h2o_keeps_and_scores_as_the_native_policy(opts, plen, chunks):
    steps = 30
    ks, vs, qp, qd = _inputs(sum(chunks) + opts["budget"], plen, steps)
    native, compactions = _native(opts, ks, vs, qp, qd, plen)
    mine, rt = _runtime(opts, ks, vs, qp, qd, plen, chunks)
    for s, ((npos, nsc), (mpos, msc)) in enumerate(zip(native, mine, strict=True)):
        assert torch.equal(mpos, npos), f"step {s}: different entries kept"
        torch.testing.assert_close(msc, nsc, rtol=1e-5, atol=1e-6, msg=f"step {s}")
    budget, interval = opts["budget"], opts["interval"]
    led = next(iter(rt.owner.values())).evict_state.ledger
    least = (steps - 1) // interval if plen > budget else (plen + steps - budget - interval) // interval
    assert led.compactions == compactions >= least > 0  # the same schedule, every `interval` steps
    assert max(int(p.shape[-1]) for p, _ in mine) <= budget + interval


def test_scores_move_with_a_request_whose_slot_changed_hands():
    """Park and unpark (a request that left the batch and lost its slot): its scores come back whole
    in the new slot, and the other request's slot starts from zero."""
    ks, vs, qp, qd = _inputs(3, 20, 6)
    _, rt = _runtime({"budget": 16, "interval": 2}, ks, vs, qp, qd, 20, [20])
    st = next(iter(rt.owner.values())).evict_state
    before = rt.h2o.acc[:, st.slot, :, : st.n_phys].clone()
    rt._park(st)
    rt.h2o.acc[:, st.slot].fill_(9.0)  # another request used the slot meanwhile
    st.slot = 1 - st.slot
    rt._unpark(st)
    assert torch.equal(rt.h2o.acc[:, st.slot, :, : st.n_phys], before)
    assert torch.all(rt.h2o.acc[:, st.slot, :, st.n_phys:] == 0)
    fresh = rt.h2o.admit(1 - st.slot, "sum", 5)
    assert torch.all(rt.h2o.acc[:, 1 - st.slot] == 0) and fresh.prefill.shape == (L, HQ, 5)


@pytest.mark.skipif(not hp.HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("opts", [{"budget": 16, "interval": 1}, {"budget": 16, "interval": 4, "group_reduce": "max"}])
def test_the_kernel_path_keeps_and_scores_as_the_native_policy(opts):
    """CUDA's decode path (the Triton kernel reading the persistent row tensors the plan fills; on
    the CPU under TRITON_INTERPRET=1) through the same schedule: the same entries and scores."""
    steps = 12
    ks, vs, qp, qd = _inputs(11, 30, steps)
    native, _ = _native(opts, ks, vs, qp, qd, 30)
    mine, rt = _runtime(opts, ks, vs, qp, qd, 30, [18, 12], kernel=True)
    for s, ((npos, nsc), (mpos, msc)) in enumerate(zip(native, mine, strict=True)):
        assert torch.equal(mpos, npos), f"step {s}"
        torch.testing.assert_close(msc, nsc, rtol=1e-5, atol=1e-6, msg=f"step {s}")
    assert int(rt.h2o.row_mode[0]) == (hp.SUM if opts.get("group_reduce", "sum") == "sum" else hp.MAX)
    assert int(rt.h2o.row_mode[1]) == 0  # the unused row: the kernel leaves it
