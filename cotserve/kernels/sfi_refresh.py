"""SFI's refresh on vLLM's paged cache in few launches: the evidence's logits, read straight from the
rings of query rows, and the re-pack of the selection, positions included.

A refresh is issued by the host between two steps (one follows each slow step: about one decode step
in six at 16 requests, each request's refresh budget being 64 steps); its launches are what the host
spends on it, so each part is one launch over every layer (or every layer of a chunk) and every
request of the refresh:

* `ring_logits_layers`: for layers l0 .. l0+nl-1 of J requests, each KV head's G x R query rows,
  gathered from the rings ([L, slots + 1, W, Hq, D]: slot `slots[j]`, ring indices `ridx`) and
  scaled, against the first n keys of the paged cache, read in place through the block table;
  causal by index where asked (a row at position p sees no entry after p: `row_pos`); and the keys'
  norms. One read of the keys; no gathered copy of the queries.
* `pack_selection_layers`: the sinks (entries 0 .. ns-1) and the selected entries `keep`
  [J, L, H, k] copied from the paged cache into the compact buffers `ck`, `cv` [L, slots, H, C, D]
  at slot `slots[j]`, and their positions (or, for a compacted request, their true positions
  `tpos` [L, H, n]) into `cpos` [L, slots, H, C], -1 after them; given `ccount` [slots], the entries
  now in use (sinks + k) at slot `slots[j]` (the fast step reads no further).

Both read every layer through the first layer's pointer and a table of the layers' offsets
(`PagedLayers`). Each has a plain torch twin (`*_reference`) that the kernels are tested against (on
the CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def layer_offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each layer's element offset from the first layer's pointer, for kernels that read every layer in
    one launch through the first layer's tensor (the layers may be separate allocations, as vLLM makes
    them, or views of one). The layers must share dtype, shape and strides, and lie a multiple of 16
    elements apart (allocations are aligned far beyond that)."""
    t0 = tensors[0]
    es = t0.element_size()
    for t in tensors:
        if t.dtype != t0.dtype or t.shape != t0.shape or t.stride() != t0.stride() or t.device != t0.device:
            raise ValueError("the layers' paged caches differ in dtype, shape or layout: SFI needs uniform layers")
    out = []
    for t in tensors:
        delta = t.data_ptr() - t0.data_ptr()
        if delta % (16 * es):  # the kernels tell the compiler so: their loads stay vectorized
            raise ValueError("a layer's paged cache is not aligned to 16 elements of the first layer's")
        out.append(delta // es)
    return out


@dataclass(frozen=True)
class PagedLayers:
    """Every layer's paged keys and values [blocks, block, H, D] and each layer's element offset from
    the first layer's (device int64 [L], `layer_offsets`): with them one launch reads any layer
    through the first layer's pointer."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_off: torch.Tensor
    value_off: torch.Tensor

    @classmethod
    def of(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> PagedLayers:
        dev = keys[0].device

        def table(ts: list[torch.Tensor]) -> torch.Tensor:
            t = torch.tensor(layer_offsets(ts), dtype=torch.int64)
            # pinned and asynchronous on CUDA: built inside a step, it must not wait for the GPU
            return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

        return cls(tuple(keys), tuple(values), table(keys), table(values))


# -- the evidence's logits ---------------------------------------------------------------------------

def ring_queries(ring: torch.Tensor, slots: torch.Tensor, ridx: torch.Tensor, scale: float, l0: int, nl: int,
                 num_kv_heads: int) -> torch.Tensor:
    """The query rows a refresh reads, as the kernel gathers them: layers l0 .. l0+nl-1 of `ring`
    [L, slots + 1, W, Hq, D], slots `slots` [J], ring indices `ridx` [R], scaled in the ring's dtype;
    [J, nl, Hkv, G * R, D], row g * R + r of KV head h being query head h * G + g at ring index ridx[r]."""
    q = ring[l0 : l0 + nl][:, slots.long()][:, :, ridx.long()]  # [nl, J, R, Hq, D]
    nl_, j, r, hq, d = q.shape
    return (q.permute(1, 0, 3, 2, 4).reshape(j, nl_, num_kv_heads, (hq // num_kv_heads) * r, d) * scale)


def ring_logits_reference(ring: torch.Tensor, slots: torch.Tensor, ridx: torch.Tensor, row_pos: torch.Tensor,
                          scale: float, key_caches: list[torch.Tensor], l0: int, block_table: torch.Tensor, n: int,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: logits [J, nl, Hkv, G * R, n] float32 of the rings' rows (`ring_queries`) over the
    first n paged keys of layers l0 .. l0 + len(key_caches) - 1 ([blocks, block, Hkv, D] each), -inf
    after each row's position where `causal`; and the keys' norms [J, nl, Hkv, n] float32."""
    nl = len(key_caches)
    hkv = key_caches[0].shape[2]
    q = ring_queries(ring, slots, ridx, scale, l0, nl, hkv)
    bs = key_caches[0].shape[1]
    pos = torch.arange(n, device=q.device)
    logits, norms = [], []
    for j in range(q.shape[0]):
        per_l, per_n = [], []
        for li, kc in enumerate(key_caches):
            k = kc[block_table[j, pos // bs].long(), pos % bs].float()  # [n, H, D]
            per_l.append(torch.einsum("hrd,nhd->hrn", q[j, li].to(kc.dtype).float(), k))
            per_n.append(k.norm(dim=-1).t())
        logits.append(torch.stack(per_l))
        norms.append(torch.stack(per_n))
    out = torch.stack(logits)
    if causal:
        r = ridx.shape[0]
        late = pos.view(1, n) > row_pos.long().view(r, 1)  # [R, n]
        g = out.shape[3] // r
        out.masked_fill_(late.repeat(g, 1), float("-inf"))
    return out, torch.stack(norms)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["n", "nl", "l0", "causal", "sbt_j"])
    def _ring_logits_kernel(RING, SLOTS, RIDX, RPOS, KC, KOFF, BT, OUT, NORM, n, nl, l0, causal, scale, sr_l, sr_s,
                            sr_w, sr_h, skc_b, skc_o, skc_h, sbt_j, so_j, so_l, so_h, so_r, sn_j, sn_l, sn_h,
                            G: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        jl = tl.program_id(0)
        j = (jl // nl).to(tl.int64)
        li = (jl % nl).to(tl.int64)
        h = tl.program_id(1)
        start = tl.program_id(2) * BLOCK_N
        offs_t = tl.arange(0, RP)  # logit rows: t = g * R + r
        tmask = offs_t < G * R
        offs_d = tl.arange(0, D)
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < n
        # the query rows, from the ring: slot j's ring index ridx[r], query head h * G + g, scaled in its dtype
        slot = tl.load(SLOTS + j).to(tl.int64)
        widx = tl.load(RIDX + offs_t % R, mask=tmask, other=0).to(tl.int64)
        qh = (h * G + offs_t // R).to(tl.int64)
        q = tl.load(RING + (l0 + li) * sr_l + slot * sr_s + widx[:, None] * sr_w + qh[:, None] * sr_h
                    + offs_d[None, :], mask=tmask[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(RING.dtype.element_ty)
        # this layer's keys; its offset is a multiple of 16 elements (`layer_offsets`): loads stay vectorized
        kc = KC + tl.multiple_of(tl.load(KOFF + l0 + li), 16)
        blk = tl.load(BT + j * sbt_j + offs_n // BS, mask=valid, other=0).to(tl.int64)
        k = tl.load(kc + blk[:, None] * skc_b + (offs_n % BS)[:, None] * skc_o + h * skc_h + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        s = tl.dot(q.to(k.dtype), tl.trans(k))
        if causal != 0:
            rpos = tl.load(RPOS + offs_t % R, mask=tmask, other=0)
            s = tl.where(offs_n[None, :] > rpos[:, None], float("-inf"), s)
        tl.store(OUT + j * so_j + li * so_l + h * so_h + offs_t[:, None] * so_r + offs_n[None, :], s,
                 mask=tmask[:, None] & valid[None, :])
        kf = k.to(tl.float32)
        tl.store(NORM + j * sn_j + li * sn_l + h * sn_h + offs_n, tl.sqrt(tl.sum(kf * kf, 1)), mask=valid)


def ring_logits_layers(ring: torch.Tensor, slots: torch.Tensor, ridx: torch.Tensor, row_pos: torch.Tensor,
                       scale: float, layers: PagedLayers, l0: int, nl: int, block_table: torch.Tensor, n: int,
                       out: torch.Tensor, norms: torch.Tensor, causal: bool, block_n: int = 64) -> None:
    """Triton form of `ring_logits_reference` for layers l0 .. l0 + nl - 1 of `layers`, into `out`
    [J, nl, Hkv, G * R, n] and `norms` [J, nl, Hkv, n] (float32, last dim contiguous), in one launch.
    `slots` [J], `ridx` [R] and `row_pos` [R] are int32 on the ring's device."""
    if not HAVE_TRITON:
        want, wnorm = ring_logits_reference(ring, slots, ridx, row_pos, scale, list(layers.keys[l0 : l0 + nl]), l0,
                                            block_table, n, causal)
        out.copy_(want)
        norms.copy_(wnorm)
        return
    kc = layers.keys[0]
    j, r = slots.shape[0], ridx.shape[0]
    hq, d = ring.shape[3], ring.shape[4]
    hkv = kc.shape[2]
    g = hq // hkv
    for t in (ring, kc, out, norms):
        assert t.stride(-1) == 1
    rp = max(16, triton.next_power_of_2(g * r))
    _ring_logits_kernel[(j * nl, hkv, triton.cdiv(n, block_n))](
        ring, slots, ridx, row_pos, kc, layers.key_off, block_table, out, norms, n, nl, l0, int(causal), float(scale),
        ring.stride(0), ring.stride(1), ring.stride(2), ring.stride(3), kc.stride(0), kc.stride(1), kc.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1), out.stride(2), out.stride(3), norms.stride(0),
        norms.stride(1), norms.stride(2), G=g, R=r, RP=rp, D=d, BS=kc.shape[1], BLOCK_N=block_n)


# -- the re-pack -------------------------------------------------------------------------------------

def pack_selection_reference(keep: torch.Tensor, ns: int, tpos: torch.Tensor | None, block_table: torch.Tensor,
                             key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], ck: torch.Tensor,
                             cv: torch.Tensor, cpos: torch.Tensor, slots: torch.Tensor,
                             ccount: torch.Tensor | None = None) -> None:
    """Plain torch: for request j and layer l, entries 0 .. ns-1 then `keep[j, l]` [H, k] (cache
    indices) into `ck`, `cv` [L, slots, H, C, D] at slot `slots[j]`, entries 0 .. ns + k - 1; their
    positions (`tpos[l, h, entry]` where given) into `cpos` [L, slots, H, C], -1 after them; ns + k into
    `ccount[slots[j]]` where given."""
    jn, nlay, h, k = keep.shape
    bs = key_caches[0].shape[1]
    heads = torch.arange(h, device=keep.device).view(-1, 1)
    m = ns + k
    for j in range(jn):
        s = int(slots[j])
        if ccount is not None:
            ccount[s] = m
        for li in range(nlay):
            sinks = torch.arange(ns, device=keep.device).expand(h, ns)
            idx = torch.cat([sinks, keep[j, li].long()], dim=-1)  # [H, m]
            blk = block_table[j].long()[idx // bs]
            off = idx % bs
            ck[li, s, :, :m] = key_caches[li][blk, off, heads]
            cv[li, s, :, :m] = value_caches[li][blk, off, heads]
            where = idx if tpos is None else torch.gather(tpos[li].long(), 1, idx)
            cpos[li, s, :, :m] = where.to(cpos.dtype)
            cpos[li, s, :, m:] = -1


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["k", "ns", "nl", "has_tpos", "sk_j", "sk_l", "sk_h", "st_l", "st_h", "sbt_j"])
    def _pack_kernel(KEEP, TPOS, BT, KC, VC, KOFF, VOFF, CK, CV, CPOS, SLOTS, CCOUNT, k, ns, nl, has_tpos, sk_j, sk_l, sk_h,
                     st_l, st_h, sbt_j, skc_b, skc_o, skc_h, svc_b, svc_o, svc_h, sck_l, sck_s, sck_h, sck_c, scv_l,
                     scv_s, scv_h, scv_c, scp_l, scp_s, scp_h, C: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_COUNT: tl.constexpr):
        jl = tl.program_id(0)
        j = (jl // nl).to(tl.int64)
        li = (jl % nl).to(tl.int64)
        h = tl.program_id(1)
        e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)  # compact entries
        inb = e < C
        ok = (e < ns + k) & inb  # entries past the compact buffer (never asked for) are not written
        sink = e < ns
        kept = tl.load(KEEP + j * sk_j + li * sk_l + h * sk_h + (e - ns), mask=ok & (e >= ns), other=0)
        pos = tl.where(sink, e.to(tl.int64), kept.to(tl.int64))  # the entry's index in the cache
        slot = tl.load(SLOTS + j).to(tl.int64)
        offs_d = tl.arange(0, D)
        kc = KC + tl.multiple_of(tl.load(KOFF + li), 16)  # multiples of 16 elements (`layer_offsets`)
        vc = VC + tl.multiple_of(tl.load(VOFF + li), 16)
        blk = tl.load(BT + j * sbt_j + pos // BS, mask=ok, other=0).to(tl.int64)
        off = pos % BS
        kv = tl.load(kc + blk[:, None] * skc_b + off[:, None] * skc_o + h * skc_h + offs_d[None, :], mask=ok[:, None])
        tl.store(CK + li * sck_l + slot * sck_s + h * sck_h + e[:, None] * sck_c + offs_d[None, :], kv,
                 mask=ok[:, None])
        vv = tl.load(vc + blk[:, None] * svc_b + off[:, None] * svc_o + h * svc_h + offs_d[None, :], mask=ok[:, None])
        tl.store(CV + li * scv_l + slot * scv_s + h * scv_h + e[:, None] * scv_c + offs_d[None, :], vv,
                 mask=ok[:, None])
        where = pos
        if has_tpos != 0:
            where = tl.load(TPOS + li * st_l + h * st_h + pos, mask=ok, other=0).to(tl.int64)
        tl.store(CPOS + li * scp_l + slot * scp_s + h * scp_h + e, tl.where(ok, where, -1).to(CPOS.dtype.element_ty),
                 mask=inb)
        if HAS_COUNT:
            if (li == 0) & (h == 0) & (tl.program_id(2) == 0):
                tl.store(CCOUNT + slot, (ns + k).to(CCOUNT.dtype.element_ty))


def pack_selection_layers(keep: torch.Tensor, ns: int, tpos: torch.Tensor | None, block_table: torch.Tensor,
                          layers: PagedLayers, ck: torch.Tensor, cv: torch.Tensor, cpos: torch.Tensor,
                          slots: torch.Tensor, block: int = 64, ccount: torch.Tensor | None = None) -> None:
    """Triton form of `pack_selection_reference` for every layer of `layers` in one launch: `keep`
    [J, L, H, k] (any strides, the last 1), `tpos` [L, H, n] int64 or None, `slots` [J] int32,
    `ccount` [slots] int32 or None."""
    if not HAVE_TRITON:
        pack_selection_reference(keep, ns, tpos, block_table, list(layers.keys), list(layers.values), ck, cv, cpos,
                                 slots, ccount)
        return
    j, nl, h, k = keep.shape
    kc, vc = layers.keys[0], layers.values[0]
    c = cpos.shape[-1]
    if ns + k > c:
        raise ValueError(f"{ns} sinks + {k} selected entries do not fit a compact buffer of {c}")
    for t in (keep, kc, vc, ck, cv, cpos):
        assert t.stride(-1) == 1
    tp = keep if tpos is None else tpos  # an int64 pointer either way (unread without positions)
    assert tp.dtype == torch.int64 and tp.stride(-1) == 1
    st_l, st_h = (0, 0) if tpos is None else (tpos.stride(0), tpos.stride(1))
    _pack_kernel[(j * nl, h, triton.cdiv(c, block))](
        keep, tp, block_table, kc, vc, layers.key_off, layers.value_off, ck, cv, cpos, slots,
        slots if ccount is None else ccount, k, ns, nl,
        int(tpos is not None), keep.stride(0), keep.stride(1), keep.stride(2), st_l, st_h, block_table.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), ck.stride(0),
        ck.stride(1), ck.stride(2), ck.stride(3), cv.stride(0), cv.stride(1), cv.stride(2), cv.stride(3),
        cpos.stride(0), cpos.stride(1), cpos.stride(2), C=c, D=kc.shape[-1], BS=kc.shape[1], BLOCK=block,
        HAS_COUNT=ccount is not None)
