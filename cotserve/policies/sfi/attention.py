"""SFI's two attention steps, batched tensor ops only (no loops over heads).

Fast step (SFI, Sec. "Fast step"): each KV head reads a contiguous compact buffer holding its
sink + selected K/V (re-packed once per slow step, never gathered per step) plus the recent
window, read in place from the main cache. Both parts go through ONE softmax (their logits are
concatenated), so the result is exactly attention over the union of the two position sets.
Compact entries that the moving recent window now covers are masked out, so no position is
counted twice.

Slow step (SFI, Sec. "Slow step"): dense attention over the whole history for the current query,
which also returns the logits of the observation-window queries the selector needs.
"""

from __future__ import annotations

import torch


def fast_attention(q: torch.Tensor, ckt: torch.Tensor, cv: torch.Tensor, cmask: torch.Tensor, wk: torch.Tensor,
                   wv: torch.Tensor, wmask: torch.Tensor, scaling: float) -> torch.Tensor:
    """One decode token's attention over compact buffer + recent window, one softmax.

    q [B, Hq, 1, D]; ckt [B, Hkv, D, C] compact sink+selected keys, stored transposed (q.K^T is
    then a plain matmul); cv [B, Hkv, C, D] their values; cmask bool [B, Hkv, C] (read);
    wk/wv [B, Hkv, W, D] recent-window slice of the cache; wmask bool [B, 1 or Hkv, W].
    Returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv = ckt.shape[1]
    g = hq // hkv
    qg = q.view(b, hkv, g, d)
    sc = torch.matmul(qg, ckt)  # [B, Hkv, G, C]
    sw = torch.matmul(qg, wk.transpose(-1, -2))  # [B, Hkv, G, W]
    sc = sc.masked_fill_(~cmask.unsqueeze(2), float("-inf"))
    sw = sw.masked_fill_(~wmask.unsqueeze(2), float("-inf"))
    s = torch.cat([sc, sw], dim=-1).mul_(scaling)
    p = torch.softmax(s.float(), dim=-1).to(cv.dtype)
    c = ckt.shape[-1]
    out = torch.matmul(p[..., :c], cv)
    out = out.add_(torch.matmul(p[..., c:], wv))
    return out.view(b, hq, 1, d)


def fast_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, read: torch.Tensor,
                             scaling: float) -> torch.Tensor:
    """Plain reference: attention of q [B, Hq, 1, D] over the cache entries k/v [B, Hkv, S, D]
    that each KV head reads (`read` bool [B, Hkv, S]), one head at a time."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            j = h // g
            idx = read[bi, j].nonzero().flatten()
            logits = (k[bi, j, idx] @ q[bi, h, 0]) * scaling
            out[bi, h, 0] = torch.softmax(logits.float(), -1).to(v.dtype) @ v[bi, j, idx]
    return out


def slow_attention(qrows: torch.Tensor, cur: int, k: torch.Tensor, v: torch.Tensor, scaling: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one sequence's current query over its whole history, plus the logits of
    all observation rows for the selector.

    qrows [Hq, W, D]: the window's queries (row `cur` is the current one, the newest position, so
    it may attend to every entry); k/v [Hkv, S, D] every valid entry. Returns (out [Hq, 1, D],
    logits [Hkv, G, W, S] float32, scaled)."""
    hq, w, d = qrows.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    # the scaling is applied to the few query rows, not to the [rows, S] logits (one pass fewer)
    logits = torch.matmul(qrows.reshape(hkv, g * w, d) * scaling, k.transpose(-1, -2)).float()
    logits = logits.view(hkv, g, w, s)
    p = torch.softmax(logits[:, :, cur], dim=-1).to(v.dtype)  # [Hkv, G, S]
    out = torch.matmul(p, v)  # [Hkv, G, D]
    return out.reshape(hq, 1, d), logits
