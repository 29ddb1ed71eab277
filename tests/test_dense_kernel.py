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
    from cotserve.engine.batch import BatchState, ModelInfo
    from cotserve.engine.cache import CacheShape, KVCache
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
