"""The selector toolbox, each piece against a direct computation (SFI, arXiv:2603.12038)."""

from __future__ import annotations

import math

import pytest
import torch

from cotserve.policies import selector as sel


def _simplex(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(*shape, generator=g) ** 3 + 1e-4
    return x / x.sum(-1, keepdim=True)


def _objective(s: torch.Tensor, f: torch.Tensor, r: torch.Tensor, lam: float) -> torch.Tensor:
    """KL(s||f) + lambda KL(s||r), computed directly."""
    return (s * (s.log() - f.log())).sum(-1) + lam * (s * (s.log() - r.log())).sum(-1)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0, 4.0])
def test_geometric_fusion_minimises_the_reverse_kl_objective(lam):
    f, r = _simplex(2, 40, seed=1), _simplex(2, 40, seed=2)
    cand = torch.ones(2, 40, dtype=torch.bool)
    s = sel.geometric_fusion(f, r, lam, cand).exp()
    assert torch.allclose(s.sum(-1), torch.ones(2), atol=1e-5)
    best = _objective(s, f, r, lam)
    # no perturbation on the simplex does better
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        p = torch.softmax(s.log() + 0.05 * torch.randn(s.shape, generator=g), -1)
        assert (_objective(p, f, r, lam) >= best - 1e-6).all()
    # first-order optimality (KKT on the simplex): the gradient is the same in every coordinate
    grad = (s.log() - f.log() + 1) + lam * (s.log() - r.log() + 1)
    assert (grad.max(-1).values - grad.min(-1).values).max() < 1e-4
    # a numeric optimiser (mirror descent on the simplex, no closed form) reaches the same point
    num = torch.full((2, 40), 1 / 40, dtype=torch.float64)
    fd, rd = f.double(), r.double()
    for _ in range(300):
        gd = (num.log() - fd.log()) + lam * (num.log() - rd.log())
        num = num * torch.exp(-0.5 / (1 + lam) * gd)
        num = num / num.sum(-1, keepdim=True)
    num = num.float()
    assert torch.allclose(_objective(num, f, r, lam), best, atol=1e-5)
    assert (num - s).abs().max() < 2e-3


def test_fusion_respects_candidates_and_linear_mixture():
    f, r = _simplex(3, 16, seed=4), _simplex(3, 16, seed=5)
    cand = torch.ones(3, 16, dtype=torch.bool)
    cand[:, :4] = False
    logs = sel.geometric_fusion(f, r, torch.tensor([[0.0], [0.5], [2.0]]), cand)
    assert torch.isinf(logs[:, :4]).all() and torch.isfinite(logs[:, 4:]).all()
    assert torch.allclose(logs.exp().sum(-1), torch.ones(3), atol=1e-5)
    # lambda = 0: the evidence itself (renormalized over the candidates)
    f0 = f[0, 4:] / f[0, 4:].sum()
    assert torch.allclose(logs[0, 4:].exp(), f0, atol=1e-6)
    lin = sel.linear_fusion(f, r, 0.25, torch.ones(3, 16, dtype=torch.bool)).exp()
    assert torch.allclose(lin, 0.75 * f + 0.25 * r, atol=1e-6)


def test_stability_lambda_is_the_clipped_minimiser_of_the_mixture_norm():
    f, r = _simplex(6, 30, seed=6), _simplex(6, 30, seed=7)
    f[0] = r[0]  # f == r: lambda 0
    for clip in (0.5, 1.0, 10.0):
        lam = sel.stability_lambda(f, r, clip).squeeze(-1)
        grid = torch.linspace(0, clip, 20001, dtype=torch.float64)
        for h in range(6):
            if h == 0:
                assert lam[0] == 0
                continue
            fh, rh = f[h].double(), r[h].double()
            norms = (((1 - grid)[:, None] * fh + grid[:, None] * rh) ** 2).sum(-1)
            assert abs(float(lam[h]) - float(grid[norms.argmin()])) <= clip / 20000 + 1e-4
        num = (f * (f - r)).sum(-1) / ((f - r) ** 2).sum(-1)
        assert torch.allclose(lam[1:], num[1:].clamp(0, clip), atol=1e-5)


def test_power_mean_limits():
    g = torch.Generator().manual_seed(8)
    f = torch.rand(4, 5, 12, generator=g) + 0.01
    geo = torch.exp(torch.log(f).mean(1))
    assert torch.allclose(sel.power_mean(f, 0.0, 1), geo, rtol=1e-5)
    assert torch.allclose(sel.power_mean(f.double(), 1e-4, 1), geo.double(), rtol=1e-3)
    assert torch.allclose(sel.power_mean(f, 1.0, 1), f.mean(1), rtol=1e-5)
    assert torch.allclose(sel.power_mean(f.double(), 60.0, 1), f.max(1).values.double(), rtol=4e-2)
    half = sel.power_mean(f, 0.5, 1)
    assert torch.allclose(half, (f.sqrt().mean(1)) ** 2, rtol=1e-5)
    assert (half >= geo - 1e-6).all() and (half <= f.mean(1) + 1e-6).all()


def test_evidence_is_a_power_mean_of_row_softmaxes_over_allowed_positions():
    g = torch.Generator().manual_seed(9)
    h, rows, s = 2, 6, 20
    logits = torch.randn(h, rows, s, generator=g) * 3
    allowed = torch.ones(h, rows, s, dtype=torch.bool)
    allowed[:, -1, -3:] = False  # a row that may not see the newest positions (causal)
    cand = torch.ones(h, s, dtype=torch.bool)
    cand[:, :2] = False  # sinks
    f = sel.evidence(logits, allowed, cand, alpha=0.5)
    for hi in range(h):
        acc = torch.zeros(s)
        for ri in range(rows):
            ok = allowed[hi, ri] & cand[hi]
            p = torch.zeros(s)
            p[ok] = torch.softmax(logits[hi, ri, ok], -1)
            acc += p.sqrt() / rows
        want = acc**2 / (acc**2).sum()
        assert torch.allclose(f[hi], want, atol=1e-6)
    assert (f[:, :2] == 0).all()


def test_priors_favour_small_norm_keys_and_brake_the_tail():
    norms = torch.tensor([[1.0, 2.0, 4.0, 0.5]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    lk = sel.key_norm_prior(norms, cand, power=1.0)
    mean = norms.mean()
    assert torch.allclose(lk, -torch.log(norms / mean), atol=1e-6)
    assert lk[0, 3] > lk[0, 0] > lk[0, 1] > lk[0, 2]
    pos = torch.arange(100).view(1, -1)
    lp = sel.position_prior(pos, now=100, decay=1.0, tail=10, brake=0.1)
    d = 100 - pos.float()
    want = -d / 100 + torch.log(0.1 + 0.9 * (d / 10).clamp(max=1))
    assert torch.allclose(lp, want, atol=1e-6)
    assert lp[0, 99] < lp[0, 95] < lp[0, 89]  # the newest are braked
    assert lp[0, 0] < lp[0, 50] < lp[0, 89]  # global decay outside the tail
    r = sel.prior([lk, lk * 0], cand)
    assert torch.allclose(r.sum(-1), torch.ones(1))


def _nms_direct(x: torch.Tensor, window: int, strength: float) -> torch.Tensor:
    out = x.clone()
    n = x.shape[-1]
    for p in range(n):
        lo, hi = max(0, p - window), min(n, p + window + 1)
        m = lo + int(torch.argmax(x[lo:hi]))
        if m != p:
            out[p] = x[p] - strength * max(0.0, 1 - abs(p - m) / (window + 1))
    return out


def test_soft_nms_keeps_local_maxima_and_suppresses_their_neighbours():
    x = torch.tensor([0.0, 1.0, 5.0, 1.0, 0.5, 0.2, 3.0, 0.1, -1.0])
    y = sel.soft_nms(x.view(1, -1), window=2, strength=1.0)[0]
    assert y[2] == 5.0 and y[6] == 3.0  # local maxima keep their score
    assert torch.isclose(y[1], torch.tensor(1.0 - 2 / 3)) and torch.isclose(y[3], torch.tensor(1.0 - 2 / 3))
    assert torch.isclose(y[4], torch.tensor(0.5 - 1 / 3))  # two away from the maximum: smaller penalty
    assert torch.allclose(y, _nms_direct(x, 2, 1.0))
    g = torch.Generator().manual_seed(10)
    z = torch.randn(3, 50, generator=g)
    z[1, :3] = float("-inf")
    got = sel.soft_nms(z, window=3, strength=0.7)
    assert torch.isinf(got[1, :3]).all()
    for i in (0, 2):
        assert torch.allclose(got[i], _nms_direct(z[i], 3, 0.7), atol=1e-6)
    assert torch.equal(sel.soft_nms(z, 0, 0.7), z)


def test_cross_head_exclusivity_lowers_a_shared_position_in_the_weaker_head():
    logs = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.1, 0.1, 0.4], [0.1, 0.1, 0.1, 0.7]]))
    out = sel.cross_head_exclusivity(logs, strength=1.0, temperature=1.0)
    assert out[0, 0] == logs[0, 0]  # head 0 is strongest at position 0
    pen = logs - out
    assert 0 < pen[1, 0] < pen[2, 0]  # the weaker the head at a shared position, the more it is lowered
    assert out[2, 3] == logs[2, 3] and out[1, 3] < logs[1, 3]
    # direct formula
    w = torch.softmax(logs / 0.5, dim=0)
    want = logs - 0.3 * (1 - w / w.max(0).values)
    assert torch.allclose(sel.cross_head_exclusivity(logs, 0.3, 0.5), want, atol=1e-6)
    assert (out <= logs + 1e-9).all() and (logs - out <= 1.0 + 1e-6).all()
    # -inf (non-candidates) stay -inf; one head alone: unchanged
    x = logs.clone()
    x[:, 0] = float("-inf")
    assert torch.isinf(sel.cross_head_exclusivity(x, 1.0)[:, 0]).all()
    assert torch.equal(sel.cross_head_exclusivity(logs[:1], 1.0), logs[:1])


def test_topk_per_head_returns_sorted_indices_of_the_best():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 64, generator=g)
    idx = sel.topk_per_head(x, 10)
    assert idx.shape == (3, 10)
    assert (idx[:, 1:] > idx[:, :-1]).all()
    for h in range(3):
        assert set(idx[h].tolist()) == set(torch.argsort(x[h], descending=True)[:10].tolist())
    assert not math.isnan(float(x.sum()))


def _instability_reference(logits: torch.Tensor, k: int, recent: int, oldest: int) -> torch.Tensor:
    """support_instability by loops: per KV head, the oldest row's top-k (group max) outside the
    window; per later row and query head, the largest weight outside top-k and window."""
    h, g, r, s = logits.shape
    out = torch.zeros(h)
    for hi in range(h):
        p = torch.softmax(logits[hi], dim=-1).nan_to_num(0.0)  # [G, R, S]
        score = p[:, oldest].max(dim=0).values
        keep = set(range(s - recent, s))
        keep |= set(torch.argsort(score[: s - recent], descending=True)[:k].tolist())
        misses = []
        for ri in range(r):
            if ri == oldest:
                continue
            for gi in range(g):
                misses.append(max([float(p[gi, ri, j]) for j in range(s) if j not in keep] or [0.0]))
        out[hi] = sum(misses) / len(misses)
    return out


def test_support_instability_matches_a_direct_computation_and_ranks_a_retrieval_head_first():
    g = torch.Generator().manual_seed(21)
    h, grp, r, s, k, recent = 3, 2, 5, 40, 6, 8
    logits = torch.randn(h, grp, r, s, generator=g)
    logits[..., :2] = float("-inf")  # sinks are not candidates
    logits[:, :, 1, 30:] = float("-inf")  # a row that may not look at the newest entries (causal)
    # head 0 is stable: every row peaks on the same old entry; head 1 retrieves: each later row
    # peaks on a different entry that the oldest row never looked at
    logits[0, :, :, 10] += 8.0
    logits[1, :, 0, 12] += 8.0
    for ri in range(1, r):
        logits[1, :, ri, 12 + 3 * ri] += 8.0
    for oldest in (0, 2):  # ring order: the oldest row need not come first
        x = logits.clone()
        if oldest:
            x[:, :, [0, oldest]] = x[:, :, [oldest, 0]]
        got = sel.support_instability(x, k, recent, oldest)
        assert torch.allclose(got, _instability_reference(x, k, recent, oldest), atol=1e-6)
    got = sel.support_instability(logits, k, recent)
    assert got[1] > 0.3 and got[0] < 0.05
    # with k covering every candidate nothing can be missed; a single row has nothing to test
    assert torch.all(sel.support_instability(logits, s, recent) == 0)
    assert torch.all(sel.support_instability(logits[:, :, :1], k, recent) == 0)
    # a row with no candidate at all (every entry -inf) misses nothing
    empty = torch.full((1, grp, 2, s), float("-inf"))
    empty[:, :, 0, 5] = 0.0
    assert torch.all(sel.support_instability(empty, 1, 0) == 0)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.3, 0.0])
def test_fused_evidence_and_instability_equal_the_two_separate_steps(alpha):
    """The slow step's fused pass gives `evidence` and `support_instability` of the same logits,
    including causal -inf tails, a row with no candidate, ring order and a single row."""
    g = torch.Generator().manual_seed(31)
    for h, grp, r, s, k, recent, oldest in [(3, 3, 8, 300, 40, 50, 2), (3, 2, 1, 30, 5, 4, 0), (2, 3, 4, 20, 30, 0, 1)]:
        x = torch.randn(h, grp, r, s, generator=g) * 3
        x[..., :4] = float("-inf")  # sinks
        x[:, :, min(1, r - 1), -10:] = float("-inf")  # causal
        x[0, 1, min(3, r - 1)] = float("-inf")  # a row with no candidate
        cand = (torch.arange(s) >= 4).expand(h, s)
        f_ref = sel.evidence(x.reshape(h, grp * r, s), None, cand, alpha)
        i_ref = sel.support_instability(x, k, recent, oldest)
        f, instab = sel.evidence_and_instability(x.clone(), alpha, k, recent, oldest)
        assert torch.allclose(f, f_ref, atol=1e-6)
        assert torch.allclose(instab, i_ref, atol=1e-6)
        if r > 1 and recent < s - k:
            assert float(instab.max()) > 0  # something to measure: the test can fail
        f2, none = sel.evidence_and_instability(x.clone(), alpha, k, recent, oldest, with_instability=False)
        assert none is None and torch.allclose(f2, f_ref, atol=1e-6)


def _selector_case(seed: int, p: int, h: int, n: int):
    from cotserve.policies.sfi.config import SFIConfig

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(p, h, 1, 3, n, generator=g) * 3.0
    logits[..., :4] = float("-inf")
    cfg = SFIConfig(k=min(64, n - 8), recent=16)
    f, _ = sel.evidence_and_instability(logits, cfg.alpha, cfg.k, cfg.recent, 0, False)
    pos = (torch.arange(n) * 2 + torch.randint(0, 2, (p, h, n), generator=g)).sort(-1).values  # true positions
    norms = torch.rand(p, h, n, generator=g) * 4.0 + 0.1
    return cfg, f, pos, norms, int(pos.max())


@pytest.mark.parametrize("opts", [{}, {"lam": 0.3}, {"nms_window": 3, "nms_strength": 0.8}, {"nms_window": 5},
                                  {"nms_strength": 0.0, "excl_strength": 0.0}, {"norm_power": 0.0, "brake": 1.0},
                                  {"tail": 5, "decay": 2.0, "excl_temperature": 0.5}])
def test_cpu_selector_equals_the_torch_selector(opts):
    """`cpu_decode.selector_scores` / `selector_select` (SFI's selector steps 2-5 in C++) against
    the torch form: scores to float rounding, -inf exactly where the torch form has it, and the
    same selected entries (any difference only between entries whose torch scores tie to float
    rounding at the k-th place)."""
    import dataclasses

    from cotserve.kernels import cpu_decode
    from cotserve.policies.sfi.selection import select_from_evidence, selector_scores_from_evidence

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    cfg, f, pos, norms, now = _selector_case(len(opts), 3, 4, 500)
    cfg = dataclasses.replace(cfg, **opts)
    want = selector_scores_from_evidence(cfg, f, pos, norms, now)
    got = cpu_decode.selector_scores(cfg, f, pos, norms, now)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and torch.all(got[~fin] == float("-inf"))
    assert torch.allclose(got[fin], want[fin], atol=2e-5, rtol=1e-5), (got[fin] - want[fin]).abs().max()
    ref = select_from_evidence(cfg, f, pos, norms, now)
    idx = select_from_evidence(cfg, f, pos, norms, now, kernel=True)
    assert idx.shape == ref.shape and torch.all(idx[..., 1:] > idx[..., :-1])
    kth = want.topk(cfg.k, dim=-1).values[..., -1:]  # the k-th best torch score per row
    for a, r, w, t in zip(idx.flatten(0, 1), ref.flatten(0, 1), want.flatten(0, 1), kth.flatten(0, 1), strict=True):
        diff = set(a.tolist()) ^ set(r.tolist())
        assert all(abs(float(w[i] - t)) < 1e-5 for i in diff), diff


def test_cpu_topk_equals_torch_topk_and_breaks_ties_by_index():
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 333, generator=g)
    x[0, 0, 10:40] = float("-inf")
    x[1, 1, :] = -x[1, 1, :].abs()  # all negative
    for k in (1, 17, 200, 333):
        assert torch.equal(cpu_decode.topk_ascending(x, k), sel.topk_per_head(x, k))
    ties = torch.tensor([[0.5, 1.0, 1.0, 0.2, 1.0, 1.0, -3.0]])
    assert cpu_decode.topk_ascending(ties, 3).tolist() == [[1, 2, 4]]
    assert cpu_decode.topk_ascending(ties, 5).tolist() == [[0, 1, 2, 4, 5]]
