"""`cotserve eval`: run suites x policy variants x samples, grade, log, report.

The per-item log `predictions.jsonl` is also the resume log: every finished (suite, variant, item
id, sample) is appended as one line the moment it is graded, and a later run with the same
`--out` skips every key already there (items that ended in an error are retried). Generation
settings (model/endpoint, max_tokens, temperature, top_p, seed) and each variant's policy and
options are recorded in `run_config.json`; resuming with different ones is refused, since the
log would then mix two experiments.

A run with a code suite first settles its sandbox (`cotserve.eval.sandbox.isolation_mode`):
bubblewrap, or a refusal before anything is generated; a weaker mode only when named
(`unsafe-unshare`, `unsafe-none`), with a warning on stderr. The mode, its limits and
bubblewrap's version go into `results.json` and `report.md`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError
from cotserve.eval.backends import EvalRequest, Output
from cotserve.eval.graders import GRADER_VERSION, grade
from cotserve.eval.loaders import DateWindow, Item, SuiteRef, load_suite
from cotserve.eval.prompts import build_prompt
from cotserve.eval.sandbox import Limits, describe, isolation_mode, warn_if_unsafe
from cotserve.jsonl import close_last_line, read_jsonl

PREDICTIONS = "predictions.jsonl"
RUN_CONFIG = "run_config.json"


@dataclass
class Variant:
    """One column of the side-by-side: a label, a policy spec and its options."""

    label: str
    policy: str
    options: dict[str, Any] = field(default_factory=dict)


_LABEL = re.compile(r"^([A-Za-z0-9_.-]+)=(?!=)")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: `dense,sfi[k=8,recent=4]` -> two entries."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise CotserveError(f"--policy {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise CotserveError(f"--policy {text!r}: unbalanced '['")
    out.append(cur)
    return [s.strip() for s in out if s.strip()]


def parse_variants(text: str, global_options: dict[str, Any] | None = None) -> list[Variant]:
    """`--policy` entries, comma-separated: `SPEC`, `SPEC[key=value,...]`, each optionally
    labelled `LABEL=SPEC[...]` (e.g. `dense,small=sfi[k=256],big=sfi[k=1024]`).

    Global `--policy-opt` options go to every variant that can take them: `part.key=value` to the
    variants whose stack holds `part`; a bare `key=value` to every variant that is not plain
    `dense`. Options in brackets win."""
    variants: list[Variant] = []
    for entry in _split_top(text):
        label = None
        m = _LABEL.match(entry)
        if m and "[" not in m.group(1):
            label, entry = m.group(1), entry[m.end():].strip()
        opts: dict[str, Any] = {}
        spec = entry
        if "[" in entry:
            if not entry.endswith("]"):
                raise CotserveError(f"--policy entry {entry!r}: options go in brackets at the end, SPEC[k=v,...]")
            spec, _, inner = entry[:-1].partition("[")
            for pair in [p.strip() for p in inner.split(",") if p.strip()]:
                if "=" not in pair:
                    raise CotserveError(f"--policy entry {entry!r}: option {pair!r} is not key=value")
                k, _, v = pair.partition("=")
                opts[k.strip()] = v.strip()
        spec = spec.strip()
        if not spec:
            raise CotserveError(f"--policy entry {entry!r} names no policy")
        parts = [p.strip() for p in spec.split("+") if p.strip()]
        merged: dict[str, Any] = {}
        for k, v in (global_options or {}).items():
            if "." in k:
                if k.partition(".")[0] in parts:
                    merged[k] = v
            elif parts != ["dense"]:
                merged[k] = v
        merged.update(opts)
        variants.append(Variant(label or entry, spec, merged))
    if not variants:
        raise CotserveError("no policy given (--policy dense,...)")
    labels = [v.label for v in variants]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise CotserveError(f"--policy lists {', '.join(dup)} twice; give each a label, e.g. a=dense,b=dense")
    return variants


@dataclass
class EvalConfig:
    suites: list[SuiteRef]
    variants: list[Variant]
    out: Path
    data_dir: Path | None
    data_source: str = "local"
    limit: int | None = None
    samples: int = 1
    max_tokens: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    code_limits: Limits = field(default_factory=Limits)
    progress: bool = True
    fresh: bool = False
    command: str = ""
    report_only: bool = False  # regrade and report what the log holds; generate nothing
    threads: int | None = None  # local mode: torch CPU threads (recorded in the report)
    redundancy_model: str | None = "all-MiniLM-L6-v2"  # None: no redundancy section
    window: DateWindow = field(default_factory=DateWindow)  # LiveCodeBench contest dates
    sampling: dict[str, Any] = field(default_factory=dict)  # preset and where each setting came from
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}")


def job_seed(base: int, suite: str, item_id: str, sample: int) -> int:
    """A fixed seed per (suite, item, sample): reruns and resumes sample the same text."""
    return (base * 1_000_003 + zlib.crc32(f"{suite}/{item_id}/{sample}".encode())) % (2**31 - 1)


def read_log(path: Path) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """Finished records by key; a torn last line (an interrupted write) is ignored."""
    done: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    if not path.is_file():
        return done
    for rec in read_jsonl(path, torn_tail=True):
        key = _key(rec)
        if key is None:
            continue
        if rec.get("error"):
            done.pop(key, None)
        else:
            done[key] = rec
    return done


def _key(rec: dict[str, Any]) -> tuple[str, str, str, int] | None:
    """(suite, variant, item id, sample) of a log record; None for a record without them."""
    try:
        return (rec["suite"], rec["policy"], str(rec["id"]), int(rec["sample"]))
    except (KeyError, TypeError, ValueError):
        return None


def _check_config(out: Path, backend_desc: dict[str, Any], cfg: EvalConfig) -> dict[str, Any]:
    gen = {"model": backend_desc.get("model"), "endpoint": backend_desc.get("endpoint"),
           "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
    variants = {v.label: {"policy": v.policy, "options": v.options} for v in cfg.variants}
    path = out / RUN_CONFIG
    if path.is_file() and not cfg.fresh:
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
        diffs = [f"{k}: {old.get('generation', {}).get(k)!r} -> {v!r}" for k, v in gen.items()
                 if k in old.get("generation", {}) and old["generation"][k] != v]
        for label, v in variants.items():
            prev = old.get("variants", {}).get(label)
            if prev is not None and json.loads(json.dumps(v)) != prev:
                diffs.append(f"variant {label}: {prev} -> {v}")
        if diffs:
            raise CotserveError(f"{out} holds a run with other settings ({'; '.join(diffs)}); "
                                "use another --out, or --fresh to start over")
        variants = {**old.get("variants", {}), **variants}
    conf = {"generation": gen, "variants": variants, "backend": backend_desc}
    if cfg.sampling:
        conf["sampling"] = cfg.sampling  # the preset and where each setting came from (not compared)
    path.write_text(json.dumps(conf, indent=2, default=str) + "\n")
    return conf


def has_code(refs: list[SuiteRef]) -> bool:
    """Some suite runs model-written programs."""
    return any((r.spec.kind if r.spec is not None else r.kind) == "code" for r in refs)


def settle_sandbox(cfg: EvalConfig) -> dict[str, Any] | None:
    """The sandbox a run with code suites uses (a `SandboxError` where it cannot run), its warning
    for an unsafe mode, and what the results record of it; None without code suites."""
    if not has_code(cfg.suites):
        return None
    mode = isolation_mode(cfg.code_limits.isolation)
    warn_if_unsafe(mode)
    return describe(cfg.code_limits, mode)


def run_eval(cfg: EvalConfig, backend) -> dict[str, Any]:
    """Run everything that is not in the log yet, then write results.json, report.md and plots.
    Returns the results dict."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    log_path = cfg.out / PREDICTIONS
    if cfg.fresh and log_path.exists():
        log_path.unlink()
    if cfg.samples < 1:
        raise CotserveError("--samples must be at least 1")
    if cfg.samples > 1 and cfg.temperature == 0:
        print(f"warning: --samples {cfg.samples} with --temperature 0: greedy decoding repeats one reply, so "
              "pass@k and maj@n add nothing over pass@1 (sample with --temperature > 0, e.g. --preset r1)",
              file=sys.stderr)
    sandbox = settle_sandbox(cfg)
    for v in cfg.variants:
        backend.check(v.policy, v.options)
    suites = {ref.name: load_suite(ref, cfg.data_dir, cfg.data_source, cfg.limit, cfg.window) for ref in cfg.suites}
    for name, items in suites.items():
        if not items:
            raise CotserveError(f"suite {name} has no items")
    _check_config(cfg.out, backend.describe(), cfg)
    done = read_log(log_path)

    if log_path.is_file():
        close_last_line(log_path)  # drop a torn last line: appended records start on a line of their own
    with open(log_path, "a", encoding="utf-8") as log:
        _regrade(suites, done, log, cfg.code_limits)
        try:
            if not cfg.report_only:
                _generate(cfg, backend, suites, done, log)
        except KeyboardInterrupt:
            drain = getattr(backend, "drain", None)
            for out in drain() if drain else []:  # replies that finished after Ctrl-C are logged too
                _log_output(out, suites, cfg, done, log)
            n = sum(1 for _ in done)
            print(f"\ninterrupted: {n} graded replies are in {log_path}; run the same command again to "
                  "resume from there", file=sys.stderr)
            raise
    return _finish(cfg, suites, log_path, done, sandbox)


def _regrade(suites: dict[str, list[Item]], done: dict, log, limits: Limits) -> None:
    """Replies logged by an older grader are graded again from their stored text (no generation);
    the new grade is appended to the log, which keeps the last line per key."""
    by_key = {(n, it.id): it for n, items in suites.items() for it in items}
    for key, rec in list(done.items()):
        it = by_key.get((key[0], key[2]))
        if it is None or rec.get("grader") == GRADER_VERSION or "content" not in rec:
            continue
        g = grade(it, rec["content"], code_limits=limits, finish_reason=rec.get("finish_reason"))
        rec = {**rec, "correct": bool(g.correct), "extracted": g.extracted, "grade_detail": g.detail,
               "extraction": g.method, "grader": GRADER_VERSION, "regraded_from": rec.get("grader", "unversioned")}
        log.write(json.dumps(rec, ensure_ascii=False) + "\n")
        done[key] = rec
    log.flush()


def _log_output(out: Output, suites: dict[str, list[Item]], cfg: EvalConfig, done: dict, log) -> dict[str, Any]:
    name, label = out.job.key[0], out.job.key[1]
    item = next(it for it in suites[name] if it.id == out.job.key[2])
    v = next(v for v in cfg.variants if v.label == label)
    rec = _record(item, v, out, cfg.code_limits, cfg.run_id)
    log.write(json.dumps(rec, ensure_ascii=False) + "\n")
    log.flush()
    if rec.get("error") is None:
        done[out.job.key] = rec
    return rec


def _generate(cfg: EvalConfig, backend, suites: dict[str, list[Item]], done: dict, log) -> None:
    for name, items in suites.items():
        for v in cfg.variants:
            jobs = []
            for it in items:
                for s in range(cfg.samples):
                    key = (name, v.label, it.id, s)
                    if key in done:
                        continue
                    jobs.append(EvalRequest(key, build_prompt(it), v.policy, v.options, cfg.max_tokens,
                                    cfg.temperature, cfg.top_p, job_seed(cfg.seed, name, it.id, s)))
            total = len(items) * cfg.samples
            bar = _bar(total, total - len(jobs), f"{name} {v.label}", cfg.progress)
            prior = [done[(name, v.label, it.id, s)] for it in items for s in range(cfg.samples)
                     if (name, v.label, it.id, s) in done]
            n_ok, n_all = sum(bool(r["correct"]) for r in prior), len(prior)
            for out in backend.run(jobs):
                rec = _log_output(out, suites, cfg, done, log)
                if rec.get("error") is None:
                    n_ok, n_all = n_ok + bool(rec["correct"]), n_all + 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{n_ok / n_all:.3f}" if n_all else "-")
            if bar is not None:
                bar.close()


def _finish(cfg: EvalConfig, suites: dict[str, list[Item]], log_path: Path, done: dict,
            sandbox: dict[str, Any] | None = None) -> dict[str, Any]:
    from cotserve.eval.report import write_outputs

    wanted = {(n, v.label, it.id, s) for n, items in suites.items() for v in cfg.variants for it in items
              for s in range(cfg.samples)}
    records = [r for k, r in done.items() if k in wanted]
    errors = _errors(log_path, wanted, done)
    conf = json.loads((cfg.out / RUN_CONFIG).read_text())
    meta = {"command": cfg.command, "generation": conf["generation"], "backend": conf["backend"],
            "samples": cfg.samples, "limit": cfg.limit, "data_source": cfg.data_source,
            "threads": cfg.threads, "run_id": cfg.run_id, "grader": GRADER_VERSION,
            "sampling": cfg.sampling or None, "sandbox": sandbox,
            "date_window": cfg.window.describe() if cfg.window else None,
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    kinds = {n: items[0].kind for n, items in suites.items() if items}
    return write_outputs(cfg.out, records, errors, [n for n in suites], cfg.variants, meta,
                         {n: len(items) for n, items in suites.items()}, redundancy_model=cfg.redundancy_model,
                         kinds=kinds)


def latency_fields(out: Output) -> dict[str, float | None]:
    """Per-item latency: queue wait (handed to the backend -> started running; through an endpoint
    also the server's own queue wait from its telemetry), time to first token and total (both from
    the hand-over), and decode time (first token -> last)."""
    t_q = out.t_queued if out.t_queued is not None else out.t_start
    server_wait = (out.telemetry or {}).get("queue_wait_s")
    wait = max(0.0, out.t_start - t_q) + (float(server_wait) if isinstance(server_wait, (int, float)) else 0.0)
    return {
        "queue_wait_s": round(wait, 4),
        "ttft_s": round(out.t_first - t_q, 4) if out.t_first is not None else None,
        "decode_s": round(out.t_end - out.t_first, 4) if out.t_first is not None else None,
        "latency_s": round(out.t_end - t_q, 4),
    }


def _record(item: Item, v: Variant, out: Output, limits: Limits, run_id: str = "") -> dict[str, Any]:
    suite, label, iid, sample = out.job.key
    rec: dict[str, Any] = {"suite": suite, "policy": label, "id": iid, "sample": sample, "spec": v.policy,
                           "kind": item.kind, "run_id": run_id}
    if out.error:
        rec.update(error=out.error, t_start=out.t_start, t_end=out.t_end)
        return rec
    g = grade(item, out.content, code_limits=limits, finish_reason=out.finish_reason)
    rec.update(
        correct=bool(g.correct), extracted=g.extracted, extraction=g.method, grader=GRADER_VERSION,
        reference=item.answer if item.kind != "code" else None,
        grade_detail=g.detail, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, reasoning_tokens=out.reasoning_tokens,
        answer_tokens=max(0, out.completion_tokens - out.reasoning_tokens), thinks=out.reasoning is not None,
        t_start=round(out.t_start, 4), t_end=round(out.t_end, 4), latency=latency_fields(out), telemetry=out.telemetry,
        reasoning=out.reasoning, content=out.content,
    )
    return rec


def _errors(log_path: Path, wanted: set, done: dict) -> dict[tuple[str, str], int]:
    """Keys whose latest attempt failed and that never succeeded, counted per (suite, variant)."""
    failed: dict[tuple[str, str, str, int], str] = {}
    for rec in read_jsonl(log_path, torn_tail=True):
        key = _key(rec)
        if key is not None and rec.get("error") and key in wanted and key not in done:
            failed[key] = rec["error"]
    counts: dict[tuple[str, str], int] = {}
    for (s, p, _, _) in failed:
        counts[(s, p)] = counts.get((s, p), 0) + 1
    return counts


def _bar(total: int, initial: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True)

