"""SFI's selector for one sequence (paper Sec. 3): evidence from the observation rows' logits,
then prior, reverse-KL (geometric) fusion, soft-NMS, cross-head exclusivity and top-K, built from
the toolbox in `cotserve.policies.selector`. Used by the eager policy (`policy.py`) and by the
paged runtime's refresh (`paged.py`) when the fused Triton selector does not apply."""

from __future__ import annotations

import torch

from cotserve.kernels import cpu_decode
from cotserve.policies import selector as sel
from cotserve.policies.sfi.config import SFIConfig


def candidates(cfg: SFIConfig, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Bool mask (broadcast view, no memory) of the selectable entries: everything after the sinks."""
    s = shape[-1]
    return (torch.arange(s, device=device) >= cfg.sinks).expand(shape)


def select_positions(cfg: SFIConfig, logits: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor,
                     key_norms: torch.Tensor, now: int) -> torch.Tensor:
    """The whole SFI selector for one (sequence, layer): cache indices to keep per KV head.

    logits [H, R, S] (R = GQA group x observation rows), allowed bool [H, R, S] (causal per row;
    None: already applied to `logits` as -inf), positions [H, S] true positions of the entries,
    key_norms [H, S]. Candidates are the entries after the sinks. Returns long
    [H, min(k, S - sinks)] sorted ascending. `evidence_of` then `select_from_evidence`."""
    return select_from_evidence(cfg, evidence_of(cfg, logits, allowed), positions, key_norms, now)


def evidence_of(cfg: SFIConfig, logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Selector step 1, the evidence f (`selector.evidence`): logits [..., H, R, S] -> [..., H, S]."""
    cand = candidates(cfg, logits.shape[:-2] + logits.shape[-1:], logits.device)
    return sel.evidence(logits, allowed, cand, cfg.alpha)


def select_from_evidence(cfg: SFIConfig, f: torch.Tensor, positions: torch.Tensor, key_norms: torch.Tensor,
                         now: int, kernel: bool = False) -> torch.Tensor:
    """Selector steps 2-5 on the evidence f [..., H, S]: prior, fusion, soft-NMS, cross-head
    exclusivity, top-K per KV head. Any leading dims (e.g. the layers of one sequence, selected
    together after a slow step) are independent problems. Returns long [..., H, min(k, S - sinks)]
    sorted ascending. `kernel`: through the C++ selector (`cpu_decode.selector_select`, CPU
    tensors of [P, H, S], options it supports), the same selection up to float rounding; the
    torch form below is its reference."""
    s = f.shape[-1]
    k_eff = min(cfg.k, s - cfg.sinks)
    if k_eff <= 0:
        return torch.empty(*f.shape[:-1], 0, dtype=torch.long, device=f.device)
    if kernel and f.dim() == 3 and f.device.type == "cpu" and cpu_decode.selector_supported(cfg):
        return cpu_decode.selector_select(cfg, f, positions, key_norms, now, k_eff)
    return sel.topk_per_head(selector_scores_from_evidence(cfg, f, positions, key_norms, now), k_eff)


def selector_scores_from_evidence(cfg: SFIConfig, f: torch.Tensor, positions: torch.Tensor, key_norms: torch.Tensor,
                                  now: int) -> torch.Tensor:
    """Selector steps 2-4 (prior, fusion, soft-NMS, cross-head exclusivity): the final log score
    [..., H, S] of every entry, -inf outside the candidates; the top-K of it is the selection."""
    cand = candidates(cfg, f.shape, f.device)
    factors = [sel.position_prior(positions, now, cfg.decay, cfg.tail_len, cfg.brake)]
    if cfg.norm_power != 0.0:
        factors.append(sel.key_norm_prior(key_norms, cand, cfg.norm_power))
    r = sel.prior(factors, cand)
    lam = sel.stability_lambda(f, r, cfg.lam_clip) if cfg.lam < 0 else cfg.lam
    fuse = sel.geometric_fusion if cfg.fusion == "geometric" else sel.linear_fusion
    logs = fuse(f, r, lam, cand)
    logs = sel.soft_nms(logs, cfg.nms_window, cfg.nms_strength)
    return sel.cross_head_exclusivity(logs, cfg.excl_strength, cfg.excl_temperature)


def mask_rows_inplace(logits: torch.Tensor, positions: torch.Tensor, row_pos: torch.Tensor, sinks: int) -> None:
    """Write -inf where a query row may not look: the sinks (always read, so not candidates) and,
    per row, entries newer than the row's own position (causal). logits [H, G, R, S], positions
    [H, S] sorted ascending per head, row_pos [R]. Only the tail newer than the oldest row is
    touched, so this costs O(R x window) instead of a full mask."""
    logits[..., :sinks] = float("-inf")
    h, _, r, s = logits.shape
    oldest = row_pos.min().view(1, 1).expand(h, 1).contiguous()
    cut = int(torch.searchsorted(positions.contiguous(), oldest, right=True).min())
    if cut < s:
        tail = positions[:, cut:]  # [H, T]
        bad = tail.unsqueeze(1) > row_pos.view(1, r, 1)  # [H, R, T]
        logits[..., cut:].masked_fill_(bad.unsqueeze(1), float("-inf"))
