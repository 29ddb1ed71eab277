"""vLLM 0.26's FlashAttention KV cache seen from torch: one request's entries read and written
through its block-table row (the eviction runtime's `PagedRW` on CUDA). No vLLM import, so the
CPU tests exercise it on a tensor of the same layout."""

from __future__ import annotations

import torch


def split_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.26's FlashAttention cache [blocks, H, block, 2 D] (NHD in memory) -> K, V views
    [blocks, block, H, D], as its FlashAttentionImpl splits it."""
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


class FlashPagedKV:
    """Reads and writes one request's entries in vLLM 0.26's FlashAttention cache (`PagedRW`)."""

    def __init__(self, block_size: int, head_size: int):
        self.bs, self.d = block_size, head_size

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int):
        k, v = split_kv(kv_cache, self.d)
        b0, b1 = start // self.bs, -(-end // self.bs)
        sel = blocks[b0:b1].long()
        lo, hi = start - b0 * self.bs, end - b0 * self.bs
        h = k.shape[2]
        kk = k[sel].reshape(-1, h, self.d)[lo:hi].transpose(0, 1)
        vv = v[sel].reshape(-1, h, self.d)[lo:hi].transpose(0, 1)
        return kk, vv

    def write_front(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        m = k.shape[1]
        nbk = -(-m // self.bs)
        kc, vc = split_kv(kv_cache, self.d)
        sel = blocks[:nbk].long()
        for cache, new in ((kc, k), (vc, v)):
            full = cache[sel].clone()  # [nbk, block, H, D]
            flat = full.view(nbk * self.bs, full.shape[2], self.d)
            flat[:m] = new.transpose(0, 1)
            cache[sel] = full

    def read_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [R, H, n, D] of R requests at once (one gather each)."""
        k, v = split_kv(kv_cache, self.d)
        nb = -(-n // self.bs)
        sel = blocks[:, :nb].long()
        r, h = sel.shape[0], k.shape[2]
        kk = k[sel].reshape(r, nb * self.bs, h, self.d)[:, :n].transpose(1, 2)
        vv = v[sel].reshape(r, nb * self.bs, h, self.d)[:, :n].transpose(1, 2)
        return kk, vv

    def write_front_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> None:
        """Entries 0 .. m - 1 of R requests (K, V [R, H, m, D]) in one scatter each."""
        r, _, m, _ = k.shape
        j = torch.arange(m, device=blocks.device)
        blk = blocks[:, j // self.bs].long().reshape(-1)  # [R m]
        off = (j % self.bs).repeat(r)
        kc, vc = split_kv(kv_cache, self.d)
        kc[blk, off] = k.transpose(1, 2).reshape(r * m, k.shape[1], self.d)
        vc[blk, off] = v.transpose(1, 2).reshape(r * m, v.shape[1], self.d)
