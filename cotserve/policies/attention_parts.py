"""Small pieces shared by the baseline policies (streamingllm, h2o, snapkv, quest).

Plain torch, written for clarity first; each piece has a reference test in tests/test_baselines.py.

* `decode_probs` / `attend`: one decode step's GQA attention with the probabilities exposed and a
  validity mask that may differ per KV head (H2O accumulates the probabilities; Quest reads a
  per-head subset).
* `causal_prefill_with_colsums`: causal prompt attention computed in query chunks that also returns
  the attention each key received (column sums over the real query rows), for H2O's accumulated score;
  `chunk_colsums`: the same column sums from one chunk of the last query rows (a prefill that arrives
  in chunks, as vLLM's does).
* `refuse_overriding_parts`: a policy that must compute attention itself refuses a stack in which an
  earlier part (the stack asks read before evict) would answer that hook instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.errors import PolicyError
from cotserve.policies.base import Policy

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


def _mask4(valid: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """A validity mask [B, S] or [B, Hkv, S] as [B, Hkv|1, 1, S] (broadcast over the group)."""
    if valid.dim() == 2:
        return valid.view(b, 1, 1, s)
    return valid.view(b, valid.shape[1], 1, s)


def decode_probs(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention probabilities of one decode query per head: [B, Hkv, G, S] (float32).

    q [B, Hq, 1, D]; k [B, Hkv, S, D]; valid [B, S] or [B, Hkv, S] (False entries get probability 0).
    Query head h belongs to KV head h // G (the layout of transformers' repeat_kv)."""
    b, hq, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scaling  # [B, Hkv, G, S]
    scores = scores.masked_fill(~_mask4(valid, b, s), float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


def attend(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention output [B, Hq, 1, D] from `decode_probs` output and values [B, Hkv, S, D]."""
    b, hkv, g, _ = probs.shape
    out = torch.matmul(probs.to(v.dtype), v)  # [B, Hkv, G, D]
    return out.reshape(b, hkv * g, 1, v.shape[-1])


def causal_prefill_with_colsums(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scaling: float,
    max_elems: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention over a right-padded prompt block, plus the attention mass each key got.

    q [B, Hq, T, D], k/v [B, Hkv, T, D], lengths [B] (real tokens per row; rows >= length are pads).
    Returns (out [B, Hq, T, D], colsum [B, Hq, T] float32) where colsum[b, h, j] = sum over real
    query rows i (j <= i < lengths[b]) of softmax_j(q_i . k_j * scaling): H2O's accumulated
    attention score of key j after the prompt (Zhang et al. 2023, Sec. 4, the score function F_score).
    Computed in query chunks (at most `max_elems` scores at a time), each chunk only against the keys
    it can see, so the full T x T matrix is never held."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    chunk = max(1, min(t, max_elems // max(1, b * hq * t)))
    out = torch.empty_like(q)
    colsum = torch.zeros(b, hkv, g, t, dtype=torch.float32, device=q.device)
    rows_all = torch.arange(t, device=q.device)
    for r0 in range(0, t, chunk):
        r1 = min(t, r0 + chunk)
        vc = v[:, :, :r1]  # keys beyond r1 are masked for every row of the chunk
        probs = causal_chunk_probs(q[:, :, r0:r1], k[:, :, :r1], scaling)  # [B, Hkv, G, c, r1]
        out[:, :, r0:r1] = torch.matmul(probs.to(v.dtype), vc.unsqueeze(2)).reshape(b, hq, r1 - r0, d)
        real_rows = (rows_all[r0:r1].unsqueeze(0) < lengths.view(-1, 1)).float()  # [B, c]
        colsum[..., :r1] += torch.einsum("bhgcs,bc->bhgs", probs, real_rows)
    return out, colsum.view(b, hq, t)


def causal_chunk_probs(qc: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention probabilities of a chunk of the last query rows: qc [B, Hq, c, D] are the
    queries at positions n - c .. n - 1, k [B, Hkv, n, D] the keys at 0 .. n - 1. Returns
    [B, Hkv, G, c, n] float32 (row i sees keys 0 .. n - c + i)."""
    b, hq, c, d = qc.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = qc.reshape(b, hkv, hq // hkv, c, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scaling  # [B, Hkv, G, c, n]
    rows = torch.arange(n - c, n, device=qc.device)
    causal = rows.unsqueeze(1) >= torch.arange(n, device=qc.device).unsqueeze(0)  # [c, n]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


def chunk_colsums(qc: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """The attention mass each key gets from a chunk of the last query rows (`causal_chunk_probs`):
    [B, Hq, n] float32. Over the chunks of a prompt (each over the keys so far) these add up to
    `causal_prefill_with_colsums`' column sums: a chunked prefill (vLLM's) scores as the native one."""
    probs = causal_chunk_probs(qc, k, scaling)
    b, hkv, g, _, n = probs.shape
    return probs.sum(3).reshape(b, hkv * g, n)


def reduce_group(x: torch.Tensor, hkv: int, how: str) -> torch.Tensor:
    """Per-query-head scores [B, Hq, ...] -> per-KV-head [B, Hkv, ...] over each GQA group."""
    b, hq = x.shape[:2]
    xg = x.reshape(b, hkv, hq // hkv, *x.shape[2:])
    if how == "mean":
        return xg.mean(2)
    if how == "sum":
        return xg.sum(2)
    if how == "max":
        return xg.amax(2)
    raise ValueError(f"unknown group reduction {how!r} (mean, sum, max)")


def refuse_overriding_parts(me: Policy, batch: BatchState, hooks: tuple[str, ...], answers: bool) -> None:
    """Raise a PolicyError if another part of the stack overrides one of `hooks` in a way that hides
    attention `me` needs. The stack asks its parts in order and takes the first answer: if `me`
    answers the hook itself (`answers`), any other part overriding it conflicts (one of the two
    would be skipped); otherwise only a part asked before `me` does."""
    for part in batch.policy.parts:
        if part is me:
            if answers:
                continue
            return
        for hook in hooks:
            if getattr(type(part), hook) is not getattr(Policy, hook):
                raise PolicyError(
                    f"{me.name!r} computes its own {hook.replace('_', ' ')} to score the cache, but "
                    f"{part.name!r} also answers that hook; these two cannot be stacked"
                )
