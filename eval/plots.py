"""PNG plots with matplotlib (Agg backend, no display needed).

- accuracy_vs_tokens.png: one panel per suite; x = mean generated tokens, y = accuracy (pass@1)
  with its 95% interval as an error bar; one colour per policy variant. Up and to the left is
  better: the same accuracy for fewer tokens.
- throughput.png: generated tokens per second of wall time, grouped by suite, one bar per variant.
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
    for ax, s in zip(axes[0], suites, strict=True):
        for i, p in enumerate(pols):
            r = next((r for r in runs if r["suite"] == s and r["policy"] == p), None)
            if r is None:
                continue
            x, y = r["generated_tokens"]["mean"], 100 * r["accuracy"]
            lo, hi = (100 * c for c in r["ci95"])
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=colors(i % 10), capsize=4, label=p)
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
