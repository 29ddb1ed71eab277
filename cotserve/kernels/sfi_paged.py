"""SFI's fast step on vLLM's paged cache: compact buffer + recent window, one softmax.

For each batch row flagged fast (`row_mode == 1`) and each KV head, the G query heads of its
group attend over two segments in one online softmax:

* the request's compact buffer (`ck`, `cv` [slots, Hkv, C, D], positions `cpos` [slots, Hkv, C]),
  entries read where 0 <= cpos < the row's cutoff (the moving window covers the newer ones): the
  window start, or, for a request whose cache was compacted by an eviction policy, `row_cws`
  [rows, Hkv], the true position of each KV head's first window entry (cpos are true positions
  then, while the window is read by cache index);
* the recent window, positions [ws, n), read in place from vLLM's paged cache through the
  row's block table (`key_cache`, `value_cache` [blocks, block_size, Hkv, D]).

Given `ccount` [slots] (the entries of each compact buffer in use: its sinks and its selection, as
the re-pack leaves them), the compact entries from there on are not read at all: the buffer's
padding past sinks + k costs no bandwidth.

Rows with any other mode are left untouched (vLLM's FlashAttention has written them). Given the
step's ring writes (`ring`), the same launch also copies the step's query rows of SFI requests into
their rings (`ring_write_reference`), the copies spread over its programs. One program
per (row, KV head) with a fixed grid, so the launch is the same at every step and can live inside
a CUDA graph; what changes per step is only the contents of the row tensors.

`sfi_paged_fast_reference` is the plain torch twin (per row and head); the Triton kernel is
tested against it on random inputs (on the CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from cotserve.kernels.sfi_launch import FastLaunch, fast_launch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def sfi_paged_fast_reference(q, out, ck, cv, cpos, key_cache, value_cache, block_table, row_mode, row_slot,
                             row_tok, row_ws, row_len, scale: float, row_cws: torch.Tensor | None = None,
                             ccount: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: q/out [tokens, Hq, D]; writes out[tok] of every fast row; returns out.
    `row_cws` [rows, Hkv]: the compact entries' cutoff per KV head (None: the window start);
    `ccount` [slots]: compact entries in use per slot, those past it unread (None: all C)."""
    hkv = ck.shape[1]
    hq = q.shape[1]
    g = hq // hkv
    bs = key_cache.shape[1]
    for row in range(row_mode.shape[0]):
        if int(row_mode[row]) != 1:
            continue
        slot, tok, ws, n = int(row_slot[row]), int(row_tok[row]), int(row_ws[row]), int(row_len[row])
        pos = torch.arange(ws, n, device=q.device)
        blocks = block_table[row, pos // bs].long()
        for h in range(hkv):
            cut = ws if row_cws is None else int(row_cws[row, h])
            sel = (cpos[slot, h] >= 0) & (cpos[slot, h] < cut)
            if ccount is not None:
                sel &= torch.arange(sel.shape[0], device=sel.device) < int(ccount[slot])
            keys = torch.cat([ck[slot, h][sel], key_cache[blocks, pos % bs, h]], 0).float()
            vals = torch.cat([cv[slot, h][sel], value_cache[blocks, pos % bs, h]], 0).float()
            qh = q[tok, h * g : (h + 1) * g].float()
            p = torch.softmax(qh @ keys.T * scale, dim=-1)
            out[tok, h * g : (h + 1) * g] = (p @ vals).to(out.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def _online_block(q, k, v, valid, m_i, l_i, acc):
        """One block of the online softmax: scores of q [GP, D] against k [N, D], masked by `valid`."""
        s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _compact_range(q, CK, CV, CPOS, slot, h, cut, lo, hi, sck_s, sck_h, sck_c, scv_s, scv_h, scv_c, scp_s,
                       scp_h, m_i, l_i, acc, C: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """Compact entries [lo, min(hi, C)) of (slot, KV head h), read where 0 <= position < cut."""
        offs_d = tl.arange(0, D)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            inb = (offs_n < C) & (offs_n < hi)
            cp = tl.load(CPOS + slot * scp_s + h * scp_h + offs_n, mask=inb, other=-1)
            valid = (cp >= 0) & (cp < cut)
            k = tl.load(CK + slot * sck_s + h * sck_h + offs_n[:, None] * sck_c + offs_d[None, :],
                        mask=inb[:, None], other=0.0)
            v = tl.load(CV + slot * scv_s + h * scv_h + offs_n[:, None] * scv_c + offs_d[None, :],
                        mask=inb[:, None], other=0.0)
            m_i, l_i, acc = _online_block(q, k, v, valid, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _window_range(q, KC, VC, BT, row, h, ws, n, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, sbt_r, m_i, l_i, acc,
                      D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The recent window, positions [ws, n), read in place through the row's block table."""
        offs_d = tl.arange(0, D)
        for start in range(ws, n, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < n
            blk = tl.load(BT + row * sbt_r + offs_n // BS, mask=valid, other=0).to(tl.int64)
            off = offs_n % BS
            k = tl.load(KC + blk[:, None] * skc_b + off[:, None] * skc_o + h * skc_h + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            v = tl.load(VC + blk[:, None] * svc_b + off[:, None] * svc_o + h * svc_h + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _online_block(q, k, v, valid, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _load_q(Q, ROW_TOK, row, h, sq_t, sq_h, scale, dtype: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                D: tl.constexpr):
        tok = tl.load(ROW_TOK + row).to(tl.int64)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + tok * sq_t + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=(offs_g < G)[:, None],
                    other=0.0)
        return (q.to(tl.float32) * scale).to(dtype)

    @triton.jit
    def _ring_writes(Q, RING, W_TOK, W_SLOT, W_IDX, pid, nprog, nw, t, scratch, sq_t, sq_h, sr_s, sr_w, sr_h,
                     D: tl.constexpr, HD: tl.constexpr, WBLOCK: tl.constexpr):
        """The step's ring writes i = pid, pid + nprog, ... < nw (`ring_write_reference`'s contract):
        token W_TOK[i]'s query row (clamped to the last token) into (W_SLOT[i], W_IDX[i]) of this
        layer's ring [slots + 1, W, Hq, D]; writes to the scratch slot are skipped."""
        for i in range(pid, nw, nprog):
            slot = tl.load(W_SLOT + i)
            if slot < scratch:
                tok = tl.minimum(tl.load(W_TOK + i), t - 1).to(tl.int64)
                w = tl.load(W_IDX + i).to(tl.int64)
                for start in tl.static_range(0, HD, WBLOCK):
                    offs = start + tl.arange(0, WBLOCK)
                    ok = offs < HD
                    x = tl.load(Q + tok * sq_t + (offs // D) * sq_h + offs % D, mask=ok)
                    tl.store(RING + slot.to(tl.int64) * sr_s + w * sr_w + (offs // D) * sr_h + offs % D, x, mask=ok)

    @triton.jit(do_not_specialize=["nw", "t", "scratch"])
    def _sfi_fast_kernel(Q, Out, CK, CV, CPOS, KC, VC, BT, ROW_MODE, ROW_SLOT, ROW_TOK, ROW_WS, ROW_LEN,
                         CWS, scw_r, scw_h, CCOUNT, sq_t, sq_h, so_t, so_h, sck_s, sck_h, sck_c, scv_s, scv_h, scv_c, scp_s, scp_h,
                         skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, sbt_r, scale,
                         RING, W_TOK, W_SLOT, W_IDX, nw, t, scratch, sr_s, sr_w, sr_h,
                         C: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, RING_WRITES: tl.constexpr, HD: tl.constexpr,
                         WBLOCK: tl.constexpr, HAS_COUNT: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        if RING_WRITES:
            _ring_writes(Q, RING, W_TOK, W_SLOT, W_IDX, row * tl.num_programs(1) + h,
                         tl.num_programs(0) * tl.num_programs(1), nw, t, scratch, sq_t, sq_h, sr_s, sr_w, sr_h, D, HD,
                         WBLOCK)
        if tl.load(ROW_MODE + row) == 1:
            slot = tl.load(ROW_SLOT + row).to(tl.int64)
            ws = tl.load(ROW_WS + row)
            n = tl.load(ROW_LEN + row)
            q = _load_q(Q, ROW_TOK, row, h, sq_t, sq_h, scale, KC.dtype.element_ty, G, GP, D)
            m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            cws = tl.load(CWS + row * scw_r + h * scw_h)
            hi = C
            if HAS_COUNT:
                hi = tl.minimum(tl.load(CCOUNT + slot), C)
            m_i, l_i, acc = _compact_range(q, CK, CV, CPOS, slot, h, cws, 0, hi, sck_s, sck_h, sck_c, scv_s, scv_h,
                                           scv_c, scp_s, scp_h, m_i, l_i, acc, C, D, BLOCK_N)
            m_i, l_i, acc = _window_range(q, KC, VC, BT, row, h, ws, n, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
                                          sbt_r, m_i, l_i, acc, D, BS, BLOCK_N)
            o = acc / tl.maximum(l_i, 1.0e-30)[:, None]
            tok = tl.load(ROW_TOK + row).to(tl.int64)
            offs_g = tl.arange(0, GP)
            offs_d = tl.arange(0, D)
            tl.store(Out + tok * so_t + (h * G + offs_g)[:, None] * so_h + offs_d[None, :], o.to(Out.dtype.element_ty),
                     mask=(offs_g < G)[:, None])

    @triton.jit(do_not_specialize=["nw", "t", "scratch"])
    def _sfi_fast_split_kernel(Q, CK, CV, CPOS, KC, VC, BT, ROW_MODE, ROW_SLOT, ROW_TOK, ROW_WS, ROW_LEN,
                               CWS, scw_r, scw_h, CCOUNT, PM, PL, PACC, sq_t, sq_h, sck_s, sck_h, sck_c, scv_s, scv_h, scv_c, scp_s, scp_h,
                               skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, sbt_r, scale,
                               RING, W_TOK, W_SLOT, W_IDX, nw, t, scratch, sr_s, sr_w, sr_h,
                               C: tl.constexpr, CHUNK: tl.constexpr, NS: tl.constexpr, G: tl.constexpr,
                               GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                               RING_WRITES: tl.constexpr, HD: tl.constexpr, WBLOCK: tl.constexpr,
                               HAS_COUNT: tl.constexpr):
        """Split s < NS - 1 reads compact entries [s * CHUNK, (s + 1) * CHUNK); split NS - 1 the window.
        Partial (max, sum, acc) per split go to PM/PL [rows, H, NS, GP] and PACC [rows, H, NS, GP, D]."""
        row = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        if RING_WRITES:
            _ring_writes(Q, RING, W_TOK, W_SLOT, W_IDX, (row * tl.num_programs(1) + h) * NS + sp,
                         tl.num_programs(0) * tl.num_programs(1) * NS, nw, t, scratch, sq_t, sq_h, sr_s, sr_w, sr_h, D,
                         HD, WBLOCK)
        if tl.load(ROW_MODE + row) == 1:
            slot = tl.load(ROW_SLOT + row).to(tl.int64)
            ws = tl.load(ROW_WS + row)
            n = tl.load(ROW_LEN + row)
            q = _load_q(Q, ROW_TOK, row, h, sq_t, sq_h, scale, KC.dtype.element_ty, G, GP, D)
            m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            if sp < NS - 1:
                cws = tl.load(CWS + row * scw_r + h * scw_h)
                hi = (sp + 1) * CHUNK
                if HAS_COUNT:
                    hi = tl.minimum(tl.load(CCOUNT + slot), hi)
                m_i, l_i, acc = _compact_range(q, CK, CV, CPOS, slot, h, cws, sp * CHUNK, hi, sck_s,
                                               sck_h, sck_c, scv_s, scv_h, scv_c, scp_s, scp_h, m_i, l_i, acc, C, D,
                                               BLOCK_N)
            else:
                m_i, l_i, acc = _window_range(q, KC, VC, BT, row, h, ws, n, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h,
                                              sbt_r, m_i, l_i, acc, D, BS, BLOCK_N)
            offs_g = tl.arange(0, GP)
            offs_d = tl.arange(0, D)
            base = (row * tl.num_programs(1) + h) * NS + sp
            tl.store(PM + base * GP + offs_g, m_i)
            tl.store(PL + base * GP + offs_g, l_i)
            tl.store(PACC + (base * GP + offs_g[:, None]) * D + offs_d[None, :], acc)

    @triton.jit
    def _sfi_combine_kernel(Out, ROW_MODE, ROW_TOK, PM, PL, PACC, so_t, so_h, NS: tl.constexpr, G: tl.constexpr,
                            GP: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        mode = tl.load(ROW_MODE + row)
        if mode == 1:
            tok = tl.load(ROW_TOK + row).to(tl.int64)
            offs_g = tl.arange(0, GP)
            offs_d = tl.arange(0, D)
            base = (row * tl.num_programs(1) + h) * NS
            m = tl.full([GP], -1.0e30, dtype=tl.float32)
            for sp in range(NS):
                m = tl.maximum(m, tl.load(PM + (base + sp) * GP + offs_g))
            l_t = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            for sp in range(NS):
                w = tl.exp(tl.load(PM + (base + sp) * GP + offs_g) - m)
                l_t += tl.load(PL + (base + sp) * GP + offs_g) * w
                acc += tl.load(PACC + ((base + sp) * GP + offs_g[:, None]) * D + offs_d[None, :]) * w[:, None]
            o = acc / tl.maximum(l_t, 1.0e-30)[:, None]
            gmask = offs_g < G
            tl.store(Out + tok * so_t + (h * G + offs_g)[:, None] * so_h + offs_d[None, :],
                     o.to(Out.dtype.element_ty), mask=gmask[:, None])


def sfi_paged_fast(q, out, ck, cv, cpos, key_cache, value_cache, block_table, row_mode, row_slot, row_tok,
                   row_ws, row_len, scale: float, rows: int | None = None, block_n: int | None = None,
                   splits: int | None = None, row_cws: torch.Tensor | None = None,
                   launch: FastLaunch | None = None,
                   ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   ccount: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel over `rows` batch rows (default: all of row_mode). Same contract as the
    reference (`row_cws` [rows, Hkv] int32, or None: the window start is every head's cutoff).
    key_cache/value_cache may be strided views; the last dim must be contiguous.
    `splits` > 1 spreads each (row, KV head) over that many programs (split-K: compact chunks and
    the window) and combines their partial softmaxes in a second launch. The launch (splits, entries a
    block, warps, stages) is `launch`, else `sfi_launch.fast_launch` for the batch size; `splits` and
    `block_n`, when given, replace its own. `ring` = (this layer's ring [slots + 1, W, Hq, D], w_tok,
    w_slot, w_idx): the step's ring writes (`ring_write_reference`'s contract) done by the same launch,
    spread over its programs; None leaves the rings alone. `ccount` [slots] int32: the compact entries in
    use per slot (`sfi_paged_fast_reference`), None: all C."""
    if not HAVE_TRITON:
        if ring is not None:
            ring_write_reference(q, *ring)
        return sfi_paged_fast_reference(q, out, ck, cv, cpos, key_cache, value_cache, block_table, row_mode,
                                        row_slot, row_tok, row_ws, row_len, scale, row_cws, ccount)
    hkv, c, d = ck.shape[1], ck.shape[2], ck.shape[3]
    g = q.shape[1] // hkv
    gp = max(16, triton.next_power_of_2(g))
    rows = row_mode.shape[0] if rows is None else rows
    for t in (q, out, ck, cv, key_cache, value_cache, *(() if ring is None else ring[:1])):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    common = (ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2), cpos.stride(0),
              cpos.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
              value_cache.stride(1), value_cache.stride(2), block_table.stride(0), float(scale))
    cws = (row_ws, row_ws.stride(0), 0) if row_cws is None else (row_cws, row_cws.stride(0), row_cws.stride(1))
    cws = (*cws, row_slot if ccount is None else ccount)  # an int32 pointer either way (unread without a count)
    launch = launch or fast_launch(rows, hkv, q.device, d)
    if ring is None:  # unread (RING_WRITES off): pointers of the right kinds
        writes = (q, row_slot, row_slot, row_slot, 0, q.shape[0], 0, 0, 0, 0)
        wconst = {"RING_WRITES": False, "HD": d, "WBLOCK": 16, "HAS_COUNT": ccount is not None}
    else:
        rg, w_tok, w_slot, w_idx = ring
        writes = (rg, w_tok, w_slot, w_idx, w_tok.shape[0], q.shape[0], rg.shape[0] - 1, rg.stride(0), rg.stride(1),
                  rg.stride(2))
        hd = q.shape[1] * d
        wconst = {"RING_WRITES": True, "HD": hd, "WBLOCK": min(1024, triton.next_power_of_2(hd)),
                  "HAS_COUNT": ccount is not None}
    ns = launch.splits if splits is None else splits
    block_n = launch.block_n if block_n is None else block_n
    opts = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if ns <= 1:
        _sfi_fast_kernel[(rows, hkv)](
            q, out, ck, cv, cpos, key_cache, value_cache, block_table, row_mode, row_slot, row_tok, row_ws, row_len,
            *cws,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common, *writes,
            C=c, G=g, GP=gp, D=d, BS=key_cache.shape[1], BLOCK_N=block_n, **wconst, **opts)
        return out
    chunk = -(-c // (ns - 1) // block_n) * block_n  # compact entries per split, whole blocks
    pm = torch.empty(rows, hkv, ns, gp, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty(rows, hkv, ns, gp, d, dtype=torch.float32, device=q.device)
    _sfi_fast_split_kernel[(rows, hkv, ns)](
        q, ck, cv, cpos, key_cache, value_cache, block_table, row_mode, row_slot, row_tok, row_ws, row_len, *cws,
        pm, pl, pacc, q.stride(0), q.stride(1), *common, *writes,
        C=c, CHUNK=chunk, NS=ns, G=g, GP=gp, D=d, BS=key_cache.shape[1], BLOCK_N=block_n, **wconst, **opts)
    _sfi_combine_kernel[(rows, hkv)](out, row_mode, row_tok, pm, pl, pacc, out.stride(0), out.stride(1),
                                     NS=ns, G=g, GP=gp, D=d)
    return out


def ring_write_reference(q: torch.Tensor, ring: torch.Tensor, w_tok: torch.Tensor, w_slot: torch.Tensor,
                         w_idx: torch.Tensor) -> None:
    """ring[w_slot[i], w_idx[i]] = q[min(w_tok[i], tokens - 1)] for every write i (plain torch;
    q [tokens, Hq, D], ring [slots + 1, W, Hq, D]; writes to the last slot are scratch)."""
    idx = w_tok.clamp(max=q.shape[0] - 1)
    ring.index_put_((w_slot, w_idx), q[idx])
