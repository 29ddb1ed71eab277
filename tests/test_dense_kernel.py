"""`dense` through the C++ CPU kernel (the baseline every speed ratio is quoted against) agrees
with the plain torch reference, and reports which implementation ran."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.kernels import cpu_decode
from cotserve.policies.registry import build_policy

PROMPTS = ["Compute 17 times 23 and explain each step.", "List three prime numbers above 50, then add them."]


def _run(engine, stack, prompts, n=16, forced=None):
    reqs = [GenRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), record_logprobs=True,
                       forced_ids=None if forced is None else forced[i]) for i, p in enumerate(prompts)]
    return engine.generate(reqs, stack)


def test_kernel_dense_equals_torch_dense_to_float_rounding(engine):
    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    prompts = [engine.encode_prompt(p) for p in PROMPTS]  # different lengths: per-slot windows
    kern_stack, torch_stack = build_policy("dense"), build_policy("dense", {"kernel": "torch"})
    kern = _run(engine, kern_stack, prompts)
    ref = _run(engine, torch_stack, prompts, forced=[r.token_ids for r in kern])
    assert kern_stack.parts[0].describe() == {"dense_step": "cpu_kernel"}
    assert torch_stack.parts[0].describe() == {"dense_step": "torch"}
    for a, b in zip(kern, ref, strict=True):
        assert a.greedy_ids == b.greedy_ids
        assert a.logprobs.dtype == torch.float32
        # float32 log-probs over the whole vocabulary: the two differ only by float rounding
        assert float((a.logprobs - b.logprobs).abs().max()) < 1e-3
        top = a.logprobs.argmax(-1, keepdim=True)
        assert float((a.logprobs.gather(1, top) - b.logprobs.gather(1, top)).abs().max()) < 1e-4


def test_kernel_dense_attention_matches_reference_on_ragged_lengths(engine):
    """The kernel call itself against `grouped_attention` on a cache with per-slot lengths."""
    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    from cotserve.kv.batch import BatchState, ModelInfo
    from cotserve.kv.cache import CacheShape, KVCache
    from cotserve.policies.base import PolicyStack, grouped_attention
    from cotserve.policies.dense import kernel_dense_decode

    g = torch.Generator().manual_seed(0)
    cache = KVCache(CacheShape(layers=1, slots=3, kv_heads=2, capacity=70, head_dim=64), torch.float32,
                    torch.device("cpu"))
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.lens[0] = torch.tensor([70, 1, 33])
    info = ModelInfo(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=384, max_positions=128)
    batch = BatchState(info=info, cache=cache, policy=PolicyStack([]), scaling=0.125,
                       prompt_lens=torch.tensor([70, 1, 33]), tokens=[[], [], []])
    q = torch.randn(3, 6, 1, 64, generator=g)
    got = kernel_dense_decode(q, batch, 0)
    k, v, valid = cache.view(0)
    want = grouped_attention(q, k, v, valid.unsqueeze(1), 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dense_rejects_an_unknown_kernel():
    with pytest.raises(PolicyError, match="option .kernel.*.auto. or .torch."):
        build_policy("dense", {"kernel": "cuda"})


def test_ragged_decode_writes_each_row_and_equals_the_one_sequence_kernel_bit_for_bit():
    """The continuous engine's joint dense step: B one-slot caches of different capacities and
    lengths, one call. Each new row lands at its sequence's length (nothing else in the caches
    changes), and the output equals `two_source_decode` on each cache alone, exactly, and the
    torch reference to float rounding."""
    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    from cotserve.policies.base import grouped_attention

    g = torch.Generator().manual_seed(1)
    layers, hkv, grp, d, layer = 3, 2, 3, 64, 1
    caps, lens = [40, 9, 130], [39, 0, 77]  # a full-but-one cache, an empty one, a long one
    kc = [torch.randn(layers, 1, hkv, c, d, generator=g) for c in caps]
    vc = [torch.randn(layers, 1, hkv, c, d, generator=g) for c in caps]
    before_k, before_v = [t.clone() for t in kc], [t.clone() for t in vc]
    q = torch.randn(3, hkv, grp, d, generator=g)
    kn, vn = torch.randn(3, hkv, d, generator=g), torch.randn(3, hkv, d, generator=g)
    out = cpu_decode.ragged_decode(q, kn, vn, kc, vc, layer, torch.tensor(lens), 0.125)
    assert out.shape == (3, hkv, grp, d)
    empty_k, empty_v = q.new_empty(1, hkv, 0, d, 16), q.new_empty(1, hkv, 0, d)
    empty_m = torch.empty(1, hkv, 0, dtype=torch.bool)
    for b, n in enumerate(lens):
        expect_k, expect_v = before_k[b].clone(), before_v[b].clone()
        expect_k[layer, 0, :, n], expect_v[layer, 0, :, n] = kn[b], vn[b]
        assert torch.equal(kc[b], expect_k) and torch.equal(vc[b], expect_v)
        one = cpu_decode.two_source_decode(q[b : b + 1], empty_k, empty_v, empty_m, kc[b][layer], vc[b][layer],
                                           torch.tensor([0]), torch.tensor([n + 1]), 0.125)
        assert torch.equal(out[b : b + 1], one)
        ref = grouped_attention(q[b : b + 1].reshape(1, hkv * grp, 1, d), kc[b][layer, :, :, : n + 1],
                                vc[b][layer, :, :, : n + 1], None, 0.125)
        assert torch.allclose(out[b : b + 1].reshape(1, hkv * grp, 1, d), ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="KV cache full"):
        cpu_decode.ragged_decode(q, kn, vn, kc, vc, layer, torch.tensor([40, 0, 0]), 0.125)


def test_continuous_dense_rows_attend_jointly_and_match_decoding_alone(engine):
    """Several dense sequences of different prompt lengths in one continuous pool take the joint
    kernel step (every decode row through one `ragged_decode` call per layer) and give, token for
    token, what each gives decoding alone in the static engine; their caches start at the prompt
    plus 4 entries and grow twice on the way (a cache that failed to grow would raise "KV cache
    full", one that lost entries would change the tokens)."""
    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    from cotserve.engine.continuous import ContinuousEngine, _Rows

    joint_rows: list[int] = []
    init = _Rows.__init__

    def spy(self, seqs, mode, *a, **kw):  # records how many rows took the joint step
        init(self, seqs, mode, *a, **kw)
        if mode == "decode":
            joint_rows.append(len(self.joint))

    prompts = [engine.encode_prompt(p) for p in [*PROMPTS, "Why is the sky blue?"]]
    reqs = [GenRequest(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    _Rows.__init__ = spy
    try:
        got = ContinuousEngine(engine, slots=3, grow=4).generate(reqs, "dense")
    finally:
        _Rows.__init__ = init
    assert max(joint_rows) == 3  # three sequences shared a joint step
    for r, c in zip(reqs, got, strict=True):
        alone = engine.generate([GenRequest(r.prompt_ids, r.sampling)], "dense")[0]
        assert c.token_ids == alone.token_ids and len(c.token_ids) == 12
        assert c.telemetry["kv_bytes_final"] == alone.telemetry["kv_bytes_final"]
        # grown to the whole sequence, never past what the static engine allocates for it
        assert c.telemetry["kv_bytes_final"] <= c.telemetry["kv_bytes_allocated"] <= alone.telemetry["kv_bytes_allocated"]
