"""Two-source GQA decode attention: one query token per slot attends over two KV segments.

One kernel serves three decode paths of the native engine:

* dense: source 1 empty, source 2 = the whole cache of the slot;
* SFI fast step (Slow-Fast Inference, fast step): source 1 = the compact buffer of sink +
  selected entries (re-packed at slow steps), source 2 = the recent window read in place from
  the main cache; one softmax over both (online softmax, so the sources are never concatenated);
* SinkRouter: a per-(slot, KV group) skip flag writes the zero surrogate and reads no K/V at all
  (SinkRouter, Sec. 3: sink groups' outputs are replaced by zero; their history is not read).

Shapes (D = head_dim, G = query heads per KV head):
  q      [B, Hkv*G, D]
  k1, v1 [B, Hkv, S1, D]   len1 [B, Hkv]            entries 0..len1-1 are read
  k2, v2 [B, Hkv, S2, D]   start2, len2 [B, Hkv]    entries start2..start2+len2-1 are read
  skip   [B, Hkv] (bool/int)                          nonzero: output 0, nothing read
  out    [B, Hkv*G, D]

`decode_attention_reference` is the plain torch twin (loops, obviously right);
`decode_attention_torch` is the vectorised torch path used on CPU; `decode_attention` picks the
Triton kernel on CUDA. Tests run the kernel on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch reference covers every platform
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def decode_attention_reference(q, k1, v1, len1, k2, v2, start2, len2, skip, scale: float) -> torch.Tensor:
    """Plain torch: gather the two segments per (slot, KV head), softmax over their union."""
    b, hq, d = q.shape
    hkv = k2.shape[1]
    g = hq // hkv
    out = torch.zeros_like(q)
    for i in range(b):
        for h in range(hkv):
            if bool(skip[i, h]):
                continue
            n1, s2, n2 = int(len1[i, h]), int(start2[i, h]), int(len2[i, h])
            keys = torch.cat([k1[i, h, :n1], k2[i, h, s2 : s2 + n2]], 0).float()
            vals = torch.cat([v1[i, h, :n1], v2[i, h, s2 : s2 + n2]], 0).float()
            if keys.shape[0] == 0:
                continue
            qh = q[i, h * g : (h + 1) * g].float()
            probs = torch.softmax(qh @ keys.T * scale, dim=-1)
            out[i, h * g : (h + 1) * g] = (probs @ vals).to(q.dtype)
    return out


def decode_attention_torch(q, k1, v1, len1, k2, v2, start2, len2, skip, scale: float) -> torch.Tensor:
    """Vectorised torch path (CPU fallback): both segments masked and softmaxed together."""
    b, hq, d = q.shape
    hkv = k2.shape[1]
    g = hq // hkv
    qg = q.view(b, hkv, g, d)
    s1 = torch.matmul(qg, k1.transpose(-1, -2)).float() * scale  # [B, Hkv, G, S1]
    s2 = torch.matmul(qg, k2.transpose(-1, -2)).float() * scale  # [B, Hkv, G, S2]
    i1 = torch.arange(k1.shape[2], device=q.device)
    i2 = torch.arange(k2.shape[2], device=q.device)
    m1 = i1.view(1, 1, -1) < len1.unsqueeze(-1)
    m2 = (i2.view(1, 1, -1) >= start2.unsqueeze(-1)) & (i2.view(1, 1, -1) < (start2 + len2).unsqueeze(-1))
    scores = torch.cat([s1.masked_fill(~m1.unsqueeze(2), float("-inf")),
                        s2.masked_fill(~m2.unsqueeze(2), float("-inf"))], dim=-1)
    empty = ~(m1.any(-1) | m2.any(-1)) | skip.bool()  # [B, Hkv]
    scores = scores.masked_fill(empty.view(b, hkv, 1, 1), 0.0)
    probs = torch.softmax(scores, dim=-1).to(v1.dtype)
    out = torch.matmul(probs[..., : k1.shape[2]], v1) + torch.matmul(probs[..., k1.shape[2] :], v2)
    out = out.masked_fill(empty.view(b, hkv, 1, 1), 0.0)
    return out.reshape(b, hq, d)


if HAVE_TRITON:

    @triton.jit
    def _attend_segment(q, acc, m_i, l_i, K, V, base_k, base_v, start, n, stride_ks, stride_vs, scale,
                        offs_d, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        for blk in range(0, n, BLOCK_N):
            offs_n = blk + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n
            k = tl.load(K + base_k + (start + offs_n)[:, None] * stride_ks + offs_d[None, :],
                        mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + base_v + (start + offs_n)[:, None] * stride_vs + offs_d[None, :],
                        mask=mask_n[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _two_source_kernel(Q, K1, V1, K2, V2, Out, LEN1, START2, LEN2, SKIP, scale,
                           sqb, sqh, sk1b, sk1h, sk1s, sv1b, sv1h, sv1s,
                           sk2b, sk2h, sk2s, sv2b, sv2h, sv2s, sob, soh, HKV,
                           G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                           PRECISION: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        mask_g = offs_g < G
        heads = h * G + offs_g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        skip = tl.load(SKIP + b * HKV + h)
        if skip == 0:
            n1 = tl.load(LEN1 + b * HKV + h)
            acc, m_i, l_i = _attend_segment(q, acc, m_i, l_i, K1, V1, b * sk1b + h * sk1h, b * sv1b + h * sv1h,
                                            0, n1, sk1s, sv1s, scale, offs_d, BLOCK_N, PRECISION)
            s2 = tl.load(START2 + b * HKV + h)
            n2 = tl.load(LEN2 + b * HKV + h)
            acc, m_i, l_i = _attend_segment(q, acc, m_i, l_i, K2, V2, b * sk2b + h * sk2h, b * sv2b + h * sv2h,
                                            s2, n2, sk2s, sv2s, scale, offs_d, BLOCK_N, PRECISION)
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(Out + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask_g[:, None])


def decode_attention_triton(q, k1, v1, len1, k2, v2, start2, len2, skip, scale: float,
                            block_n: int = 64) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k2.shape[1]
    g = hq // hkv
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16 for the Triton kernel")
    for t in (k1, v1, k2, v2):
        if t.stride(-1) != 1:
            raise ValueError("K/V must be contiguous in head_dim")
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty_like(q)
    as_i32 = [x.to(torch.int32).contiguous() for x in (len1, start2, len2, skip)]
    block_g = max(16, triton.next_power_of_2(g))
    _two_source_kernel[(b, hkv)](
        q, k1, v1, k2, v2, out, *as_i32, scale,
        q.stride(0), q.stride(1),
        k1.stride(0), k1.stride(1), k1.stride(2), v1.stride(0), v1.stride(1), v1.stride(2),
        k2.stride(0), k2.stride(1), k2.stride(2), v2.stride(0), v2.stride(1), v2.stride(2),
        out.stride(0), out.stride(1), hkv,
        G=g, BLOCK_G=block_g, BLOCK_N=block_n, D=d,
        # float32 inputs keep full precision (no tf32); bf16/fp16 use the tensor cores as they are
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def decode_attention(q, k1, v1, len1, k2, v2, start2, len2, skip, scale: float) -> torch.Tensor:
    """The Triton kernel on CUDA, else the vectorised torch path."""
    if q.device.type == "cuda" and HAVE_TRITON:
        return decode_attention_triton(q, k1, v1, len1, k2, v2, start2, len2, skip, scale)
    return decode_attention_torch(q, k1, v1, len1, k2, v2, start2, len2, skip, scale)
