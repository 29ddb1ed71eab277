"""Token-scoring pieces shared by the eviction policies (plain torch, one sequence at a time).

Shapes: keys `k [Hkv, n, D]` of ONE sequence (valid entries only, in position order), the last
`w` queries `q [Hq, w, D]` (RoPE applied, like the cached keys), true positions `k_pos [Hkv, n]`
and `q_pos [w]`. Query heads are grouped onto KV heads as in GQA (`Hq = G * Hkv`, query head
`h` reads KV head `h // G`).

* `window_attention`: the attention probabilities of the last `w` queries over the keys.
* `attention_importance`: R-KV importance (Cai et al., arXiv 2505.24133, Sec. 3.2; reused by
  SkipKV, arXiv 2512.07993, Sec. 4.1): attention of the last `w` observation queries over the
  past keys, averaged over the `w` queries, query heads of a GQA group reduced by max, then a
  1-D max-pool (kernel 7) over neighbouring keys.
* `key_redundancy`: R-KV redundancy (Sec. 3.3): cosine similarity between keys, the most recent
  highly similar copies exempted, averaged per key and softmax-normalised.
* `mix_scores`: R-KV's joint score `lambda * importance - (1 - lambda) * redundancy` (Sec. 3.4);
  SkipKV calls the mixing weight sigma and subtracts its sentence penalty on top.
* `protected_top`: the selection rule of every eviction policy (`eviction.ScoredEviction`): protected
  first and last entries plus the top-scored others; `select_keep`: its R-KV form (the top
  `budget - w` candidates plus the `w` most recent entries per KV head).

Where the public R-KV code (github.com/Zefan-Cai/R-KV, `compute_scores`/`cal_similarity`) differs
from the paper's description, the paper's form is the default and the code's form an option:

* GQA reduction: the paper reduces each group's attention PROBABILITIES by max (`gqa_pool="prob"`);
  the code takes the max over the group's LOGITS before the softmax (`gqa_pool="logit"`).
* Importance normalisation: by default each window query's softmax runs over every key it could
  causally see (its real attention distribution, `normalize="causal"`); the code renormalises over
  the candidate (pre-window) keys only (`normalize="past"`).
* Redundancy: a row with no neighbour above the threshold exempts nothing; the code then zeroes
  the similarity to key 0 instead (`reference_quirk=True` reproduces that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    hq, hkv = q.shape[0], k.shape[0]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group onto {hkv} KV heads")
    return hq // hkv


def window_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled logits of each query head over its group's keys: [Hq, w, n]."""
    g = group_size(q, k)
    hkv, n, d = k.shape
    qg = q.float().reshape(hkv, g * q.shape[1], d)
    logits = torch.matmul(qg, k.float().transpose(-1, -2)) * scaling
    return logits.reshape(hkv * g, q.shape[1], n)


def causal_mask(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, hq: int, w: int, n: int,
                g: int) -> torch.Tensor | None:
    """Bool [Hq, w, n]: key visible to the query (key position <= query position)."""
    if q_pos is None or k_pos is None:
        return None
    kp = k_pos.repeat_interleave(g, dim=0)  # [Hq, n]
    return kp.unsqueeze(1) <= q_pos.view(1, w, 1)


def window_attention(q: torch.Tensor, k: torch.Tensor, scaling: float, q_pos: torch.Tensor | None = None,
                     k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities [Hq, w, n] of the window queries (causal by true position when
    positions are given, so a window query never sees a later window key)."""
    logits = window_logits(q, k, scaling)
    mask = causal_mask(q_pos, k_pos, q.shape[0], q.shape[1], k.shape[1], group_size(q, k))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def max_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max-pool over the last dim, stride 1, same length (kernel odd): R-KV Sec. 3.2."""
    if kernel <= 1:
        return x
    lead = x.shape[:-1]
    y = F.max_pool1d(x.reshape(-1, 1, x.shape[-1]), kernel_size=kernel, stride=1, padding=kernel // 2)
    return y.reshape(*lead, x.shape[-1])


def attention_importance(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int, kernel: int = 7,
                         q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                         gqa_pool: str = "prob", normalize: str = "causal") -> torch.Tensor:
    """Importance of the candidate keys (all but the last `window` entries): [Hkv, n - window].

    R-KV Sec. 3.2 / SkipKV Sec. 4.1: I_i = maxpool_kernel( max_{h in group} mean_{t in window}
    softmax(q_t k^T / sqrt(d))_i ). See the module docstring for the `gqa_pool` and `normalize`
    options (paper form by default)."""
    g = group_size(q, k)
    hkv, n, _ = k.shape
    w = q.shape[1]
    m = n - window
    if m <= 0:
        return k.new_zeros(hkv, 0, dtype=torch.float32)
    logits = window_logits(q, k, scaling)  # [Hq, w, n]
    mask = causal_mask(q_pos, k_pos, q.shape[0], w, n, g)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if normalize == "past":
        logits = logits[..., :m]
    elif normalize != "causal":
        raise ValueError(f"normalize must be 'causal' or 'past', got {normalize!r}")
    if gqa_pool == "logit":
        pooled = logits.reshape(hkv, g, w, -1).amax(dim=1)  # [Hkv, w, n']
        probs = torch.softmax(pooled, dim=-1)
        imp = probs.nan_to_num(0.0).mean(dim=1)[..., :m]
    elif gqa_pool == "prob":
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [Hq, w, n']
        imp = probs.mean(dim=1).reshape(hkv, g, -1).amax(dim=1)[..., :m]
    else:
        raise ValueError(f"gqa_pool must be 'prob' or 'logit', got {gqa_pool!r}")
    return max_pool(imp, kernel)


def key_similarity(k: torch.Tensor) -> torch.Tensor:
    """Cosine similarity between a head's keys, diagonal zeroed: [Hkv, n, n]."""
    kn = _unit_keys(k)
    sim = torch.matmul(kn, kn.transpose(-1, -2))
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    return sim


def _unit_keys(k: torch.Tensor) -> torch.Tensor:
    return k.float() / (k.float().norm(dim=-1, keepdim=True) + 1e-8)


# similarities `key_redundancy` holds at once (float32: 512 MiB, about 1.3 GiB with the comparisons
# made from them): n x n per head grows past any GPU at long contexts (8 KV heads of a 32,000-entry
# prompt are 30 GiB), so the rows go in chunks; a sequence that fits is one chunk, as before
REDUNDANCY_FLOATS = 1 << 27


def key_redundancy(k: torch.Tensor, threshold: float = 0.5, retain: int = 1,
                   reference_quirk: bool = False, max_floats: int = REDUNDANCY_FLOATS) -> torch.Tensor:
    """Redundancy of every key: [Hkv, n], each head's row sums to 1.

    R-KV Sec. 3.3: S = cos(K, K) with S_ii = 0. For each key i, among the keys j with S_ij > T
    (`threshold`) the `retain` most recent ones are exempted (S_ij := 0): the newest copies of a
    repeated content are the ones kept. The redundancy of key j is then softmax_j(mean_i S_ij):
    a key that many other keys resemble (and that is not their newest copy) scores high.

    The same function as `key_redundancy_reference`, computed with fewer passes over the n x n
    similarities for `retain` 0 and 1 (R-KV's default): column sums of S minus each row's
    exempted entry, found as the last above-threshold key of the row (no cumulative count). The
    similarities are made a block of rows (and heads) at a time, at most `max_floats` of them."""
    if retain > 1:
        return key_redundancy_reference(k, threshold, retain, reference_quirk)
    h, n = k.shape[0], k.shape[1]
    if n == 0:
        return torch.zeros(h, 0, dtype=torch.float32, device=k.device)
    kn = _unit_keys(k)
    rows = max(1, min(n, max_floats // n))
    heads = max(1, min(h, max_floats // (rows * n)))
    col = torch.zeros(h, n, dtype=torch.float32, device=k.device)
    exempt = retain == 1 or reference_quirk
    last = torch.empty(h, n, dtype=torch.long, device=k.device) if exempt else None
    value = torch.empty(h, n, dtype=torch.float32, device=k.device) if exempt else None
    none = -torch.ones((), dtype=torch.long, device=k.device)
    for h0 in range(0, h, heads):
        h1 = min(h, h0 + heads)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            sim = torch.matmul(kn[h0:h1, a:b], kn[h0:h1].transpose(-1, -2))  # [heads, b - a, n]
            sim.diagonal(offset=a, dim1=-2, dim2=-1).zero_()
            col[h0:h1] += sim.sum(dim=-2)
            if not exempt:
                continue
            above = sim > threshold
            has, first_rev = above.flip(-1).view(torch.uint8).max(dim=-1)  # first above key from the newest end
            has = has.bool()
            if retain == 1:
                pick = torch.where(has, n - 1 - first_rev, none)  # the row's exempted key, -1 none
            else:
                pick = torch.full_like(first_rev, -1)
            if reference_quirk:  # the code's argmax over an all-zero row picks key 0
                pick = torch.where(has, pick, torch.zeros_like(pick))
            last[h0:h1, a:b] = pick
            value[h0:h1, a:b] = sim.gather(-1, pick.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    if exempt:
        col = col - _column_totals(value, last)
    return torch.softmax(col / n, dim=-1)


def _column_totals(value: torch.Tensor, col_of_row: torch.Tensor) -> torch.Tensor:
    """[H, n]: for each column j, the sum of value[h, i] (row i's similarity to the column it
    picked) over the rows i with col_of_row[h, i] == j (-1: the row picks no column). Summed per
    column through a sort and a float64 running sum rather than atomic adds, so the result does
    not vary from run to run."""
    h, n = col_of_row.shape
    picked = col_of_row >= 0
    v = value.double() * picked
    key = torch.where(picked, col_of_row, torch.full_like(col_of_row, n))
    key, order = key.sort(dim=-1, stable=True)
    run = torch.nn.functional.pad(v.gather(-1, order).cumsum(-1), (1, 0))
    cols = torch.arange(n, device=value.device).expand(h, n).contiguous()
    hi = torch.searchsorted(key, cols, right=True)
    lo = torch.searchsorted(key, cols, right=False)
    return (run.gather(-1, hi) - run.gather(-1, lo)).to(value.dtype)


def key_redundancy_reference(k: torch.Tensor, threshold: float = 0.5, retain: int = 1,
                             reference_quirk: bool = False) -> torch.Tensor:
    """`key_redundancy` written as the paper states it (a rank of the above-threshold keys from the
    newest end, a masked similarity matrix, its row mean): the reference it is tested against, and
    the path for `retain` > 1."""
    sim = key_similarity(k)
    n = sim.shape[-1]
    if n == 0:
        return sim.new_zeros(sim.shape[:-1])
    above = sim > threshold
    # number of above-threshold neighbours at index >= j, per row: rank from the newest end
    from_end = above.flip(-1).to(torch.int32).cumsum(-1).flip(-1)
    exempt = above & (from_end <= retain)
    if reference_quirk:
        none = ~above.any(-1)  # the code's argmax over an all-zero row picks key 0
        exempt[..., 0] |= none
    sim = sim.masked_fill(exempt, 0.0)
    return torch.softmax(sim.mean(dim=-2), dim=-1)


def mix_scores(importance: torch.Tensor, redundancy: torch.Tensor, sigma: float) -> torch.Tensor:
    """R-KV Eq. (joint score, Sec. 3.4) / SkipKV Sec. 4.1: sigma * I - (1 - sigma) * R."""
    return sigma * importance - (1.0 - sigma) * redundancy


def protected_top(scores: torch.Tensor | None, n: int, budget: int, first: int, last: int, heads: int,
                  device: torch.device) -> torch.Tensor:
    """The selection rule of every eviction policy: indices [heads, budget] kept out of `n` entries,
    sorted. The `first` entries and the `last` entries are protected; the other `budget - first - last`
    are the top candidates by `scores` ([heads, n - first - last], the entries first .. n - last - 1;
    unused, and may be None, when nothing is left to choose)."""
    last = min(last, budget - first)
    chosen = budget - first - last
    parts = [torch.arange(first, device=device).expand(heads, -1)]
    if chosen > 0:
        assert scores is not None
        parts.append(scores.topk(min(chosen, scores.shape[-1]), dim=-1).indices + first)
    parts.append(torch.arange(n - last, n, device=device).expand(heads, -1))
    return torch.cat(parts, dim=-1).sort(dim=-1).values


def select_keep(scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Indices to keep per KV head, sorted: the top `budget - window` candidates by score (scores
    cover entries 0..m-1) plus the `window` most recent entries m..m+window-1. [Hkv, budget]."""
    hkv, m = scores.shape
    return protected_top(scores, m + window, budget, 0, window, hkv, scores.device)
