"""The body of `cotserve eval` (the Typer command in cotserve/cli.py only forwards its options)."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError
from cotserve.eval.loaders import check_suite, parse_suites, parse_window
from cotserve.eval.runner import EvalConfig, has_code, parse_variants, run_eval
from cotserve.eval.sandbox import Limits, isolation_mode

EVAL_EXTRA = ("math_verify", "matplotlib")  # the `eval` extra's packages that every run needs


def require_eval_extra() -> None:
    """One clear error, before any work, when the `eval` extra is not installed."""
    missing = [name for name in EVAL_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise CotserveError(f"cotserve eval needs {', '.join(missing)}: pip install 'cotserve[eval]'")


def run_from_cli(*, suite: str, data_dir: str | None, data_source: str, endpoint: str | None, api_key: str | None,
                 model: str | None, policy: str, policy_opt: list[str] | None, policy_file: str | None,
                 limit: int | None, concurrency: int, max_tokens: int | None, samples: int,
                 temperature: float | None, top_p: float | None, seed: int, out: str, fresh: bool, max_batch: int,
                 device: str, dtype: str, code_timeout: float, code_memory_mb: int, progress: bool,
                 threads: int | None = None, redundancy: bool = True, redundancy_model: str = "all-MiniLM-L6-v2",
                 report_only: bool = False, api: str = "chat", preset: str = "none", sandbox: str = "auto",
                 date_from: str | None = None, date_to: str | None = None) -> dict[str, Any]:
    """Check every option, settle the sandbox and the sampling settings, then run (see
    `cotserve.eval.runner`). Everything that can be wrong fails here, before a model loads."""
    from cotserve.data import data_dir as find_data_dir
    from cotserve.eval.presets import model_folder, resolve_sampling
    from cotserve.policies.registry import parse_options

    require_eval_extra()
    if api not in ("chat", "completions"):
        raise CotserveError(f"--api must be chat or completions, not {api!r}")
    if api != "chat" and not endpoint:
        raise CotserveError("--api completions needs --endpoint (the local engine runs the prompt as chat)")
    refs = parse_suites(suite)
    needs_dir = data_source != "hf" and any(r.spec is not None for r in refs)
    ddir = find_data_dir(data_dir, required=needs_dir)
    variants = parse_variants(policy, parse_options(policy_opt, policy_file))
    if limit is not None and limit < 1:
        raise CotserveError("--limit must be at least 1")
    window = parse_window(date_from, date_to)
    if window and not has_code(refs):
        raise CotserveError("--date-from/--date-to select LiveCodeBench problems by contest date; no code suite "
                            "(livecodebench) is in --suite")
    if has_code(refs):
        isolation_mode(sandbox)  # no bubblewrap and no unsafe flag: refused before any model loads
    folder = None
    if preset in ("model", "r1"):
        folder = model_folder(model, local=not endpoint and not report_only)
    settings, sources = resolve_sampling(preset, folder, temperature, top_p, max_tokens)
    max_tokens, temperature, top_p = settings["max_tokens"], settings["temperature"], settings["top_p"]
    if max_tokens < 1:
        raise CotserveError("--max-tokens must be at least 1")
    if temperature < 0:
        raise CotserveError("--temperature must be >= 0")
    if concurrency < 1:
        raise CotserveError("--concurrency must be at least 1")
    if threads is not None and threads < 1:
        raise CotserveError("--threads must be at least 1")
    for ref in refs:  # a mistyped custom: path fails before any model loads or endpoint is called
        check_suite(ref, ddir, data_source)
    cfg = EvalConfig(
        suites=refs, variants=variants, out=Path(out), data_dir=ddir, data_source=data_source, limit=limit,
        samples=samples, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
        code_limits=Limits(timeout_s=code_timeout, memory_mb=code_memory_mb, isolation=sandbox), progress=progress,
        fresh=fresh, command="cotserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        redundancy_model=redundancy_model if redundancy else None, report_only=report_only, window=window,
        sampling={"preset": preset, "sources": sources},
    )
    if report_only:
        from cotserve.eval.backends import LogBackend
        from cotserve.eval.threads import set_threads

        cfg.threads = set_threads(threads)  # the redundancy embeddings run here
        return run_eval(cfg, LogBackend(out))
    if endpoint:
        import os

        from cotserve.eval.backends import EndpointBackend

        key = api_key or os.environ.get("COTSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        backend = EndpointBackend(endpoint, key, model, concurrency=concurrency, api=api)
    else:
        from cotserve.engine.native import NativeEngine
        from cotserve.eval.backends import LocalBackend
        from cotserve.eval.threads import set_threads
        from cotserve.models import load_model
        from cotserve.policies.registry import build_policy

        for v in variants:  # a bad policy or option fails before the model is loaded
            build_policy(v.policy, v.options)
        cfg.threads = set_threads(threads)
        name = model or "smollm2-135m-instruct"
        backend = LocalBackend(NativeEngine(load_model(name, device=device, dtype=dtype), max_batch=max_batch), name)
    return run_eval(cfg, backend)


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per (suite, variant): accuracy with its interval over items (and with several samples
    pass@k and maj@n, each with its interval), tokens, throughput, errors."""
    lines = []
    samples = int(results["meta"].get("samples") or 1)
    for r in results["runs"]:
        acc = f"{100 * r['accuracy']:.1f}%" if r["accuracy"] is not None else "n/a"
        lo, hi = r["ci95"]
        extra = ""
        if samples > 1:
            parts = []
            for name, m in (r.get("metrics") or {}).items():
                if name.startswith(("pass@", "maj@")) and m["value"] is not None:
                    parts.append(f"{name}={100 * m['value']:.1f}% [{100 * m['ci95'][0]:.1f}, {100 * m['ci95'][1]:.1f}]")
            extra = " " + " ".join(parts) if parts else ""
        lines.append(f"{r['suite']:<14} {r['policy']:<16} acc={acc} [{100 * lo:.1f}, {100 * hi:.1f}]{extra} n={r['n']} "
                     f"tokens={r['generated_tokens']['mean']} tok/s={r['throughput_tok_s']} errors={r['errors']}")
    return lines
