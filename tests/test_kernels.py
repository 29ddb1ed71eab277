"""Two-source decode attention: Triton kernel (interpreter on CPU) and the vectorised torch path
against the plain torch reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from cotserve.kernels.decode_attention import (
    HAVE_TRITON,
    decode_attention_reference,
    decode_attention_torch,
    decode_attention_triton,
)


def random_case(seed: int, b=3, hkv=2, g=3, d=16, s1=20, s2=40, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, d, generator=gen, dtype=dtype)
    k1 = torch.randn(b, hkv, s1, d, generator=gen, dtype=dtype)
    v1 = torch.randn(b, hkv, s1, d, generator=gen, dtype=dtype)
    k2 = torch.randn(b, hkv, s2, d, generator=gen, dtype=dtype)
    v2 = torch.randn(b, hkv, s2, d, generator=gen, dtype=dtype)
    len1 = torch.randint(0, s1 + 1, (b, hkv), generator=gen)
    start2 = torch.randint(0, s2 // 2, (b, hkv), generator=gen)
    len2 = torch.randint(0, s2 // 2 + 1, (b, hkv), generator=gen)
    skip = torch.rand(b, hkv, generator=gen) < 0.25
    len1[0, 0], len2[0, 0], skip[0, 0] = 0, 0, False  # an empty row must give zeros, not NaN
    return q, k1, v1, len1, k2, v2, start2, len2, skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_path_matches_reference(seed):
    args = random_case(seed)
    ref = decode_attention_reference(*args, scale=0.25)
    out = decode_attention_torch(*args, scale=0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("seed", [3, 4])
def test_triton_kernel_matches_reference(seed):
    args = random_case(seed, g=3, d=16, s1=37, s2=70)
    ref = decode_attention_reference(*args, scale=0.25)
    out = decode_attention_triton(*args, scale=0.25, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_skipped_groups_are_exactly_zero_and_dense_case():
    q, k1, v1, len1, k2, v2, start2, len2, skip = random_case(5)
    skip[:] = False
    skip[1, 1] = True
    out = decode_attention_torch(q, k1, v1, torch.zeros_like(len1), k2, v2, torch.zeros_like(start2),
                                 torch.full_like(len2, k2.shape[2]), skip, 0.25)
    g = q.shape[1] // k2.shape[1]
    assert torch.count_nonzero(out[1, g : 2 * g]) == 0
    # the non-skipped rows equal plain softmax attention over the whole second source
    qh = q[0, :g]
    dense = torch.softmax(qh @ k2[0, 0].T * 0.25, -1) @ v2[0, 0]
    torch.testing.assert_close(out[0, :g], dense, rtol=1e-5, atol=1e-5)
