"""Reading vLLM's CPU paged KV cache from torch (the CPU backend's `PagedKV`)."""

from __future__ import annotations

import functools

import torch

# A part's layout: "plain" ([block, D] in memory), "transposed" ([D, block]), or any other order of
# the block's entries as a permutation `perm` (memory position p holds entry t, dim d where
# perm[p] = t * D + d; the AMX ISA's bf16 blocks pair rows or columns for its tiles), or "unknown".
Layout = str | torch.Tensor


@functools.lru_cache(maxsize=8)
def key_layout(isa: str, dtype: torch.dtype, head_dim: int, block_size: int = 32) -> tuple[Layout, Layout]:
    """How vLLM's CPU cache stores a block's keys and values for this ISA, dtype and block size.
    Found once by writing known entries through vLLM's own op: each entry's token index, then its
    dimension index, as values (small integers, exact in every float dtype vLLM caches in)."""
    from cotserve.vllm.compat import cpu_reshape_and_cache

    bs, d, h = block_size, head_dim, 1
    seen = []
    for index in (torch.arange(bs).view(bs, 1, 1), torch.arange(d).view(1, 1, d)):
        x = (index.expand(bs, h, d) + 1).to(dtype).contiguous()
        cache = torch.zeros(2, h, 2 * bs, d, dtype=dtype)
        kc, vc = cache.chunk(2, dim=2)
        cpu_reshape_and_cache(x, x.clone(), kc, vc, torch.arange(bs) + bs, isa)
        seen.append((kc[1, 0].contiguous().flatten(), vc[1, 0].contiguous().flatten()))

    def which(tok: torch.Tensor, dim: torch.Tensor) -> Layout:
        t, j = tok.float().round().long() - 1, dim.float().round().long() - 1
        if not (((t >= 0) & (t < bs)).all() and ((j >= 0) & (j < d)).all()):
            return "unknown"
        perm = t * d + j
        if perm.unique().numel() != bs * d:
            return "unknown"
        if torch.equal(perm, torch.arange(bs * d)):
            return "plain"
        if torch.equal(perm, torch.arange(bs * d).view(bs, d).t().flatten()):
            return "transposed"
        return perm

    return which(seen[0][0], seen[1][0]), which(seen[0][1], seen[1][1])


class CPUPagedKV:
    """`PagedKV` over vLLM's CPU cache [blocks, H, 2 x block, D] (keys then values per block)."""

    def __init__(self, block_size: int, layout: tuple[Layout, Layout]):
        if any(isinstance(x, str) and x == "unknown" for x in layout):
            raise RuntimeError(f"unsupported vLLM CPU KV cache layout {layout}: SFI cannot read it")
        self.bs = block_size
        self.k_t = isinstance(layout[0], str) and layout[0] == "transposed"
        self.v_t = isinstance(layout[1], str) and layout[1] == "transposed"
        # other orders: the permutation (memory <- entries, for writes) and its inverse (for reads)
        self.k_perm = layout[0] if isinstance(layout[0], torch.Tensor) else None
        self.v_perm = layout[1] if isinstance(layout[1], torch.Tensor) else None
        self.k_inv = torch.argsort(self.k_perm) if self.k_perm is not None else None
        self.v_inv = torch.argsort(self.v_perm) if self.v_perm is not None else None

    def _part(self, part: torch.Tensor, transposed: bool, inv: torch.Tensor | None = None) -> torch.Tensor:
        nb, h, bs, d = part.shape
        if inv is not None:  # entry t, dim d sits at memory position inv[t * D + d]
            part = part.reshape(nb, h, bs * d).index_select(-1, inv).reshape(nb, h, bs, d)
        elif transposed:  # each block's memory holds [D, block]
            part = part.reshape(nb, h, d, bs).transpose(-1, -2)
        return part.permute(1, 0, 2, 3).reshape(h, nb * bs, d)

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int):
        b0, b1 = start // self.bs, -(-end // self.bs)
        nb, h = kv_cache.shape[:2]
        kv = kv_cache.view(nb, h, 2 * self.bs, -1)  # vLLM's logical shape is [blocks, H, block, 2 D]
        sub = kv[blocks[b0:b1].long()]  # [nb, H, 2 bs, D]
        k = self._part(sub[:, :, : self.bs], self.k_t, self.k_inv)
        v = self._part(sub[:, :, self.bs :], self.v_t, self.v_inv)
        lo, hi = start - b0 * self.bs, end - b0 * self.bs
        return k[:, lo:hi], v[:, lo:hi]

    def write_front(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V [H, m, D] as the entries 0 .. m - 1 of the request whose blocks are `blocks`
        (entries m .. of the last block written keep their contents)."""
        m = k.shape[1]
        nbk = -(-m // self.bs)
        sel = blocks[:nbk].long()
        nb, h = kv_cache.shape[:2]
        kv = kv_cache.view(nb, h, 2 * self.bs, -1)
        old_k, old_v = self.read(kv_cache, blocks, 0, nbk * self.bs)
        old_k, old_v = old_k.clone(), old_v.clone()
        old_k[:, :m] = k
        old_v[:, :m] = v
        kv[sel, :, : self.bs] = self._pack(old_k, nbk, self.k_t, self.k_perm)
        kv[sel, :, self.bs :] = self._pack(old_v, nbk, self.v_t, self.v_perm)

    def _pack(self, x: torch.Tensor, nbk: int, transposed: bool, perm: torch.Tensor | None = None) -> torch.Tensor:
        """[H, nbk x block, D] -> the blocks' memory [nbk, H, block, D] (inverse of `_part`)."""
        h, _, d = x.shape
        x = x.reshape(h, nbk, self.bs, d).permute(1, 0, 2, 3)
        if perm is not None:
            x = x.reshape(nbk, h, self.bs * d).index_select(-1, perm).reshape(nbk, h, self.bs, d)
        elif transposed:
            x = x.transpose(-1, -2).contiguous().reshape(nbk, h, self.bs, d)
        return x

    def read_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(self.read(kv_cache, b, 0, n) for b in blocks), strict=True)
        return torch.stack(ks), torch.stack(vs)

    def write_front_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> None:
        for b, kk, vv in zip(blocks, k, v, strict=True):
            self.write_front(kv_cache, b, kk, vv)
