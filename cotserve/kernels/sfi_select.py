"""SFI's selector (evidence, prior, fusion, soft-NMS, cross-head exclusivity) fused for the GPU.

A refresh turns each KV head's logits of the observation rows over the whole history into a score
per entry, then keeps the top K. The torch form (`cotserve.policies.selector`, steps 1-4) runs a
few dozen passes over `[..., H, n]` float32 tensors; here the same values come from two kernels
(the torch form is their reference):

* `_head_kernel`, one program per (problem, KV head), four passes over n: (A) each row's softmax
  statistics and the key-norm mean, (B) the evidence (power mean of the row softmaxes) and the
  prior's log-factors, with their sums, (C) the stability weight lambda*, (D) the fused log score
  and its log-normalizer. Scratch: two float32 values per entry.
* `_mix_kernel`, one program per (problem, block of entries) over all KV heads of the layer:
  normalized log scores, soft-NMS within each head, exclusivity across the heads.

Positions are the entry indices (`0..n-1`, as in vLLM's paged cache), candidates those from
`sinks` on; `logits [B, H, R, n]` are already -inf wherever a row may not look (causal), as the
torch form expects. The paper's geometric fusion and alpha > 0 only: other options take the torch
form (`fused_supported`). Tested against the torch form on random inputs
(`tests/test_sfi_select_kernel.py`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

TINY = 1e-30
LOWEST = -3.4028234663852886e38  # torch.finfo(torch.float32).min


def fused_supported(cfg) -> bool:
    """Whether `selector_scores` serves these SFI options (else the torch form must)."""
    return (HAVE_TRITON and cfg.fusion == "geometric" and cfg.alpha > 0 and 0 <= cfg.nms_window <= 8)


if HAVE_TRITON:
    K_TINY = tl.constexpr(TINY)
    K_LOWEST = tl.constexpr(LOWEST)


    @triton.jit(do_not_specialize=["n", "R", "sinks", "now"])
    def _head_kernel(L, NORM, F, T, STATS, n, R, sinks, now, alpha, decay, tail, brake, norm_power, lam_fixed,
                     lam_clip, sl_b, sl_h, sl_r, sn_b, sn_h, sf_b, sf_h, H: tl.constexpr, RP: tl.constexpr,
                     BLOCK: tl.constexpr, USE_TAIL: tl.constexpr, USE_NORM: tl.constexpr):
        pid = tl.program_id(0)
        b = (pid // H).to(tl.int64)
        h = pid % H
        offs_r = tl.arange(0, RP)
        rmask = offs_r < R
        lbase = L + b * sl_b + h * sl_h + offs_r[:, None] * sl_r
        nbase = NORM + b * sn_b + h * sn_h
        fbase = F + b * sf_b + h * sf_h
        tbase = T + b * sf_b + h * sf_h
        # (A) per row: max and sum of exp over the allowed entries; the candidates' key-norm sum
        m = tl.full([RP], -1.0e30, dtype=tl.float32)
        z = tl.zeros([RP], dtype=tl.float32)
        nsum = tl.zeros([BLOCK], dtype=tl.float32)
        ncnt = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < n
            cand = inb & (offs >= sinks)
            x = tl.load(lbase + offs[None, :], mask=rmask[:, None] & cand[None, :], other=float("-inf"))
            ok = x > -1.0e30
            m_new = tl.maximum(m, tl.max(tl.where(ok, x, -1.0e30), 1))
            z = z * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(x - m_new[:, None]), 0.0), 1)
            m = m_new
            if USE_NORM:
                nv = tl.maximum(tl.load(nbase + offs, mask=cand, other=1.0), K_TINY)
                nsum += tl.where(cand, nv, 0.0)
                ncnt += tl.where(cand, 1.0, 0.0)
        # row weights: Z^-alpha / rows (a row with nothing allowed counts zero)
        w = tl.where(z > 0, tl.exp(-alpha * tl.log(tl.maximum(z, K_TINY))), 0.0) / R
        w = tl.where(rmask, w, 0.0)
        nmean = tl.maximum(tl.sum(nsum, 0) / tl.maximum(tl.sum(ncnt, 0), 1.0), K_TINY)
        nowf = now.to(tl.float32)
        # (B) evidence f_u = (sum_r w_r e_r)^(1/alpha); prior log-factors t; sum f_u; logsumexp t
        fsum = tl.zeros([BLOCK], dtype=tl.float32)
        tm = tl.full([BLOCK], -1.0e30, dtype=tl.float32)
        ts = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < n
            cand = inb & (offs >= sinks)
            x = tl.load(lbase + offs[None, :], mask=rmask[:, None] & cand[None, :], other=float("-inf"))
            ok = x > -1.0e30
            e = tl.where(ok, tl.exp(alpha * (x - m[:, None])), 0.0)
            s = tl.maximum(tl.sum(e * w[:, None], 0), 0.0)
            fu = tl.where(s > 0, tl.exp(tl.log(tl.maximum(s, K_TINY)) / alpha), 0.0)
            fu = tl.where(cand, fu, 0.0)
            fsum += fu
            d = tl.maximum(nowf - offs.to(tl.float32), 0.0)
            t = -decay * d / tl.maximum(nowf, 1.0)
            if USE_TAIL:
                ramp = brake + (1.0 - brake) * tl.minimum(d / tail, 1.0)
                t += tl.log(tl.maximum(ramp, K_TINY))
            if USE_NORM:
                nv = tl.maximum(tl.load(nbase + offs, mask=cand, other=1.0), K_TINY)
                t += -norm_power * tl.log(nv / nmean)
            t = tl.where(cand, t, -1.0e30)
            tm_new = tl.maximum(tm, t)
            ts = ts * tl.exp(tm - tm_new) + tl.where(cand, tl.exp(t - tm_new), 0.0)
            tm = tm_new
            tl.store(fbase + offs, fu, mask=inb)
            tl.store(tbase + offs, t, mask=inb)
        fnorm = tl.maximum(tl.sum(fsum, 0), K_TINY)
        tmax = tl.max(tm, 0)
        tlse = tmax + tl.log(tl.maximum(tl.sum(ts * tl.exp(tm - tmax), 0), K_TINY))
        # (C) lambda* = <f, f - r> / ||f - r||^2, clipped (or the fixed lambda)
        num = tl.zeros([BLOCK], dtype=tl.float32)
        den = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < n
            cand = inb & (offs >= sinks)
            f = tl.load(fbase + offs, mask=inb, other=0.0) / fnorm
            r = tl.where(cand, tl.exp(tl.load(tbase + offs, mask=inb, other=-1.0e30) - tlse), 0.0)
            diff = f - r
            num += f * diff
            den += diff * diff
        numt = tl.sum(num, 0)
        dent = tl.sum(den, 0)
        lam = tl.where(dent > 0, numt / tl.maximum(dent, K_TINY), 0.0)
        lam = tl.minimum(tl.maximum(lam, 0.0), lam_clip)
        if lam_fixed >= 0:
            lam = lam_fixed
        # (D) fused log score u = (log f + lam log r) / (1 + lam) and its logsumexp
        um = tl.full([BLOCK], -1.0e30, dtype=tl.float32)
        us = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < n
            cand = inb & (offs >= sinks)
            f = tl.load(fbase + offs, mask=inb, other=0.0) / fnorm
            r = tl.where(cand, tl.exp(tl.load(tbase + offs, mask=inb, other=-1.0e30) - tlse), 0.0)
            u = (tl.log(tl.maximum(f, K_TINY)) + lam * tl.log(tl.maximum(r, K_TINY))) / (1.0 + lam)
            u = tl.where(cand, u, -1.0e30)
            um_new = tl.maximum(um, u)
            us = us * tl.exp(um - um_new) + tl.where(cand, tl.exp(u - um_new), 0.0)
            um = um_new
            tl.store(fbase + offs, u, mask=inb)
        umax = tl.max(um, 0)
        ulse = umax + tl.log(tl.maximum(tl.sum(us * tl.exp(um - umax), 0), K_TINY))
        tl.store(STATS + pid, ulse)

    @triton.jit
    def _shifted(fb, stats, offs_h, hmask, offs, n, sinks, d: tl.constexpr):
        """Normalized log scores at positions offs + d, clamped to float32's lowest (as the padding)."""
        p = offs + d
        ok = (p >= sinks) & (p < n)
        u = tl.load(fb + p[None, :], mask=hmask[:, None] & ok[None, :], other=-1.0e30)
        x = tl.where(ok[None, :], u - stats[:, None], K_LOWEST)
        return tl.where(x < -1.0e30, K_LOWEST, x)

    @triton.jit(do_not_specialize=["n", "sinks"])
    def _mix_kernel(F, STATS, OUT, n, sinks, nms_strength, excl_strength, excl_temp, sf_b, sf_h,
                    H: tl.constexpr, HP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, EXCL: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offs_h = tl.arange(0, HP)
        hmask = offs_h < H
        fb = F + b * sf_b + offs_h[:, None] * sf_h
        stats = tl.load(STATS + b * H + offs_h, mask=hmask, other=0.0)
        inb = offs < n
        cand = (offs >= sinks) & inb
        x0 = _shifted(fb, stats, offs_h, hmask, offs, n, sinks, 0)
        x = tl.where(cand[None, :], x0, float("-inf"))
        y = x
        if W > 0:
            mx = x0
            for d in tl.static_range(1, W + 1):
                mx = tl.maximum(mx, _shifted(fb, stats, offs_h, hmask, offs, n, sinks, d))
                mx = tl.maximum(mx, _shifted(fb, stats, offs_h, hmask, offs, n, sinks, -d))
            pen = tl.zeros([HP, BLOCK], dtype=tl.float32)
            for i in tl.static_range(0, W):
                d = W - i  # farthest first: nearer hits overwrite
                hit = (_shifted(fb, stats, offs_h, hmask, offs, n, sinks, -d) == mx) | (
                    _shifted(fb, stats, offs_h, hmask, offs, n, sinks, d) == mx)
                pen = tl.where(hit, nms_strength * (1.0 - d / (W + 1.0)), pen)
            pen = tl.where(x0 == mx, 0.0, pen)
            y = x - pen
        if EXCL:
            xc = tl.where(hmask[:, None], tl.maximum(y, -1.0e30) / excl_temp, -3.0e38)
            rel = tl.exp(xc - tl.max(xc, 0)[None, :])
            y = y - excl_strength * (1.0 - rel)
        tl.store(OUT + b * sf_b + offs_h[:, None] * sf_h + offs[None, :], y, mask=hmask[:, None] & inb[None, :])


def selector_scores(cfg, logits: torch.Tensor, norms: torch.Tensor, now: int, out: torch.Tensor | None = None,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The selector's final log scores `[B, H, n]` float32 (before top-K) from `logits [B, H, R, n]`
    (float32, -inf where a row may not look) and key norms `[B, H, n]`; positions are 0..n-1 and
    `now` the newest row's position. Same values as the torch selector (`cotserve.policies`) up to float
    rounding. `cfg` is an SFIConfig with `fused_supported(cfg)`."""
    bsz, h, r, n = logits.shape
    assert logits.stride(-1) == 1 and norms.stride(-1) == 1
    dev = logits.device
    n16 = -(-n // 16) * 16  # rows padded to 16 entries: strides stay multiples of 16 (one compiled variant)
    f = scratch if scratch is not None else torch.empty(bsz, h, n16, dtype=torch.float32, device=dev)[..., :n]
    t = out if out is not None else torch.empty(bsz, h, n16, dtype=torch.float32, device=dev)[..., :n]
    stats = torch.empty(bsz * h, dtype=torch.float32, device=dev)
    rp = max(2, triton.next_power_of_2(r))
    block = max(64, min(1024, 4096 // rp))
    tail = float(cfg.tail_len)
    _head_kernel[(bsz * h,)](logits, norms, f, t, stats, n, r, cfg.sinks, now, float(cfg.alpha), float(cfg.decay),
                             max(tail, 1.0), float(cfg.brake), float(cfg.norm_power), float(cfg.lam),
                             float(cfg.lam_clip), logits.stride(0), logits.stride(1), logits.stride(2),
                             norms.stride(0), norms.stride(1), f.stride(0), f.stride(1), H=h, RP=rp, BLOCK=block,
                             USE_TAIL=tail > 0 and cfg.brake < 1.0, USE_NORM=cfg.norm_power != 0.0)
    mblock = 256
    hp = max(2, triton.next_power_of_2(h))
    excl = cfg.excl_strength != 0.0 and h >= 2
    # `t` (the prior's scratch) is free again: it takes the output
    _mix_kernel[(bsz, triton.cdiv(n, mblock))](f, stats, t, n, cfg.sinks, float(cfg.nms_strength),
                                               float(cfg.excl_strength), float(cfg.excl_temperature), f.stride(0),
                                               f.stride(1), H=h, HP=hp,
                                               W=cfg.nms_window if cfg.nms_strength != 0.0 else 0, BLOCK=mblock,
                                               EXCL=excl)
    return t


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k entries per row of `scores [..., n]`, as indices sorted ascending (long)."""
    return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values
