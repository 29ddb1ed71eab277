"""H2O's accumulated attention on vLLM's paged cache: one decode step's probabilities added in.

For each batch row flagged (`row_mode` 1: the group's query heads summed into their KV head,
2: their max; 0: not an h2o decode row) and each KV head, the G query heads of its group attend
over the row's entries 0 .. row_len - 1, read in place from vLLM's paged cache through the row's
block table (`key_cache` [blocks, block_size, Hkv, D]); each entry's probability, reduced over the
group, is added to the request's accumulated score `acc[row_slot, kv_head, entry]`
(`acc` [slots, Hkv, max_len] float32, one layer's part of the eviction runtime's score buffer).
This is the native policy's decode step (`attention_parts.decode_probs`, then the group's sum or
max, `policies/h2o.py`) on the paged layout.

Two passes over the keys per (row, KV head): the softmax's max and normaliser, then the
probabilities. One program per (row, KV head) with a fixed grid, so the launch is the same at
every step and can live inside a CUDA graph; what changes per step is only the contents of the
row tensors. A row's slot is its own, so no two programs write the same scores.

`h2o_paged_accumulate_reference` is the plain torch twin; the Triton kernel is tested against it
on random inputs (on the CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

SUM, MAX = 1, 2  # row modes: how a GQA group's probabilities reduce into its KV head


def h2o_paged_accumulate_reference(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                                   row_mode: torch.Tensor, row_slot: torch.Tensor, row_tok: torch.Tensor,
                                   row_len: torch.Tensor, acc: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain torch: q [tokens, Hq, D]; adds into acc [slots, Hkv, max_len] for every flagged row;
    returns acc."""
    hkv = key_cache.shape[2]
    g = q.shape[1] // hkv
    bs = key_cache.shape[1]
    for row in range(row_mode.shape[0]):
        mode = int(row_mode[row])
        if mode not in (SUM, MAX):
            continue
        slot, tok, n = int(row_slot[row]), int(row_tok[row]), int(row_len[row])
        pos = torch.arange(n, device=q.device)
        keys = key_cache[block_table[row, pos // bs].long(), pos % bs].float()  # [n, Hkv, D]
        qg = q[tok].float().view(hkv, g, -1)
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, keys) * scale, dim=-1)  # [Hkv, G, n]
        acc[slot, :, :n] += probs.sum(1) if mode == SUM else probs.amax(1)
    return acc


if HAVE_TRITON:

    @triton.jit
    def _h2o_acc_kernel(Q, KC, BT, ACC, ROW_MODE, ROW_SLOT, ROW_TOK, ROW_LEN, sq_t, sq_h, skc_b, skc_o, skc_h,
                        sbt_r, sa_s, sa_h, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        mode = tl.load(ROW_MODE + row)
        if mode != 0:
            slot = tl.load(ROW_SLOT + row).to(tl.int64)
            tok = tl.load(ROW_TOK + row).to(tl.int64)
            n = tl.load(ROW_LEN + row)
            offs_g = tl.arange(0, GP)
            offs_d = tl.arange(0, D)
            gmask = offs_g < G
            q = tl.load(Q + tok * sq_t + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None],
                        other=0.0)
            q = (q.to(tl.float32) * scale).to(KC.dtype.element_ty)
            m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([GP], dtype=tl.float32)
            for start in range(0, n, BLOCK_N):  # pass 1: the softmax's max and normaliser per query head
                offs_n = start + tl.arange(0, BLOCK_N)
                valid = offs_n < n
                blk = tl.load(BT + row * sbt_r + offs_n // BS, mask=valid, other=0).to(tl.int64)
                k = tl.load(KC + blk[:, None] * skc_b + (offs_n % BS)[:, None] * skc_o + h * skc_h + offs_d[None, :],
                            mask=valid[:, None], other=0.0)
                s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)), -1.0e30)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0), 1)
                m_i = m_new
            inv = 1.0 / tl.maximum(l_i, 1.0e-30)
            base = ACC + slot * sa_s + h * sa_h
            for start in range(0, n, BLOCK_N):  # pass 2: the probabilities, reduced over the group, added in
                offs_n = start + tl.arange(0, BLOCK_N)
                valid = offs_n < n
                blk = tl.load(BT + row * sbt_r + offs_n // BS, mask=valid, other=0).to(tl.int64)
                k = tl.load(KC + blk[:, None] * skc_b + (offs_n % BS)[:, None] * skc_o + h * skc_h + offs_d[None, :],
                            mask=valid[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k))
                p = tl.exp(s - m_i[:, None]) * inv[:, None]
                p = tl.where(gmask[:, None] & valid[None, :], p, 0.0)  # padded heads: 0 (probabilities are >= 0)
                red = tl.where(mode == 1, tl.sum(p, 0), tl.max(p, 0))
                old = tl.load(base + offs_n, mask=valid, other=0.0)
                tl.store(base + offs_n, old + red, mask=valid)


def h2o_paged_accumulate(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor, row_mode: torch.Tensor,
                         row_slot: torch.Tensor, row_tok: torch.Tensor, row_len: torch.Tensor, acc: torch.Tensor,
                         scale: float, rows: int | None = None, block_n: int = 64) -> torch.Tensor:
    """The Triton kernel over `rows` batch rows (default: all of row_mode). Same contract as the
    reference. key_cache may be a strided view; its last dim and acc's must be contiguous."""
    if not HAVE_TRITON:
        return h2o_paged_accumulate_reference(q, key_cache, block_table, row_mode, row_slot, row_tok, row_len, acc,
                                              scale)
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    g = q.shape[1] // hkv
    gp = max(16, triton.next_power_of_2(g))
    rows = row_mode.shape[0] if rows is None else rows
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1 and acc.stride(-1) == 1, "last dims must be contiguous"
    _h2o_acc_kernel[(rows, hkv)](
        q, key_cache, block_table, acc, row_mode, row_slot, row_tok, row_len, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), acc.stride(0),
        acc.stride(1), float(scale), G=g, GP=gp, D=d, BS=key_cache.shape[1], BLOCK_N=block_n)
    return acc
