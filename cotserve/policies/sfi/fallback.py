"""Page-bound reads for SFI's unstable-head fallback (ours, not in the SFI paper).

A fallback head (`dense_heads`) does not keep a selection between refreshes: its support moves
with every query (a retrieval head). Reading its whole history each step is exact but costs a full
K/V pass per head. With `dense_budget > 0` it instead picks, every step, the pages most likely to
matter for the current query by Quest's criterion (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024, arXiv:2406.10774, Sec. 3.2): per page of
`page` consecutive entries the elementwise key minimum m and maximum M, and the upper bound of
the page's logits

    U(q, page) = sum_d max(q_d * m_d, q_d * M_d) = q+ . M + q- . m      (q+ = max(q, 0), q- = min(q, 0))

The `budget // page` pages with the largest bound (the max over the GQA group's query heads, which
share the KV head) are read, together with the first pages (those holding the sinks) and everything from the end
of the last bounded page on (the recent window and entries written since the bounds were taken).
Bounds are taken once per refresh, for the chosen heads only, over the full pages that lie before
the window at that time. `dense_budget = 0` reads the whole history (exact).
"""

from __future__ import annotations

import torch


def page_bounds(keys: torch.Tensor, page: int) -> torch.Tensor:
    """Elementwise max and min of the keys of each full page, stacked and transposed: keys [S, D]
    -> [2D, S // page] (rows 0..D-1 the max M, D..2D-1 the min m), so that the bound of every page
    is one matmul (`page_scores`)."""
    n_pages = keys.shape[0] // page
    k = keys[: n_pages * page].float().view(n_pages, page, keys.shape[-1])
    return torch.cat([k.amax(dim=1), k.amin(dim=1)], dim=1).t().contiguous()


def page_scores(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q . k over each page (arXiv:2406.10774, Sec. 3.2), q+ . M + q- . m as
    one matmul: q [G, D] (the query heads of one KV head), bounds [2D, P] (`page_bounds`).
    Returns [P], the max over the group."""
    qf = q.float()
    return (torch.cat([qf.clamp_min(0.0), qf.clamp_max(0.0)], dim=-1) @ bounds).amax(dim=0)


def pages_taken(n_pages: int, budget: int, page: int, sinks: int) -> tuple[int, int]:
    """(pages holding the first `sinks` entries, always read; pages read in all out of the
    `n_pages` bounded ones: `budget // page`, at least the sink pages, at most `n_pages`)."""
    first = -(-max(sinks, 1) // page)
    return first, min(max(budget // page, first), n_pages)


def entries_read(n_pages: int, budget: int, page: int, sinks: int, n: int) -> int:
    """How many of the `n` entries `page_read_indices` reads (everything when it takes every page)."""
    _, take = pages_taken(n_pages, budget, page, sinks)
    return n if take >= n_pages else take * page + n - n_pages * page


def page_read_indices(scores: torch.Tensor, budget: int, page: int, n: int, sinks: int = 1) -> torch.Tensor:
    """Cache indices one fallback head reads: the pages holding the first `sinks` entries, the
    best other pages by `scores` [P] (bounded pages; `pages_taken`), and every entry from P * page
    to n. `scores` is modified (the sink pages' entries are set to +inf)."""
    n_pages = scores.shape[0]
    first, take = pages_taken(n_pages, budget, page, sinks)
    if take >= n_pages:
        return torch.arange(n, device=scores.device)
    scores[:first] = float("inf")  # the sink pages are always read
    top = torch.topk(scores, take, sorted=False).indices  # attention is order-free: no sort
    rows = (top.unsqueeze(1) * page + torch.arange(page, device=scores.device)).flatten()
    return torch.cat([rows, torch.arange(n_pages * page, n, device=scores.device)])


def page_bound_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, budget: int,
                         page: int, scaling: float, sinks: int = 1) -> tuple[torch.Tensor, int]:
    """One fallback head's decode attention: q [G, 1, D] (its query heads), k / v [n, D] its whole
    history, `bounds` [2D, P] of its first P pages; the pages holding the first `sinks` entries
    are always read. Returns (out [G, 1, D], entries read)."""
    qg = q[:, 0]  # [G, D]
    idx = page_read_indices(page_scores(qg, bounds), budget, page, k.shape[0], sinks)
    kk = torch.index_select(k, 0, idx)
    vv = torch.index_select(v, 0, idx)
    # plain 2-D products (this runs per head and step: fewer ops than the batched grouped_attention)
    w = torch.softmax(torch.mm(qg * scaling, kk.t()).float(), dim=-1).to(vv.dtype)  # [G, T]
    return torch.mm(w, vv).unsqueeze(1), int(idx.numel())


def page_bound_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_pages: int, budget: int,
                         page: int, scaling: float, sinks: int = 1) -> torch.Tensor:
    """Plain reference of `page_bound_attention`: bounds by loops over pages and dimensions,
    pages ranked by the bound, attention per query head over the chosen entries."""
    g, _, d = q.shape
    n = k.shape[0]
    bound = torch.full((n_pages,), float("-inf"))
    for p in range(n_pages):
        keys = k[p * page : (p + 1) * page].float()
        for h in range(g):
            u = sum(max(float(q[h, 0, j]) * float(keys[:, j].min()), float(q[h, 0, j]) * float(keys[:, j].max()))
                    for j in range(d))
            bound[p] = max(float(bound[p]), u)
    first, take = pages_taken(n_pages, budget, page, sinks)
    if take >= n_pages:
        read = list(range(n))
    else:
        bound[:first] = float("inf")
        pages = sorted(torch.argsort(bound, descending=True)[:take].tolist())
        read = [p * page + i for p in pages for i in range(page)] + list(range(n_pages * page, n))
    idx = torch.tensor(read)
    out = torch.zeros_like(q)
    for h in range(g):
        w = torch.softmax((k[idx].float() @ q[h, 0].float()) * scaling, dim=-1)
        out[h, 0] = (w @ v[idx].float()).to(q.dtype)
    return out
