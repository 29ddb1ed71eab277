"""Aggregation and outputs: `results.json`, `report.md` (side-by-side tables), PNG plots.

Per suite and policy variant:
- accuracy: avg@n, the mean over items of each item's share of correct replies (with one sample,
  correct / graded items), with a 95% interval that treats an item as one unit (a t-interval over
  the per-item scores, `cotserve.eval.sampling`), and with `--samples n` also pass@k (unbiased
  estimator) and maj@n, each with its interval over items;
- generated tokens: mean and median, and for models that think, reasoning and answer separately;
- throughput: generated tokens / wall time, where wall time is the union of the intervals during
  which the variant's requests were in flight (so concurrency overlaps, and the pauses between
  an interrupted run and its resume, are not counted); decode tok/s: the mean of each request's
  own decode rate (engine telemetry; through an endpoint without telemetry, tokens / latency);
- KV telemetry: the mean of every numeric telemetry field over the replies (cache bytes after
  prefill / peak / final, padding, and each policy's own counters).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

TIMING_KEYS = {"prefill_s", "decode_s", "decode_tok_s"}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None}
    return {"mean": round(statistics.fmean(values), 2), "median": round(statistics.median(values), 2)}


def _lat_stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "n": 0}
    v = sorted(values)
    p90 = v[min(len(v) - 1, math.ceil(0.9 * len(v)) - 1)]
    return {"mean": round(statistics.fmean(v), 3), "median": round(statistics.median(v), 3),
            "p90": round(p90, 3), "n": len(v)}


LATENCY_KEYS = ("queue_wait_s", "ttft_s", "decode_s", "latency_s")


def latency(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-item latency stats (mean, median, p90) over the replies that recorded them."""
    out = {}
    for k in LATENCY_KEYS:
        vals = [r["latency"][k] for r in records if isinstance((r.get("latency") or {}).get(k), (int, float))]
        out[k] = _lat_stats([float(v) for v in vals])
    return out


def aggregate(records: list[dict[str, Any]], errors: int = 0, n_items: int = 0, samples: int = 1,
              kind: str | None = None) -> dict[str, Any]:
    from cotserve.eval.sampling import sample_metrics

    n = len(records)
    correct = sum(bool(r["correct"]) for r in records)
    metrics = sample_metrics(records, samples, kind)
    avg = metrics[f"avg@{samples}"]
    lo, hi = avg["ci95"]
    toks = [r["completion_tokens"] for r in records]
    thinks = any(r.get("thinks") for r in records)
    wall = union_seconds([(r["t_start"], r["t_end"]) for r in records])
    rates = []
    for r in records:
        rate = (r.get("telemetry") or {}).get("decode_tok_s")
        if not isinstance(rate, (int, float)) or rate <= 0:
            lat = r["t_end"] - r["t_start"]
            rate = r["completion_tokens"] / lat if lat > 0 else None
        if rate:
            rates.append(float(rate))
    tele_keys = sorted({k for r in records for k, v in (r.get("telemetry") or {}).items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in TIMING_KEYS})
    tele = {}
    for k in tele_keys:
        vals = [r["telemetry"][k] for r in records if isinstance((r.get("telemetry") or {}).get(k), (int, float))]
        tele[k] = round(statistics.fmean(vals), 4)
    finish: dict[str, int] = {}
    for r in records:
        finish[r.get("finish_reason") or "?"] = finish.get(r.get("finish_reason") or "?", 0) + 1
    out: dict[str, Any] = {
        "n": n, "items": n_items, "correct": correct,
        "accuracy": avg["value"],
        "ci95": [round(lo, 4), round(hi, 4)],
        "metrics": metrics,
        "generated_tokens": _stats(toks),
        "thinks": thinks,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(sum(toks) / wall, 2) if wall > 0 else None,
        "decode_tok_s": round(statistics.fmean(rates), 2) if rates else None,
        "latency_s": _stats([r["t_end"] - r["t_start"] for r in records]),
        "finish_reasons": finish,
        "truncated": round(finish.get("length", 0) / n, 4) if n else None,
        "errors": errors,
        "telemetry": tele,
        "latency": latency(records),
        "extraction": _count(r.get("extraction") or "unrecorded" for r in records),
        "timing_runs": _count(r.get("run_id") or "unrecorded" for r in records),
    }
    if thinks:
        out["reasoning_tokens"] = _stats([r.get("reasoning_tokens", 0) for r in records])
        out["answer_tokens"] = _stats([r.get("answer_tokens", r["completion_tokens"]) for r in records])
    return out


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def write_outputs(out: Path, records: list[dict[str, Any]], errors: dict[tuple[str, str], int],
                  suites: list[str], variants, meta: dict[str, Any], n_items: dict[str, int],
                  redundancy_model: str | None = None, kinds: dict[str, str] | None = None) -> dict[str, Any]:
    runs = []
    samples = int(meta.get("samples") or 1)
    for s in suites:
        for v in variants:
            recs = [r for r in records if r["suite"] == s and r["policy"] == v.label]
            agg = aggregate(recs, errors.get((s, v.label), 0), n_items.get(s, 0), samples, (kinds or {}).get(s))
            runs.append({"suite": s, "policy": v.label, "spec": v.policy, "options": v.options, **agg})
    results = {"meta": meta, "suites": suites, "policies": [v.label for v in variants], "runs": runs}
    from cotserve.eval.redundancy import maybe_report

    red = maybe_report(records, suites, [v.label for v in variants], redundancy_model)
    if red is not None:
        results["redundancy"] = red
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    from cotserve.eval.plots import plot_accuracy_vs_tokens, plot_redundancy, plot_throughput

    plots = [p for p in (plot_accuracy_vs_tokens(results, out / "accuracy_vs_tokens.png"),
                         plot_throughput(results, out / "throughput.png"),
                         plot_redundancy(results, out / "redundancy.png")) if p]
    (out / "report.md").write_text(render_markdown(results, plots))
    return results


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _acc(run: dict[str, Any]) -> str:
    if not run["n"]:
        return "–"
    lo, hi = run["ci95"]
    return f"{100 * run['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _methods(run: dict[str, Any]) -> str:
    n = max(1, run["n"])
    return "; ".join(f"{k} {100 * v / n:.0f}%" for k, v in run.get("extraction", {}).items()) or "–"


def _mixed_note(results: dict[str, Any]) -> list[str]:
    """A warning when the timing figures side by side were not all measured in this invocation."""
    current = results["meta"].get("run_id")
    runs = {k for r in results["runs"] for k in r.get("timing_runs", {})}
    if not runs or runs == {current}:
        return []
    return ["> Timing figures (throughput, decode rate, wall time, latency) come from the runs named in the "
            "row *timings measured in run* (run id and replies), not all from this invocation "
            f"(`{current}`): a resumed or reused run. Compare columns only where those runs match.", ""]


def _latency_section(results: dict[str, Any]) -> list[str]:
    pols = results["policies"]
    get = {(r["suite"], r["policy"]): r for r in results["runs"]}
    lines = ["## Latency", "",
             "Per reply, in seconds, mean / median / p90: queue wait (handed to the backend until its batch or "
             "request started; through an endpoint also the server's own queue wait), time to first token and "
             "total latency (both from the hand-over), decode (first token to last).", ""]
    lines += _mixed_note(results)
    names = {"queue_wait_s": "queue wait", "ttft_s": "time to first token", "decode_s": "decode",
             "latency_s": "total latency"}
    for s in results["suites"]:
        rs = [get[(s, p)] for p in pols]
        lines += [f"### {s}", "", "| latency s | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
        for k in LATENCY_KEYS:
            cells = []
            for r in rs:
                st = r.get("latency", {}).get(k) or {}
                cells.append("–" if st.get("mean") is None else
                             f"{st['mean']:.2f} / {st['median']:.2f} / {st['p90']:.2f}")
            lines.append(f"| {names[k]} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _redundancy_section(results: dict[str, Any]) -> list[str]:
    red = results.get("redundancy")
    if not red:
        return []
    lines = ["## Reasoning redundancy", ""]
    if red.get("error"):
        return lines + [f"Not computed: {red['error']}", ""]
    lines += [f"Sentence embeddings by `{red['model']}`; a pair of sentences of one reply is highly similar "
              f"at cosine >= {red['threshold']}. Shares pooled over replies; non-execution thoughts are "
              f"reflection and transition lines (SkipKV's thought rules). {red['sentences']} sentences "
              f"embedded in {red['seconds']} s.", "",
              "| suite | policy | replies | similar-pair share | (correct / incorrect) | non-execution share | "
              "(correct / incorrect) |", "|---|---|---|---|---|---|---|"]

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}%"

    for r in red["runs"]:
        c, i = r["correct"], r["incorrect"]
        lines.append(f"| {r['suite']} | {r['policy']} | {r['replies']} | {pct(r['similar_pair_share'])} | "
                     f"{pct(c['similar_pair_share'])} / {pct(i['similar_pair_share'])} | "
                     f"{pct(r['non_execution_share'])} | {pct(c['non_execution_share'])} / "
                     f"{pct(i['non_execution_share'])} |")
    return lines + [""]


NONDETERMINISM = (
    "Two runs of the same greedy request (temperature 0) may still differ: the batch a request shares "
    "changes the shapes and the order of the floating-point sums (batch size, padding, prompt-length "
    "grouping, concurrency through an endpoint), the dtype rounds differently (bfloat16 or float16 against "
    "float32), and each engine and kernel (the native engine or vLLM, CPU or CUDA, attention kernels and "
    "their versions) adds up in its own order; once one token differs, the rest of the reply follows "
    "another path. Compare policies within one run, on one engine, dtype and batch setting; this run's are "
    "on the model line above (results.json: `meta.backend`)."
)


def _backend_text(be: dict[str, Any]) -> str:
    """Where the replies came from, with the settings that decide whether two greedy runs agree."""
    if be.get("endpoint"):
        return (f"{be['endpoint']} ({be.get('api', 'chat')} API, concurrency {be.get('concurrency', '?')}; "
                "the server's engine, dtype and batching are not known here)")
    return (f"local native engine ({be.get('device', '?')}, {be.get('dtype', '?')}, "
            f"max batch {be.get('max_batch', '?')})")


def _sandbox_line(sbx: dict[str, Any] | None) -> list[str]:
    if not sbx:
        return []
    bw = f" ({sbx['bwrap_version']})" if sbx.get("mode") == "bwrap" and sbx.get("bwrap_version") else ""
    stack = f", {sbx['stack_mb']} MiB stack" if sbx.get("stack_mb") else ""
    wrap = " and stdin wrapping" if sbx.get("lcb_stdin_wrap") else ""
    return [f"- code sandbox: {sbx['mode']}{bw}; per test {sbx['timeout_s']} s wall / {sbx['cpu_s']} s CPU, "
            f"{sbx['memory_mb']} MiB memory, {sbx['max_output_mb']} MiB output, {sbx['max_processes']} processes"
            f"{stack}, network {sbx['network']}; LiveCodeBench's import prelude{wrap}"
            + ("" if sbx.get("mode") == "bwrap" else "; UNSAFE: the programs could read this machine's files")]


def _sampling_lines(meta: dict[str, Any], gen: dict[str, Any]) -> list[str]:
    src = (meta.get("sampling") or {}).get("sources") or {}
    preset = (meta.get("sampling") or {}).get("preset")

    def val(key: str) -> str:
        return f"{gen.get(key)}" + (f" ({src[key]})" if key in src else "")

    line = (f"- max_tokens {val('max_tokens')}, temperature {val('temperature')}, top_p {val('top_p')}, "
            f"samples {meta.get('samples')}, limit {meta.get('limit')}, data source {meta.get('data_source')}")
    out = [line]
    if preset and preset != "none":
        out.append(f"- sampling preset: {preset}")
    if meta.get("date_window"):
        out.append(f"- LiveCodeBench contest dates: {meta['date_window']}")
    return out


def _sampling_section(results: dict[str, Any]) -> list[str]:
    """pass@k, avg@n and maj@n per suite, with intervals over items (only with --samples > 1)."""
    samples = int(results["meta"].get("samples") or 1)
    if samples < 2:
        return []
    pols = results["policies"]
    get = {(r["suite"], r["policy"]): r for r in results["runs"]}
    lines = ["## Sampling", "",
             f"{samples} samples per item. pass@k is the unbiased estimator 1 - C(n-c,k)/C(n,k) per item, "
             f"avg@{samples} the mean score, maj@{samples} the majority vote over the extracted answers; each "
             "is averaged over items, in % with a 95% t-interval over the per-item scores (an item's samples "
             "count as one unit).", ""]
    if (results["meta"].get("generation") or {}).get("temperature") == 0:
        lines += [f"> Temperature 0 with {samples} samples: greedy decoding repeats one reply, so pass@k and "
                  "maj@n add nothing over pass@1.", ""]
    lines += ["| suite | metric | " + " | ".join(pols) + " |", "|---|---|" + "---|" * len(pols)]
    for s in results["suites"]:
        names: list[str] = []
        for p in pols:
            for k in get[(s, p)].get("metrics", {}):
                if k not in names:
                    names.append(k)
        for name in names:
            cells = []
            for p in pols:
                m = get[(s, p)].get("metrics", {}).get(name)
                cells.append("–" if not m or m["value"] is None else
                             f"{100 * m['value']:.1f} [{100 * m['ci95'][0]:.1f}, {100 * m['ci95'][1]:.1f}]")
            lines.append(f"| {s} | {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_markdown(results: dict[str, Any], plots: list[Path]) -> str:
    meta, pols, runs = results["meta"], results["policies"], results["runs"]
    gen, be = meta.get("generation", {}), meta.get("backend", {})
    lines = ["# cotserve eval report", "", f"- model: `{gen.get('model')}` via {_backend_text(be)}",
             *_sampling_lines(meta, gen), *_sandbox_line(meta.get("sandbox")),
             f"- finished {meta.get('finished_at')}"]
    if meta.get("command"):
        lines.append(f"- command: `{meta['command']}`")
    if meta.get("threads"):
        lines.append(f"- torch CPU threads: {meta['threads']}")
    lines += ["", "Accuracy is the mean score over items (pass@1; with several samples, avg@n) in % with a 95% "
              "t-interval over the per-item scores, so an item's samples count as one unit. Throughput is "
              "generated tokens per second of wall time; decode tok/s is the mean per-request decode rate. "
              "Answers are read only where a reply states them (box, final-answer marker, or the last line of a "
              "reply that ended by itself); a reply cut at max_tokens earns credit only for an answer completed "
              "before the cut. *answer extraction* gives the share of replies per method, where `truncated` (cut "
              "at max_tokens before a complete final answer) and `none` score 0.", "", NONDETERMINISM, ""]
    lines += _mixed_note(results)
    get = {(r["suite"], r["policy"]): r for r in runs}
    lines += ["## Accuracy", "", "| suite | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
    for s in results["suites"]:
        lines.append(f"| {s} | " + " | ".join(_acc(get[(s, p)]) for p in pols) + " |")
    lines.append("")
    lines += _sampling_section(results)
    for s in results["suites"]:
        rs = [get[(s, p)] for p in pols]
        lines += [f"## {s}", "", "| metric | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
        rows: list[tuple[str, list[str]]] = [
            ("policy spec", [f"`{r['spec']}`" + (f" {r['options']}" if r["options"] else "") for r in rs]),
            ("accuracy % [95% CI]", [_acc(r) for r in rs]),
            ("graded / items", [f"{r['n']} / {r['items']}" for r in rs]),
            ("generated tokens, mean", [_fmt(r["generated_tokens"]["mean"]) for r in rs]),
            ("generated tokens, median", [_fmt(r["generated_tokens"]["median"]) for r in rs]),
        ]
        if any(r["thinks"] for r in rs):
            rows += [
                ("reasoning tokens, mean / median",
                 [f"{_fmt(r.get('reasoning_tokens', {}).get('mean'))} / {_fmt(r.get('reasoning_tokens', {}).get('median'))}"
                  for r in rs]),
                ("answer tokens, mean / median",
                 [f"{_fmt(r.get('answer_tokens', {}).get('mean'))} / {_fmt(r.get('answer_tokens', {}).get('median'))}"
                  for r in rs]),
            ]
        rows += [
            ("hit max_tokens %", [_fmt(100 * r["truncated"]) if r["truncated"] is not None else "–" for r in rs]),
            ("throughput tok/s", [_fmt(r["throughput_tok_s"], 2) for r in rs]),
            ("decode tok/s (per request)", [_fmt(r["decode_tok_s"], 2) for r in rs]),
            ("wall time s", [_fmt(r["wall_s"], 1) for r in rs]),
            ("errors", [str(r["errors"]) for r in rs]),
        ]
        rows.append(("answer extraction (replies)", [_methods(r) for r in rs]))
        rows.append(("timings measured in run", [", ".join(f"{k} ({v})" for k, v in r["timing_runs"].items())
                                                 for r in rs]))
        tele_keys = sorted({k for r in rs for k in r["telemetry"]})
        for k in tele_keys:
            vals = [r["telemetry"].get(k) for r in rs]
            if k.startswith("kv_bytes"):
                rows.append((f"{k} (MiB, mean)", [_fmt(v / 2**20, 2) if v is not None else "–" for v in vals]))
            else:
                rows.append((f"{k} (mean)", [_fmt(v, 3) if isinstance(v, float) else _fmt(v) for v in vals]))
        lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
        lines.append("")
    lines += _latency_section(results)
    lines += _redundancy_section(results)
    if plots:
        lines += ["## Plots", ""]
        for p in plots:
            lines += [f"![{p.stem}]({p.name})", ""]
    return "\n".join(lines)
