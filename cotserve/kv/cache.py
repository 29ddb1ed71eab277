"""cotserve's own KV cache for the native engine.

One tensor per K and V for the whole batch, preallocated once per batch:
`k[layer, slot, kv_head, index, head_dim]`. Entries of a slot are stored contiguously at
indices `0 .. lens[layer, slot] - 1`; every KV head of a (layer, slot) holds the same number of
entries (eviction keeps the same count per head), but not necessarily the same tokens.
`pos[layer, slot, kv_head, index]` is the true token position of each entry (RoPE is already
applied to the stored keys), so policies can reason about recency and sentence spans after
compaction. Decode writes one entry per slot at `lens`; nothing is re-copied per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CacheShape:
    layers: int
    slots: int
    kv_heads: int
    capacity: int
    head_dim: int


class KVCache:
    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device):
        self.shape = shape
        size = (shape.layers, shape.slots, shape.kv_heads, shape.capacity, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.pos = torch.full(size[:4], -1, dtype=torch.long, device=device)
        self.lens = torch.zeros(shape.layers, shape.slots, dtype=torch.long, device=device)
        self.device = device
        self.checked = True  # False inside a CUDA graph (no host syncs there; capacity is planned)
        self._slots = torch.arange(shape.slots, device=device)
        # compactions[layer][slot]: how often `compact` rewrote that row (caches of per-entry
        # derived values, e.g. SFI's key norms, are valid only while this is unchanged)
        self.compactions = [[0] * shape.slots for _ in range(shape.layers)]
        self.pooled = False  # a view of one slot of a larger cache (`slot_view`): never reallocated

    def slot_view(self, slot: int) -> KVCache:
        """A one-slot cache whose tensors are views of this cache's slot `slot`: writes through it
        land in this cache (the continuous engine's pool: a sequence prefills into its slot with
        the ordinary one-slot writes). It cannot grow or shrink."""
        view = object.__new__(KVCache)
        sh = self.shape
        view.shape = CacheShape(sh.layers, 1, sh.kv_heads, sh.capacity, sh.head_dim)
        view.k, view.v = self.k[:, slot : slot + 1], self.v[:, slot : slot + 1]
        view.pos, view.lens = self.pos[:, slot : slot + 1], self.lens[:, slot : slot + 1]
        view.device = self.device
        view.checked = True
        view._slots = torch.arange(1, device=self.device)
        view.compactions = [[0] for _ in range(sh.layers)]
        view.pooled = True
        return view

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    def nbytes_per_slot(self, layer_lens: torch.Tensor | None = None) -> torch.Tensor:
        """K+V bytes held per slot (valid entries only), summed over layers: [slots]."""
        lens = self.lens if layer_lens is None else layer_lens
        per_entry = 2 * self.shape.kv_heads * self.shape.head_dim * self.k.element_size()
        return lens.sum(0) * per_entry

    def allocated_bytes_per_slot(self) -> int:
        """K+V bytes allocated per slot, summed over layers: the memory a sequence holds whatever
        it fills (`capacity` entries per layer and KV head). This cache is one block per batch,
        so entries freed by an eviction policy's compaction stay allocated to their slot."""
        return self.shape.layers * self.capacity * 2 * self.shape.kv_heads * self.shape.head_dim * self.k.element_size()

    def grow(self, capacity: int) -> None:
        """Reallocate with room for `capacity` entries per row, keeping every entry (a copy of the
        cache). The continuous engine grows a dense sequence's cache as it decodes instead of
        allocating its whole context at admission; no other code holds the old tensors."""
        if capacity > self.capacity:
            self._realloc(capacity)

    def shrink(self, capacity: int) -> None:
        """Reallocate to `capacity` entries per row, keeping the first `capacity` of each (every
        row must hold at most that many): the continuous engine hands an evicting sequence's
        unused allocation back once its cache has compacted to its budget."""
        if capacity < self.capacity:
            if int(self.lens.max()) > capacity:
                raise ValueError("cannot shrink below the entries held")
            self._realloc(capacity)

    def _realloc(self, capacity: int) -> None:
        if self.pooled:
            raise ValueError("a pooled slot's cache has a fixed size")
        old_k, old_v, old_pos = self.k, self.v, self.pos
        n = min(capacity, self.capacity)
        self.shape = CacheShape(self.shape.layers, self.shape.slots, self.shape.kv_heads, capacity,
                                self.shape.head_dim)
        size = (self.shape.layers, self.shape.slots, self.shape.kv_heads, capacity, self.shape.head_dim)
        self.k = old_k.new_zeros(size)
        self.v = old_v.new_zeros(size)
        self.pos = old_pos.new_full(size[:4], -1)
        self.k[:, :, :, :n] = old_k[:, :, :, :n]
        self.v[:, :, :, :n] = old_v[:, :, :, :n]
        self.pos[:, :, :, :n] = old_pos[:, :, :, :n]

    # -- writes ---------------------------------------------------------------------------
    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """Write a right-padded prompt block k, v [B, Hkv, T, D] at indices 0..T-1."""
        t = k.shape[2]
        if t > self.capacity:
            raise ValueError(f"prompt of {t} tokens exceeds the cache capacity {self.capacity}")
        self.k[layer, :, :, :t] = k
        self.v[layer, :, :, :t] = v
        positions = torch.arange(t, device=self.device).expand(k.shape[0], k.shape[1], t)
        valid = positions < lengths.view(-1, 1, 1)
        self.pos[layer, :, :, :t] = torch.where(valid, positions, torch.full_like(positions, -1))
        self.lens[layer] = lengths

    def write_chunk(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write one slot's next prompt chunk (k, v [1, Hkv, T, D], positions start..start+T-1) at
        indices start..start+T-1 of a single-slot cache (chunked prefill). The entries before
        `start` must be the prompt's first `start` tokens."""
        t = k.shape[2]
        if k.shape[0] != 1 or self.shape.slots != 1:
            raise ValueError("write_chunk writes a single-slot cache")
        if start + t > self.capacity:
            raise ValueError(f"prompt chunk ending at {start + t} exceeds the cache capacity {self.capacity}")
        self.k[layer, 0, :, start : start + t] = k[0]
        self.v[layer, 0, :, start : start + t] = v[0]
        self.pos[layer, 0, :, start : start + t] = torch.arange(start, start + t, device=self.device)
        self.lens[layer, 0] = start + t

    def write_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Append one entry per slot (k, v [B, Hkv, 1, D]) at index lens[layer, slot]."""
        idx = self.lens[layer]
        if self.checked and int(idx.max()) >= self.capacity:
            raise ValueError("KV cache full: capacity planning is wrong")
        slots = self._slots
        self.k[layer, slots, :, idx] = k[:, :, 0]
        self.v[layer, slots, :, idx] = v[:, :, 0]
        self.pos[layer, slots, :, idx] = positions.view(-1, 1).expand(-1, k.shape[1])
        self.lens[layer] = idx + 1

    # -- reads ----------------------------------------------------------------------------
    def view(self, layer: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, S, D] and a validity mask [B, S] over the first S = max(lens) indices."""
        s = int(self.lens[layer].max()) if upto is None else upto
        valid = torch.arange(s, device=self.device).unsqueeze(0) < self.lens[layer].unsqueeze(1)
        return self.k[layer, :, :, :s], self.v[layer, :, :, :s], valid

    def read_rows(self, layer: int, slots: torch.Tensor, kv_heads: torch.Tensor,
                  upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [N, upto, D] of only the (slot, kv_head) rows named by `slots[n], kv_heads[n]`:
        a read that leaves every other row of the layer untouched (per-group read skipping)."""
        return self.k[layer, slots, kv_heads, :upto], self.v[layer, slots, kv_heads, :upto]

    def read_row(self, layer: int, slot: int, kv_head: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [upto, D] of one (slot, kv_head) row, as views (no copy)."""
        return self.k[layer, slot, kv_head, :upto], self.v[layer, slot, kv_head, :upto]

    # -- eviction -------------------------------------------------------------------------
    def compact(self, layer: int, slot: int, keep: torch.Tensor) -> None:
        """Keep, for one (layer, slot), the entries `keep[kv_head, n]` (indices into the current
        entries, any order; they are stored sorted by index). The slot's length becomes n.
        This is the physical eviction: the entries behind n are dropped."""
        keep, _ = keep.sort(dim=-1)
        n = keep.shape[-1]
        cur = int(self.lens[layer, slot])
        if n > cur or (n and int(keep.max()) >= cur):
            raise ValueError("compact: keep indices outside the valid entries")
        d = self.shape.head_dim
        gather = keep.unsqueeze(-1).expand(-1, -1, d)
        self.k[layer, slot, :, :n] = torch.gather(self.k[layer, slot, :, :cur], 1, gather)
        self.v[layer, slot, :, :n] = torch.gather(self.v[layer, slot, :, :cur], 1, gather)
        self.pos[layer, slot, :, :n] = torch.gather(self.pos[layer, slot, :, :cur], 1, keep)
        self.pos[layer, slot, :, n:cur] = -1
        self.lens[layer, slot] = n
        self.compactions[layer][slot] += 1
