"""PNG plots with matplotlib (Agg backend, no display needed).

- accuracy_vs_tokens.png: one panel per suite; x = mean generated tokens, y = accuracy (pass@1)
  with its 95% interval as an error bar; one colour per policy variant. Up and to the left is
  better: the same accuracy for fewer tokens.
- throughput.png: generated tokens per second of wall time, grouped by suite, one bar per variant.
- redundancy.png: one row per suite, three panels side by side per policy: accuracy, mean generated
  tokens, and the reasoning-redundancy shares (highly similar sentence pairs, non-execution
  thoughts).

Axes that show amounts start at zero (a few tokens' difference is not drawn as a chasm), and
variants whose points coincide are drawn side by side with their own marker, not on top of each
other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_tokens(results: dict[str, Any], path: Path) -> Path | None:
    runs = [r for r in results["runs"] if r["n"]]
    if not runs:
        return None
    plt = _plt()
    suites = [s for s in results["suites"] if any(r["suite"] == s for r in runs)]
    pols = results["policies"]
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(suites), figsize=(4.2 * len(suites), 3.6), squeeze=False)
    markers = "osD^vP*Xhp"
    for ax, s in zip(axes[0], suites, strict=True):
        pts = []
        for i, p in enumerate(pols):
            r = next((r for r in runs if r["suite"] == s and r["policy"] == p), None)
            if r is not None:
                pts.append((i, p, r["generated_tokens"]["mean"] or 0.0, 100 * r["accuracy"], r))
        xmax = max([x for _, _, x, _, _ in pts] + [1.0])
        for i, p, x, y, r in pts:
            same = [q for q in pts if abs(q[2] - x) <= 0.01 * xmax and abs(q[3] - y) <= 1.0]
            k = [q[0] for q in same].index(i)
            dx = (k - (len(same) - 1) / 2) * 0.025 * xmax  # coinciding points side by side
            lo, hi = (100 * c for c in r["ci95"])
            ax.errorbar([x + dx], [y], yerr=[[y - lo], [hi - y]], fmt=markers[i % len(markers)],
                        color=colors(i % 10), capsize=4, label=p + (" (same point)" if len(same) > 1 else ""))
        ax.set_xlim(0, xmax * 1.15)
        ax.set_title(s)
        ax.set_xlabel("mean generated tokens")
        ax.set_ylabel("accuracy % (pass@1, 95% CI)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(results: dict[str, Any], path: Path) -> Path | None:
    runs = [r for r in results["runs"] if r.get("throughput_tok_s")]
    if not runs:
        return None
    plt = _plt()
    suites = [s for s in results["suites"] if any(r["suite"] == s for r in runs)]
    pols = results["policies"]
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(pols))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(suites) * max(1, len(pols)) ** 0.5), 3.6))
    for i, p in enumerate(pols):
        xs, ys = [], []
        for j, s in enumerate(suites):
            r = next((r for r in runs if r["suite"] == s and r["policy"] == p), None)
            if r is not None:
                xs.append(j + (i - (len(pols) - 1) / 2) * width)
                ys.append(r["throughput_tok_s"])
        ax.bar(xs, ys, width=width, color=colors(i % 10), label=p)
    ax.set_xticks(range(len(suites)))
    ax.set_xticklabels(suites)
    ax.set_ylabel("generated tok/s (wall)")
    ax.set_title("throughput per policy")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_redundancy(results: dict[str, Any], path: Path) -> Path | None:
    red = results.get("redundancy") or {}
    rruns = {(r["suite"], r["policy"]): r for r in red.get("runs", [])}
    if not rruns:
        return None
    plt = _plt()
    pols = results["policies"]
    suites = [s for s in results["suites"] if any((s, p) in rruns for p in pols)]
    runs = {(r["suite"], r["policy"]): r for r in results["runs"]}
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(suites), 3, figsize=(12, 3.4 * len(suites)), squeeze=False)
    for row, s in zip(axes, suites, strict=True):
        xs = list(range(len(pols)))
        acc = [100 * (runs[(s, p)]["accuracy"] or 0) if (s, p) in runs and runs[(s, p)]["n"] else 0 for p in pols]
        err_lo = [a - 100 * runs[(s, p)]["ci95"][0] if (s, p) in runs else 0 for a, p in zip(acc, pols, strict=True)]
        err_hi = [100 * runs[(s, p)]["ci95"][1] - a if (s, p) in runs else 0 for a, p in zip(acc, pols, strict=True)]
        row[0].bar(xs, acc, yerr=[err_lo, err_hi], capsize=4, color=[colors(i % 10) for i in xs])
        row[0].set_ylim(0, 100)
        row[0].set_ylabel("accuracy % (95% CI)")
        toks = [runs[(s, p)]["generated_tokens"]["mean"] or 0 if (s, p) in runs else 0 for p in pols]
        row[1].bar(xs, toks, color=[colors(i % 10) for i in xs])
        row[1].set_ylabel("mean generated tokens")
        width = 0.38
        sim = [100 * (rruns[(s, p)]["similar_pair_share"] or 0) if (s, p) in rruns else 0 for p in pols]
        ne = [100 * (rruns[(s, p)]["non_execution_share"] or 0) if (s, p) in rruns else 0 for p in pols]
        row[2].bar([x - width / 2 for x in xs], sim, width=width, color="tab:purple",
                   label=f"similar sentence pairs (cos >= {red.get('threshold', 0.95)})")
        row[2].bar([x + width / 2 for x in xs], ne, width=width, color="tab:gray", label="non-execution thoughts")
        row[2].set_ylabel("% of pairs / thoughts")
        row[2].set_ylim(0, max(sim + ne + [1.0]) * 1.3)
        row[2].legend(fontsize=7)
        for ax, title in zip(row, ("accuracy", "generated tokens", "reasoning redundancy"), strict=True):
            ax.set_xticks(xs)
            ax.set_xticklabels(pols, rotation=20, fontsize=8)
            ax.set_title(f"{s}: {title}")
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
