"""The `cotserve` command line (Typer).

Every command turns a `CotserveError` into one line on stderr and exit code 2; no tracebacks
for things a user can fix.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated

import typer

from cotserve.errors import CotserveError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="cotserve: serving middleware for chain-of-thought reasoning models.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks with JSON output.")
app.add_typer(bench_app, name="bench")

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Bundled name, transformers folder, or .gguf file.")]
DeviceOpt = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA, float32 on CPU), float32, bfloat16, float16.")]
PolicyOptOpt = Annotated[list[str] | None, typer.Option("--policy-opt", help="Policy option key=value (repeatable).")]
PolicyFileOpt = Annotated[str | None, typer.Option("--policy-file", help="YAML/JSON file of policy options.")]


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (sent through the chat template).")],
    model: ModelOpt = "smollm2-135m-instruct",
    max_tokens: Annotated[int, typer.Option(help="Maximum new tokens.")] = 256,
    policy: Annotated[str, typer.Option(help="Policy or stack, e.g. dense, sfi, skipkv+sfi.")] = "dense",
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    raw: Annotated[bool, typer.Option(help="Skip the chat template.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Generate a reply to one prompt locally; stats go to stderr."""
    try:
        from cotserve.engine.native import GenRequest, NativeEngine
        from cotserve.engine.sampling import SamplingParams
        from cotserve.engine.textproc import split_reasoning
        from cotserve.models import load_model
        from cotserve.policies.registry import build_policy, parse_options

        options = parse_options(policy_opt, policy_file)
        stack = build_policy(policy, options)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop or []))
        engine = NativeEngine(load_model(model, device=device, dtype=dtype))
        req = GenRequest(engine.encode_prompt(prompt, chat=not raw), params)
        t0 = time.perf_counter()
        (result,) = engine.generate([req], stack)
        wall = time.perf_counter() - t0
    except CotserveError as exc:
        fail(str(exc))
        return
    reasoning, content = split_reasoning(result.text)
    if reasoning is not None:
        typer.echo(f"[reasoning]\n{reasoning}\n[answer]")
    typer.echo(content)
    tele = result.telemetry
    typer.echo(
        f"prompt_tokens={result.prompt_tokens} generated_tokens={result.completion_tokens} "
        f"tok/s={result.completion_tokens / wall:.2f} decode_tok/s={tele.get('decode_tok_s', 0)} "
        f"finish={result.finish_reason} policy={tele.get('policy')}",
        err=True,
    )
    extra = {k: v for k, v in tele.items() if k not in ("policy", "decode_tok_s")}
    if extra:
        typer.echo("telemetry: " + " ".join(f"{k}={v}" for k, v in extra.items()), err=True)


@bench_app.command("decode")
def bench_decode(
    policy: Annotated[str, typer.Option(help="Comma-separated policies to compare, e.g. dense,sfi.")] = "dense",
    context: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 2048,
    batch: Annotated[int, typer.Option(help="Sequences per batch.")] = 1,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per sequence.")] = 64,
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    model: ModelOpt = "smollm2-135m-instruct",
    hf_baseline: Annotated[bool, typer.Option(help="Also time transformers' generate on the same input.")] = True,
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder for prompt text ($COTSERVE_DATA_DIR).")] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Decode throughput of policies side by side on the same prompts (and transformers' generate)."""
    try:
        from cotserve.bench.decode import run_decode_bench

        report = run_decode_bench(
            policies=[p.strip() for p in policy.split(",") if p.strip()], context=context, batch=batch,
            new_tokens=new_tokens, policy_opt=policy_opt, policy_file=policy_file, model=model,
            hf_baseline=hf_baseline, data_dir=data_dir, device=device, dtype=dtype,
        )
    except CotserveError as exc:
        fail(str(exc))
        return
    _emit_json(report, json_out)


@bench_app.command("fidelity")
def bench_fidelity(
    policy: Annotated[str, typer.Option(help="Comma-separated policies to compare with dense.")] = "dense",
    context: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 4096,
    steps: Annotated[int, typer.Option(help="Decode steps compared (teacher-forced on dense's tokens).")] = 256,
    batch: Annotated[int, typer.Option(help="Prompts (sequences) compared.")] = 1,
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    model: ModelOpt = "smollm2-135m-instruct",
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder for prompt text ($COTSERVE_DATA_DIR).")] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Top-1 agreement and KL of policies against dense decoding, teacher-forced on dense's tokens."""
    try:
        from cotserve.bench.fidelity import run_fidelity_bench

        report = run_fidelity_bench(
            policies=[p.strip() for p in policy.split(",") if p.strip()], context=context, steps=steps,
            batch=batch, policy_opt=policy_opt, policy_file=policy_file, model=model, data_dir=data_dir,
            device=device, dtype=dtype,
        )
    except CotserveError as exc:
        fail(str(exc))
        return
    _emit_json(report, json_out)


@app.command("build-steering")
def build_steering_cmd(
    data: Annotated[str, typer.Option(help="JSONL file with a 'problem' field per line (e.g. math_train.jsonl).")],
    layer: Annotated[int, typer.Option(help="Decoder layer whose input hidden state is read (0-based).")],
    samples: Annotated[int, typer.Option(help="Problems to generate reasoning for.")],
    out: Annotated[str, typer.Option(help="Output folder; writes OUT/<model-slug>/layer_<L>.safetensors and .json.")],
    model: ModelOpt = "smollm2-135m-instruct",
    max_tokens: Annotated[int, typer.Option(help="Maximum new tokens per problem (greedy).")] = 384,
    batch: Annotated[int, typer.Option(help="Problems generated together.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the permutation the problems are taken from.")] = 0,
    prompt: Annotated[str | None, typer.Option(help="Prompt template with {problem} (default: reason step by step).")] = None,
    rules: Annotated[str | None, typer.Option(help="YAML/JSON file {reflection: [regex], transition: [regex]} (default: built-in rules).")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Build a SEAL steering vector offline: mean(reflection+transition) - mean(execution) hidden
    states entering LAYER at thought boundaries of greedy reasoning traces. Resumable."""
    try:
        from cotserve.build_steering import DEFAULT_PROMPT, BuildConfig, build_steering, load_rules

        cfg = BuildConfig(model=model, data=data, layer=layer, samples=samples, out=out, max_tokens=max_tokens,
                          batch=batch, seed=seed, prompt=prompt or DEFAULT_PROMPT, device=device, dtype=dtype,
                          rules=load_rules(rules))
        command = "cotserve " + " ".join(sys.argv[1:])
        manifest = build_steering(cfg, command=command, progress=progress)
    except CotserveError as exc:
        fail(str(exc))
        return
    from cotserve.policies.steering import vector_path

    path = vector_path(out, manifest["model_slug"], layer)
    typer.echo(f"wrote {path} and {path.with_suffix('.json').name} (counts: {manifest['counts']})")


def _emit_json(report: dict, path: str | None) -> None:
    import json

    text = json.dumps(report, indent=2)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    typer.echo(text)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        app()
    except CotserveError as exc:  # commands normally catch these; this is the last net
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
