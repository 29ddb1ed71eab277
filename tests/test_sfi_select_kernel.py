"""The fused SFI selector (kernels/sfi_select.py) and the paged re-pack (kernels/sfi_paged.py)
against their torch forms, on random inputs (on the CPU through TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cotserve.kernels import sfi_select as ss
from cotserve.policies import selector as sel
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.policy import selector_scores_from_evidence

pytestmark = pytest.mark.skipif(not ss.HAVE_TRITON, reason="triton not installed")

BASE = SFIConfig(sinks=4, recent=16, k=24)


def selector_scores_reference(cfg, logits, norms, now):
    """The torch form: `cotserve.policies`' evidence and selector steps 2-4 on the same inputs."""
    bsz, h, r, n = logits.shape
    x = logits.clone()
    x[..., : cfg.sinks] = float("-inf")
    f, _ = sel.evidence_and_instability(x.view(bsz, h, 1, r, n), cfg.alpha, cfg.k, cfg.recent, 0, False)
    pos = torch.arange(n, device=logits.device).expand(bsz, h, n)
    return selector_scores_from_evidence(cfg, f, pos, norms, now)


def _inputs(seed: int, b: int, h: int, r: int, n: int, causal: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, r, n, generator=gen) * 3.0
    if causal:  # the last `causal` rows see one entry less each (a bootstrap's tail)
        for i in range(causal):
            logits[:, :, r - 1 - i, n - 1 - i :] = float("-inf")
    norms = torch.rand(b, h, n, generator=gen) * 4.0 + 0.1
    return logits, norms


@pytest.mark.parametrize("opts", [
    {},
    {"lam": 0.3},
    {"nms_window": 3, "nms_strength": 0.8},
    {"nms_strength": 0.0, "excl_strength": 0.0},
    {"norm_power": 0.0, "brake": 1.0},
    {"alpha": 1.0, "tail": 5, "decay": 2.0},
])
@pytest.mark.parametrize("shape", [(3, 4, 4, 40, 0), (2, 8, 12, 131, 3)])
def test_fused_selector_matches_torch(opts, shape):
    cfg = dataclasses.replace(BASE, **opts)
    assert ss.fused_supported(cfg)
    b, h, r, n, causal = shape
    logits, norms = _inputs(n + len(opts), b, h, r, n, causal)
    now = n - 1
    want = selector_scores_reference(cfg, logits, norms, now)
    got = ss.selector_scores(cfg, logits.clone(), norms, now)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert not fin[..., : cfg.sinks].any() and fin[..., cfg.sinks :].all()
    assert torch.allclose(got[fin], want[fin], atol=2e-4, rtol=1e-4), (got[fin] - want[fin]).abs().max()
    k = min(cfg.k, n - cfg.sinks)
    a, c = ss.topk_sorted(got, k), ss.topk_sorted(want, k)
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.flatten(0, 1), c.flatten(0, 1), strict=True))
    assert same >= 0.98 * a.numel()
    assert torch.all(a[..., 1:] > a[..., :-1])  # ascending, no repeats


def test_fused_selector_reacts_to_the_evidence():
    """A key that every row attends to strongly is selected by every head that sees it."""
    logits, norms = _inputs(7, 1, 4, 4, 64)
    logits[:, :, :, 20] = 30.0
    got = ss.selector_scores(BASE, logits, norms, 63)
    assert torch.all(got.argmax(-1) == 20)


def test_unsupported_options_are_reported():
    assert not ss.fused_supported(dataclasses.replace(BASE, fusion="linear"))
    assert not ss.fused_supported(dataclasses.replace(BASE, alpha=0.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_selector_cuda_real_shapes():
    """Qwen3-4B's 8 KV heads x 4 query rows, 8,192 entries, 6 problems (layers x requests), on the GPU."""
    cfg = SFIConfig()
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 8, 4, 8192, generator=gen) * 4.0).cuda()
    norms = (torch.rand(6, 8, 8192, generator=gen) * 4.0 + 0.1).cuda()
    want = selector_scores_reference(cfg, logits, norms, 8191)
    got = ss.selector_scores(cfg, logits.clone(), norms, 8191)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert torch.allclose(got[fin], want[fin], atol=2e-4, rtol=1e-4)
    a, c = ss.topk_sorted(got, cfg.k), ss.topk_sorted(want, cfg.k)
    member = torch.zeros_like(got, dtype=torch.bool).scatter_(-1, c, True)
    assert member.gather(-1, a).float().mean() > 0.99
