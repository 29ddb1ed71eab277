"""Scores over several samples per item, and their intervals.

With `--samples n` every item has n graded replies (fewer where some failed). Per item, with c of
its n replies correct:

- `avg@n`: c / n, the mean score (the accuracy column; it estimates pass@1);
- `pass@k` (k = 1, 2, 4, ... up to n, and n): the unbiased estimator of Chen et al. (2021),
  1 - C(n-c, k) / C(n, k), the chance that k replies drawn without replacement from the n hold
  at least one correct one (items with fewer than k replies are left out of pass@k);
- `maj@n`: the majority vote over the n extracted answers is correct. Replies that extracted
  nothing do not vote; equal answers are grouped by the suite's own comparison (correct ones
  are all equal to the reference, so they form one group; wrong ones are grouped when they are
  equal to each other: letters for multiple choice, numbers for GSM8K, math-verify for math); a
  tie goes to the answer given first (lowest sample index). Code suites have no maj@n (programs
  are not votes).

Every score is averaged over items, and its 95% interval treats an item as one unit: a Student-t
interval over the per-item scores (mean +- t(0.975, m-1) * sd / sqrt(m), m items, clipped to
[0, 1]), so the n samples of an item, which are not independent trials of the benchmark, do not
narrow it. With one item the interval is [0, 1]; when every item scores the same it is that point.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one item with c of n samples correct (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    series, term = 1.0, 1.0
    if df % 2 == 1:  # 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), (df-1)/2 terms
        for j in range(1, (df - 1) // 2):
            term *= (2 * j) / (2 * j + 1) * c2
            series += term
        inner = math.sin(theta) * math.cos(theta) * series if df > 1 else 0.0
        return 2 / math.pi * (theta + inner)
    for j in range(1, df // 2):  # sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df/2 terms
        term *= (2 * j - 1) / (2 * j) * c2
        series += term
    return math.sin(theta) * series


@lru_cache(maxsize=256)
def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| < t) = level, df degrees of freedom (bisection on the exact CDF)."""
    if df < 1:
        raise ValueError("t_quantile needs df >= 1")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < level:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        if _t_two_sided(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def item_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The t-interval of the mean of per-item scores, clipped to [0, 1] (see the module doc)."""
    m = len(values)
    if m == 0:
        return (0.0, 0.0)
    if m == 1:
        return (0.0, 1.0)
    mean = statistics.fmean(values)
    half = t_quantile(level, m - 1) * statistics.stdev(values) / math.sqrt(m)
    return (max(0.0, mean - half), min(1.0, mean + half))


def majority_correct(answers: list[tuple[str | None, bool]],
                     equal: Callable[[str, str], bool] | None = None) -> bool:
    """maj@n for one item: `answers` are (extracted answer or None, correct) in sample order."""
    groups: list[list[Any]] = []  # [representative, votes, first index, correct]
    for i, (ans, ok) in enumerate(answers):
        if ans is None:
            continue
        for g in groups:
            if (ok and g[3]) or (not ok and not g[3] and (equal or _same_text)(g[0], ans)):
                g[1] += 1
                break
        else:
            groups.append([ans, 1, i, ok])
    if not groups:
        return False
    best = max(groups, key=lambda g: (g[1], -g[2]))
    return bool(best[3])


def _same_text(a: str, b: str) -> bool:
    return "".join(a.split()) == "".join(b.split())


def answer_equality(kind: str) -> Callable[[str, str], bool] | None:
    """How two wrong answers of a suite kind are compared for the vote (None: no maj@n)."""
    if kind == "code":
        return None
    if kind == "gpqa":
        return lambda a, b: a.strip().upper() == b.strip().upper()
    if kind == "gsm8k":
        from cotserve.eval.graders.gsm8k import number_equal

        return lambda a, b: _same_text(a, b) or number_equal(a, b)[0]
    if kind == "math":
        from cotserve.eval.graders.math import math_equal

        return lambda a, b: _same_text(a, b) or math_equal(a, b)
    return _same_text


def _metric(values: list[float]) -> dict[str, Any]:
    lo, hi = item_interval(values)
    return {"value": round(statistics.fmean(values), 4) if values else None,
            "ci95": [round(lo, 4), round(hi, 4)], "items": len(values)}


def sample_metrics(records: Iterable[dict[str, Any]], samples: int, kind: str | None) -> dict[str, Any]:
    """avg@n, pass@k and maj@n over the items of one (suite, variant), each with its interval
    over items. `records` are graded log lines (`id`, `sample`, `correct`, `extracted`)."""
    by_item: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_item.setdefault(str(r["id"]), []).append(r)
    for recs in by_item.values():
        recs.sort(key=lambda r: int(r.get("sample", 0)))
    n_items = [(len(recs), sum(bool(r["correct"]) for r in recs)) for recs in by_item.values()]
    out: dict[str, Any] = {f"avg@{samples}": _metric([c / n for n, c in n_items])}
    for k in ks_for(samples):
        out[f"pass@{k}"] = _metric([pass_at_k(n, c, k) for n, c in n_items if n >= k])
    equal = answer_equality(kind or "exact")
    if samples > 1 and equal is not None:
        out[f"maj@{samples}"] = _metric([
            float(majority_correct([(r.get("extracted"), bool(r["correct"])) for r in recs], equal))
            for recs in by_item.values()])
    return out
