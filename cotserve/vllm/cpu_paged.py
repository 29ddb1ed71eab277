"""Reading vLLM's CPU paged KV cache from torch (the CPU backend's `PagedKV`)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def key_layout(isa: str, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """How vLLM's CPU cache stores a block's keys and values for this ISA: 'plain' ([block, D])
    or 'transposed' ([D, block]). Found once by writing known entries through vLLM's own op."""
    from cotserve.vllm.compat import cpu_reshape_and_cache

    bs, h = 32, 1
    cache = torch.zeros(2, h, 2 * bs, head_dim, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    k = torch.randn(bs, h, head_dim).to(dtype)
    v = torch.randn(bs, h, head_dim).to(dtype)
    cpu_reshape_and_cache(k, v, kc, vc, torch.arange(bs) + bs, isa)

    def which(block: torch.Tensor, ref: torch.Tensor) -> str:
        if torch.equal(block.reshape(bs, head_dim), ref[:, 0]):
            return "plain"
        if torch.equal(block.reshape(head_dim, bs).t(), ref[:, 0]):
            return "transposed"
        return "unknown"

    return which(kc[1, 0].contiguous(), k), which(vc[1, 0].contiguous(), v)


class CPUPagedKV:
    """`PagedKV` over vLLM's CPU cache [blocks, H, 2 x block, D] (keys then values per block)."""

    def __init__(self, block_size: int, layout: tuple[str, str]):
        if "unknown" in layout:
            raise RuntimeError(f"unsupported vLLM CPU KV cache layout {layout}: SFI cannot read it")
        self.bs = block_size
        self.k_t = layout[0] == "transposed"
        self.v_t = layout[1] == "transposed"

    def _part(self, part: torch.Tensor, transposed: bool) -> torch.Tensor:
        nb, h, bs, d = part.shape
        if transposed:  # each block's memory holds [D, block]
            part = part.reshape(nb, h, d, bs).transpose(-1, -2)
        return part.permute(1, 0, 2, 3).reshape(h, nb * bs, d)

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int):
        b0, b1 = start // self.bs, -(-end // self.bs)
        nb, h = kv_cache.shape[:2]
        kv = kv_cache.view(nb, h, 2 * self.bs, -1)  # vLLM's logical shape is [blocks, H, block, 2 D]
        sub = kv[blocks[b0:b1].long()]  # [nb, H, 2 bs, D]
        k = self._part(sub[:, :, : self.bs], self.k_t)
        v = self._part(sub[:, :, self.bs :], self.v_t)
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
        kv[sel, :, : self.bs] = self._pack(old_k, nbk, self.k_t)
        kv[sel, :, self.bs :] = self._pack(old_v, nbk, self.v_t)

    def _pack(self, x: torch.Tensor, nbk: int, transposed: bool) -> torch.Tensor:
        """[H, nbk x block, D] -> the blocks' memory [nbk, H, block, D] (inverse of `_part`)."""
        h, _, d = x.shape
        x = x.reshape(h, nbk, self.bs, d).permute(1, 0, 2, 3)
        if transposed:
            x = x.transpose(-1, -2).contiguous().reshape(nbk, h, self.bs, d)
        return x

    def read_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(self.read(kv_cache, b, 0, n) for b in blocks), strict=True)
        return torch.stack(ks), torch.stack(vs)

    def write_front_many(self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> None:
        for b, kk, vv in zip(blocks, k, v, strict=True):
            self.write_front(kv_cache, b, kk, vv)
