"""The selector toolbox: which KV positions each KV head should keep reading.

Shared by read-selection policies (SFI first; quest/sinkrouter/snapkv-style baselines may import
it). Each step is one small function on plain tensors, in the order SFI's Selector applies them
(Xie et al., "Slow-Fast Inference: Training-Free Inference Acceleration via Within-Sentence
Support Stability", arXiv:2603.12038, Sec. "Selector"):

  1. evidence f      `row_evidence` + `power_mean`  -> `evidence`
  2. prior r         `key_norm_prior` * `position_prior` -> `prior`
  3. fusion s        `stability_lambda`, `geometric_fusion` (paper) / `linear_fusion` (option)
  4. diversity       `soft_nms` (within a head), `cross_head_exclusivity` (across the KV heads of a layer)
  5. `topk_per_head` -> sorted cache indices

The forms below follow the paper's description of the method; where a detail (a kernel shape,
a default) is our choice, the docstring says so. Shapes: scores are `[..., H, S]` (H = KV heads, S = cache
entries); `cand` is a bool mask broadcastable to that, True where a position may be selected
(non-sink, valid). Distributions are normalized over the candidates; log scores are `-inf`
outside them.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
TINY = 1e-30


def row_evidence(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per-row attention evidence (SFI Selector, evidence Eq.): f_i(p) = softmax over the allowed
    positions of query row i's logits q_i.k_p/sqrt(d). `logits [..., R, S]`, `allowed` bool
    broadcastable to it. Rows with no allowed position are all zero."""
    masked = logits.float().masked_fill(~allowed, NEG_INF)
    probs = torch.softmax(masked, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def power_mean(f: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
    """Power mean M_alpha(f) = (mean_r f_r^alpha)^(1/alpha) over `dim` (SFI Selector: the query
    rows of a GQA group and of the observation window are combined this way; alpha = 0.5 in the
    paper's default). alpha -> 0 is the log-mean exp(mean_r log f_r) (geometric mean); alpha = 1
    the arithmetic mean; alpha -> inf the max."""
    if alpha == 0.0:
        return torch.exp(torch.log(f.clamp_min(TINY)).mean(dim=dim))
    return f.pow(alpha).mean(dim=dim).pow(1.0 / alpha)


def normalize(x: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Restrict a nonnegative score to the candidates and normalize it to a distribution."""
    x = x.masked_fill(~cand, 0.0)
    return x / x.sum(dim=-1, keepdim=True).clamp_min(TINY)


def evidence(logits: torch.Tensor, allowed: torch.Tensor | None, cand: torch.Tensor, alpha: float = 0.5
             ) -> torch.Tensor:
    """Evidence distribution f per KV head (SFI Selector, evidence Eq.): row softmaxes over the
    allowed candidate positions, combined over the rows (dim -2: GQA group x window) by the power
    mean, normalized over the candidates. `logits [..., H, R, S]` -> `[..., H, S]`.

    Fused form of `power_mean(row_evidence(...))` (same value, fewer passes over the rows):
    f_r^alpha = exp(alpha * (l_r - logsumexp(l_r))), so the softmax is never materialized.
    `allowed=None` skips the masking pass: the caller has already written -inf into `logits`
    wherever a row may not look (non-candidates included). Rows with no allowed position
    contribute zero."""
    x = logits.float()
    if allowed is not None:
        x = x.masked_fill(~(allowed & cand.unsqueeze(-2)), NEG_INF)
    if alpha == 0.0:
        m = x.amax(dim=-1, keepdim=True)
        empty = torch.isinf(m)  # a row with no allowed position
        lse = torch.logsumexp(x, dim=-1, keepdim=True).masked_fill(empty, 0.0)
        logp = (x - lse).clamp_min(math.log(TINY))
        out = torch.exp(logp.mean(dim=-2))
    else:
        out = _power_mean_of_rows(*_exp_rows(x, alpha, in_place=False), alpha)
    return normalize(out, cand)


def _exp_rows(x: torch.Tensor, alpha: float, in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The one exp pass behind `evidence` (alpha > 0): per row of `x [..., R, S]` (-inf where a
    row may not look), e = exp(alpha * (l - max)) and Z = sum_p exp(l - max) (from e: sum e^2 at
    alpha 0.5, sum e at 1). A row with no allowed position gives e = 0 and Z = 0 (otherwise
    Z >= 1). `in_place` overwrites x with e."""
    m = x.amax(dim=-1, keepdim=True)
    m.masked_fill_(torch.isinf(m), 0.0)
    if in_place:
        e = torch.add(m.mul_(-alpha), x, alpha=alpha, out=x).exp_()
    else:
        e = torch.sub(x, m).mul_(alpha).exp_()
    if alpha == 0.5:
        z = torch.linalg.vecdot(e, e, dim=-1)
    elif alpha == 1.0:
        z = e.sum(-1)
    else:
        z = e.pow(1.0 / alpha).sum(-1)
    return e, z


def _power_mean_of_rows(e: torch.Tensor, z: torch.Tensor, alpha: float) -> torch.Tensor:
    """M_alpha over the rows of the row softmaxes, from `_exp_rows`: f_r^alpha = e_r / Z_r^alpha,
    mean over rows (empty rows count zero), then the 1/alpha power. Unnormalized `[..., S]`."""
    w = z.clamp_min(TINY).pow(-alpha).masked_fill_(z == 0, 0.0) / e.shape[-2]  # [..., R]
    return torch.matmul(w.unsqueeze(-2), e).squeeze(-2).clamp_min_(0.0).pow_(1.0 / alpha)


def key_norm_prior(key_norms: torch.Tensor, cand: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """Key-norm factor of the prior (SFI Selector, prior Eq.): r_k(p) ∝ (||k_p|| / mean ||k||)^-power.
    Large-norm keys win dot products for reasons other than relevance (logit inflation), so the
    prior favours small-norm keys; `power` = 0 switches the factor off. Returns unnormalized
    log-factors `[..., H, S]` (0 outside the candidates)."""
    norms = key_norms.float().clamp_min(TINY)
    c = cand.float()
    mean = (norms * c).sum(-1, keepdim=True) / c.sum(-1, keepdim=True).clamp_min(1.0)
    return (-power * torch.log(norms / mean.clamp_min(TINY))).masked_fill(~cand, 0.0)


def position_prior(positions: torch.Tensor, now: int | torch.Tensor, decay: float = 1.0, tail: int = 256,
                   brake: float = 0.05) -> torch.Tensor:
    """Position factor of the prior (SFI Selector, prior Eq.), as unnormalized log-factors:

    * global decay: log r = -decay * d / now, d = now - position (older positions slightly less
      likely; scale-free because d is measured relative to the context length `now`);
    * tail brake: the `tail` most recent positions are damped by a linear ramp from `brake` (the
      newest) to 1 (d = tail), since they are read anyway by the recent window and would otherwise
      win on recency alone. The ramp shape is our choice (the method names only a "tail brake").
    """
    now_t = torch.as_tensor(now, device=positions.device, dtype=torch.float32)
    d = (now_t - positions.float()).clamp_min(0.0)
    out = -decay * d / now_t.clamp_min(1.0)
    if tail > 0 and brake < 1.0:
        ramp = brake + (1.0 - brake) * (d / float(tail)).clamp(max=1.0)
        out = out + torch.log(ramp.clamp_min(TINY))
    return out


def prior(log_factors: list[torch.Tensor], cand: torch.Tensor) -> torch.Tensor:
    """The prior r: product of the factors (sum of their logs), normalized over the candidates."""
    total = sum(log_factors[1:], log_factors[0])
    total = total.masked_fill(~cand, NEG_INF)
    return torch.softmax(total, dim=-1).nan_to_num(0.0)


def stability_lambda(f: torch.Tensor, r: torch.Tensor, clip: float = 1.0) -> torch.Tensor:
    """Per-head fusion weight by the stability rule (SFI Selector, Eq. for lambda*):
    lambda* = <f, f - r> / ||f - r||^2, the minimiser of ||(1-lambda) f + lambda r||^2 (the mixture's
    collision mass: the most spread, hence most stable, mixture), clipped to [0, clip].
    `f, r [..., H, S]` -> `[..., H, 1]`; 0 where f == r."""
    diff = f - r
    num = (f * diff).sum(-1, keepdim=True)
    den = (diff * diff).sum(-1, keepdim=True)
    lam = torch.where(den > 0, num / den.clamp_min(TINY), torch.zeros_like(num))
    return lam.clamp(0.0, clip)


def geometric_fusion(f: torch.Tensor, r: torch.Tensor, lam: torch.Tensor | float, cand: torch.Tensor) -> torch.Tensor:
    """Fusion by the paper's reverse-KL objective (SFI Selector, fusion Eq.):
    s* = argmin_s KL(s||f) + lambda KL(s||r) = f^(1/(1+lambda)) r^(lambda/(1+lambda)) / Z
    (setting the gradient of sum s log s - sum s (log f + lambda log r)/(1+lambda) to zero under
    sum s = 1). Returns log s `[..., H, S]`, normalized, -inf outside the candidates."""
    lam = torch.as_tensor(lam, dtype=torch.float32, device=f.device)
    logs = (torch.log(f.clamp_min(TINY)) + lam * torch.log(r.clamp_min(TINY))) / (1.0 + lam)
    logs = logs.masked_fill(~cand, NEG_INF)
    return torch.log_softmax(logs, dim=-1)


def linear_fusion(f: torch.Tensor, r: torch.Tensor, lam: torch.Tensor | float, cand: torch.Tensor) -> torch.Tensor:
    """Linear mixture s = (1 - lambda) f + lambda r (an option; the forward-KL counterpart of the
    paper's geometric fusion), lambda clipped to [0, 1]. Returns log s, -inf outside candidates."""
    lam = torch.as_tensor(lam, dtype=torch.float32, device=f.device).clamp(0.0, 1.0)
    s = normalize((1.0 - lam) * f + lam * r, cand)
    return torch.log(s.clamp_min(TINY)).masked_fill(~cand, NEG_INF)


def soft_nms(logs: torch.Tensor, window: int, strength: float) -> torch.Tensor:
    """Soft non-maximum suppression in log-score space (SFI Selector, diversity step).

    Neighbouring tokens carry overlapping information, so a position that is not the maximum of
    its +-`window` neighbourhood is lowered by strength * overlap, overlap = 1 - |p - m|/(window+1)
    where m is the neighbourhood's maximum (Soft-NMS's linear decay, Bodla et al. 2017, with 1-D
    distance as the overlap). Local maxima keep their score. This is the one-pass (parallel) form
    of greedy Soft-NMS: each position is suppressed by the strongest position around it (when
    several positions share that maximum, the nearest one). Computed with one max-pool (no
    indices: far cheaper on CPU) and 2 x window shifted comparisons. `logs [..., S]`."""
    if window <= 0 or strength == 0.0:
        return logs
    shape = logs.shape
    x = logs.reshape(-1, shape[-1]).float()
    lowest = torch.finfo(torch.float32).min
    xf = x.clamp_min(lowest)  # -inf (non-candidates) pools as a finite minimum
    mx = torch.nn.functional.max_pool1d(xf.unsqueeze(1), 2 * window + 1, stride=1, padding=window).squeeze(1)
    padded = torch.nn.functional.pad(xf, (window, window), value=lowest)
    s = shape[-1]
    # penalty by the distance to the nearest position holding the neighbourhood maximum:
    # farthest first, so nearer hits overwrite; the maximum itself (distance 0) pays nothing
    penalty = torch.zeros_like(x)
    for d in range(window, 0, -1):
        hit = (padded[:, window - d : window - d + s] == mx).logical_or_(padded[:, window + d : window + d + s] == mx)
        penalty.masked_fill_(hit, strength * (1.0 - d / float(window + 1)))
    penalty.masked_fill_(xf == mx, 0.0)
    return (x - penalty).reshape(shape)


def cross_head_exclusivity(logs: torch.Tensor, strength: float, temperature: float = 1.0) -> torch.Tensor:
    """Cross-head exclusivity across the KV heads of one layer (SFI Selector, diversity step).

    The heads of a layer have separate budgets; spending several of them on the same position adds
    little. Ownership w_h(p) = softmax over heads of log s_h(p) / temperature; each head's score
    is lowered by strength * (1 - w_h(p) / max_h' w_h'(p)): the strongest head keeps a shared
    position untouched, the weaker heads are pushed towards other positions (the penalty is at
    most `strength` nats). `logs [..., H, S]` (H on dim -2), per-head normalized log scores."""
    if strength == 0.0 or logs.shape[-2] < 2:
        return logs
    x = logs.clamp_min(-1e30)  # -inf (non-candidates): finite for the softmax; stays -inf below
    w = torch.softmax(x / temperature, dim=-2)
    rel = w / w.max(dim=-2, keepdim=True).values.clamp_min(TINY)
    return logs - strength * (1.0 - rel)


def topk_per_head(logs: torch.Tensor, k: int) -> torch.Tensor:
    """Top-K per KV head, returned sorted by cache index (ascending, for locality when packing).
    `logs [..., H, S]` -> long `[..., H, k]`; k must not exceed the number of candidates.
    The ascending order comes from a membership mask (scatter + nonzero), cheaper than a sort."""
    k = min(k, logs.shape[-1])
    idx = torch.topk(logs, k, dim=-1, sorted=False).indices
    member = torch.zeros(logs.shape, dtype=torch.bool, device=logs.device).scatter_(-1, idx, True)
    cols = member.reshape(-1, logs.shape[-1]).nonzero()[:, 1]
    return cols.view(idx.shape)


def support_instability(logits: torch.Tensor, k: int, recent: int, oldest: int = 0) -> torch.Tensor:
    """How much a head's attention escapes a selection made `R - 1` queries earlier, per KV head
    (ours: the test behind SFI's `dense_heads` fallback, not a step of the paper's selector).

    SFI rests on the attention support staying put within a sentence (Xie et al.,
    arXiv:2603.12038). Some heads break that premise: retrieval/copy heads look up a different
    earlier token for each new query (the "retrieval heads" of DuoAttention, Xiao et al.,
    arXiv:2410.10819, which keeps such heads dense). This measures it on the observation rows a
    refresh already has: the oldest row picks its top-`k` entries (its attention, max over the GQA
    group) outside the last `recent` entries; for each later row and query head, the largest
    attention weight on an entry outside that set and outside the window is the miss. Returns the
    mean miss over the later rows and the group, `[..., H]` in [0, 1] (0 with a single row; rows
    with no candidate at all count 0).

    The PEAK miss, not the missed mass: a diffuse head (e.g. a first layer that averages over the
    context) loses much mass to any top-k yet its output barely moves, since the missed entries
    are many and small; a retrieval head loses one large weight, which moves its output. On the
    bundled model the peak ranks the heads as the output error of a 16-step-stale exact top-k
    does; the missed mass ranks the first layer's diffuse heads first.

    `logits [..., H, G, R, S]`, already -inf wherever a row may not look (the sinks included:
    weights are over the candidates); `oldest` is the index of the oldest row (the rows of a ring
    buffer need not be in order; the others are all later)."""
    rows, s = logits.shape[-2], logits.shape[-1]
    if rows < 2:
        return torch.zeros(logits.shape[:-3], device=logits.device)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [..., H, G, R]; -inf for a row with no candidate
    first = torch.softmax(x[..., oldest, :], dim=-1).nan_to_num_(0.0).amax(dim=-2)  # [..., H, S]
    w = min(recent, s)
    old = first[..., : s - w]
    keep = torch.zeros_like(first, dtype=torch.bool)
    take = min(k, old.shape[-1])
    if take > 0:
        keep[..., : s - w].scatter_(-1, old.topk(take, dim=-1, sorted=False).indices, True)
    keep[..., s - w :] = True
    # the largest missed weight of a row is exp(largest missed logit - logsumexp): no softmax pass
    top_missed = x.masked_fill(keep.unsqueeze(-2).unsqueeze(-2), NEG_INF).amax(dim=-1)  # [..., H, G, R]
    missed = torch.exp(top_missed - lse).nan_to_num_(0.0)
    missed[..., oldest] = 0.0  # the row that chose tests nothing
    return missed.sum(dim=-1).mean(dim=-1) / (rows - 1)


def evidence_and_instability(logits: torch.Tensor, alpha: float, k: int, recent: int, oldest: int,
                             with_instability: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused `evidence(logits, None, cand, alpha)` and `support_instability(logits, k, recent,
    oldest)`: the same values from one row-wise e = exp(alpha * (l - max)) (the slow step's hot
    loop: it runs for every layer of a refreshing sequence). Every softmax weight the instability
    needs is e^(1/alpha) / Z with Z = sum_p exp(l - max) (= sum e^2 at alpha 0.5, sum e at 1), so
    neither a logsumexp nor a softmax nor a masked copy of the rows is formed.
    `logits [..., H, G, R, S]` float32, already -inf wherever a row may not look (the sinks
    included: both results are over the candidates); it is CONSUMED (overwritten in place).
    Returns (f [..., H, S] normalized, instability [..., H] or None). alpha = 0 (the log-mean)
    has no such shared pass and takes the two unfused functions."""
    if alpha == 0.0:
        instab = support_instability(logits, k, recent, oldest) if with_instability else None
        rows = logits.flatten(-3, -2)
        return evidence(rows, None, torch.isfinite(rows).any(dim=-2), alpha), instab
    *lead, h, g, r, s = logits.shape
    e, z = _exp_rows(logits.view(*lead, h, g * r, s), alpha, in_place=True)  # [..., H, G*R, S], [..., H, G*R]
    f = _power_mean_of_rows(e, z, alpha)
    f = f / f.sum(dim=-1, keepdim=True).clamp_min(TINY)
    if not with_instability or r < 2:
        return f, (torch.zeros(f.shape[:-1], device=f.device) if with_instability else None)
    e = e.view(*lead, h, g, r, s)
    z = z.view(*lead, h, g, r)
    inv = 1.0 / alpha
    first = (e[..., oldest, :].pow(inv) / z[..., oldest, None]).nan_to_num_(0.0).amax(dim=-2)  # [..., H, S]
    wlen = min(recent, s)
    take = min(k, s - wlen)
    if take > 0:
        keep = first[..., : s - wlen].topk(take, dim=-1, sorted=False).indices.reshape(-1, take)
        rows = e.view(-1, g * r, s)
        for i in range(rows.shape[0]):  # per KV head: one index_fill over its rows (cheaper than a scatter)
            rows[i].index_fill_(-1, keep[i], 0.0)
    e[..., s - wlen :] = 0.0
    missed = (e.amax(dim=-1).pow_(inv) / z).nan_to_num_(0.0)  # [..., H, G, R]: peak weight outside
    missed[..., oldest] = 0.0  # the row that chose tests nothing
    return f, missed.sum(dim=-1).mean(dim=-1) / (r - 1)
