"""CUDA-only agreement checks (skipped without a GPU; run on the lent H200):
the Triton kernel on the GPU and the CUDA-graph decode path against their references."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_gpu_matches_reference(dtype):
    from cotserve.kernels.decode_attention import decode_attention_reference, decode_attention_triton

    gen = torch.Generator().manual_seed(0)
    b, hkv, g, d, s1, s2 = 4, 8, 4, 128, 300, 1000
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    k1, v1 = (torch.randn(b, hkv, s1, d, generator=gen).to(dtype) for _ in range(2))
    k2, v2 = (torch.randn(b, hkv, s2, d, generator=gen).to(dtype) for _ in range(2))
    len1 = torch.randint(0, s1 + 1, (b, hkv), generator=gen)
    start2 = torch.randint(0, s2 // 2, (b, hkv), generator=gen)
    len2 = torch.randint(1, s2 // 2, (b, hkv), generator=gen)
    skip = torch.rand(b, hkv, generator=gen) < 0.3
    args = (q, k1, v1, len1, k2, v2, start2, len2, skip)
    ref = decode_attention_reference(*(a.double() if a.is_floating_point() else a for a in args), scale=d**-0.5)
    out = decode_attention_triton(*(a.cuda() for a in args), scale=d**-0.5).cpu().double()
    rel = (out - ref).norm() / ref.norm()
    assert rel < (1e-3 if dtype == torch.float32 else 1e-2), float(rel)


def test_cuda_graph_decode_matches_eager():
    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.engine.sampling import SamplingParams
    from cotserve.models import load_random_model

    loaded = load_random_model("smollm2-135m", device="cuda", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (37, 80, 5)]

    def run(graphs: bool):
        eng = NativeEngine(loaded, cuda_graphs=graphs)
        reqs = [GenRequest(p, SamplingParams(max_tokens=24, ignore_eos=True), record_logprobs=True) for p in prompts]
        return eng.generate(reqs)

    eager, graphed = run(False), run(True)
    assert "cuda_graph_capture_s" in graphed[0].telemetry
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.logprobs.float() - b.logprobs.float()).abs().max() < 1e-2


def test_sfi_in_the_cuda_graph_matches_the_eager_policy():
    """Native SFI on CUDA: by default the engine captures its decode step (the paged runtime,
    `policies/sfi/graph.py`); the eager policy (`kernel=torch`) is the reference. Same tokens,
    same trigger decisions, log-probs to float rounding (TF32 products in the kernels)."""
    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.engine.sampling import SamplingParams
    from cotserve.models import load_random_model
    from cotserve.policies.registry import build_policy

    loaded = load_random_model("smollm2-135m", device="cuda", dtype="float32")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (300, 170, 64)]
    opts = {"k": 32, "recent": 16, "max_interval": 5}

    def run(kernel: str):
        stack = build_policy("sfi", {**opts, "kernel": kernel})
        reqs = [GenRequest(p, SamplingParams(max_tokens=24, ignore_eos=True), record_logprobs=True) for p in prompts]
        return NativeEngine(loaded).generate(reqs, stack), stack

    (eager, es), (graphed, gs) = run("torch"), run("auto")
    assert gs.parts[0].describe()["fast_step"] == "paged_triton" and "cuda_graph_capture_s" in graphed[0].telemetry
    assert es.parts[0].describe()["fast_step"] == "torch" and "cuda_graph_capture_s" not in eager[0].telemetry
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
        assert a.telemetry["sfi_slow_steps"] == b.telemetry["sfi_slow_steps"] >= 4
        # the Triton kernels' float32 products run as TF32 on the GPU (10-bit mantissa)
        diff = float((a.logprobs.float() - b.logprobs.float()).abs().max())
        print("sfi graph vs eager: max log-prob difference", diff)
        assert diff < 5e-2
