"""Typed policy options: one pydantic model per policy, free of torch.

These models are the single description of every policy option (type, range, default, meaning).
Each policy's dataclass config takes its fields, types and defaults from its model
(`@options_config(SFIOptions)`: the class adds only methods and derived properties), and whatever
else needs an option's default or name reads it here (`option_default`). The gateway validates a
request's `cotserve.options` against the models before it enqueues a job (400 with the option's
path in `param`); the registry validates them again in the worker, then builds the policy's
config from the validated values. The option tables of the policy pages (`docs/policies/*.md`)
are generated from them (`make docs`).

Adding an option: one field in its policy's model here, then `make docs`.

Spec resolution lives here too (`resolve`): a spec is one policy or a stack of at most one per
axis joined with `+`; an option `key` goes to every part that has it, `policy.key` to one part.
Options renamed so that one name means one idea across policies are refused with a hint that
names the new option (`RENAMED`).

This module imports nothing from the policies' torch code: the gateway loads it without torch.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cotserve.errors import PolicyError


class OptionError(PolicyError):
    """A bad policy spec or option; `param` is where it is in a request (`cotserve.options.k`)."""

    def __init__(self, message: str, param: str = "cotserve.options"):
        super().__init__(message)
        self.param = param


class PolicyOptions(BaseModel):
    """Base: unknown keys are refused; ints, floats, bools and strings are taken as they are (a
    JSON `true` is not an int, `1.5` is not an int, `"1"` is not a number); floats are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


_C = TypeVar("_C", bound=type)


def options_config(model: type[PolicyOptions]) -> Callable[[_C], _C]:
    """Class decorator: make the class a dataclass whose fields are `model`'s options, in the
    model's order, with its types and defaults (inherited options keep their place). The class
    keeps its own methods and properties and records its model as `options_model`; a field it
    declares itself under an option's name is refused, so every option has one definition."""

    def make(cls: _C) -> _C:
        own = dict(cls.__dict__.get("__annotations__", {}))
        twice = sorted(n for n in model.model_fields if n in own or n in cls.__dict__)
        if twice:
            raise TypeError(f"{cls.__name__} declares {', '.join(twice)}, options of {model.__name__}: "
                            "an option is defined in its options model only")
        for name, info in model.model_fields.items():
            setattr(cls, name, info.default)
        cls.__annotations__ = {**{n: info.annotation for n, info in model.model_fields.items()}, **own}
        cls.options_model = model
        return dataclasses.dataclass(cls)

    return make


def option_default(model: type[PolicyOptions], name: str) -> Any:
    """The default of one option of `model`."""
    return model.model_fields[name].default


def check_config(config: Any) -> None:
    """A config's values through its options model (ranges, choices, rules across options): a
    ValueError naming the first option that breaks one. For configs built without the registry
    (which validates the options before it builds the config)."""
    model: type[PolicyOptions] = type(config).options_model
    try:
        model.model_validate({n: getattr(config, n) for n in model.model_fields}, strict=False)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise ValueError(f"{field}={err.get('input')!r}: {msg}" if field else msg) from None


# -- read policies ------------------------------------------------------------------------------
KERNEL_HELP = ("implementation: auto (the C++ CPU kernel on a CPU with a float32 cache where it builds, "
               "the Triton kernel on CUDA for dense, torch otherwise) | torch (the plain torch reference)")


class DenseOptions(PolicyOptions):
    kernel: Literal["auto", "torch"] = Field("auto", description=KERNEL_HELP)


class SFIOptions(PolicyOptions):
    # Defaults are the paper's ("Default SFI configuration", Sec. 5.1 of arXiv:2603.12038; the
    # refinement values also Sec. 5.4, Tables 6-7); additions of ours are off.
    # memory layout (paper Sec. 5.1: 4 sinks, a 256-token recent window, K = 2048 per KV head)
    sinks: int = Field(4, ge=0, description="first entries always read (attention sinks)")
    recent: int = Field(256, ge=0, description="most recent entries, read in place from the main cache")
    k: int = Field(2048, ge=1, description="selected entries per KV head (capped by what exists)")
    obs_window: int = Field(1, ge=1, description="decode query rows per refresh (paper Sec. 5.1: W = 1 for decode)")
    prefill_window: int = Field(16, ge=1, description="prompt query rows at the bootstrap (paper Sec. 5.1: tail "
                                                      "window W = 16)")
    # trigger (paper Sec. 5.1: a boundary-token set and a refresh budget T_max = 64)
    trigger: Literal["boundary", "fixed_periodic", "disabled"] = Field(
        "boundary", description="when the selected set is refreshed: boundary | fixed_periodic | disabled")
    min_gap: int = Field(1, ge=1, description="ours (1 = off): a boundary refresh waits until this many steps since "
                                              "the last refresh")
    max_interval: int = Field(64, ge=1, description="refresh budget T_max: a refresh is forced after this many steps")
    cooldown: int = Field(0, ge=0, description="ours (0 = off): boundaries seen this soon after a refresh are dropped")
    period: int = Field(32, ge=1, description="fixed_periodic: refresh every `period` steps")
    # selector: evidence
    alpha: float = Field(0.5, ge=0, description="power-mean exponent over query rows (0 = log-mean; with W = 1 it "
                                                "has no effect)")
    # selector: prior (paper Sec. 3.2: key-norm factor, global decay + tail brake)
    norm_power: float = Field(1.0, description="key-norm factor exponent (0 = off)")
    decay: float = Field(1.0, description="global position decay (log-factor -decay * distance / context)")
    tail: int = Field(-1, ge=-1, description="tail-brake length; -1 = the recent window")
    brake: float = Field(0.05, gt=0, le=1, description="tail-brake factor at the newest position")
    # selector: fusion (paper Sec. 3.2: reverse-KL, i.e. geometric, fusion; lambda* clipped)
    fusion: Literal["geometric", "linear"] = Field("geometric", description="geometric (paper, reverse KL) | linear")
    lam: float = Field(-1.0, description="fusion weight; negative = per-head stability rule lambda*")
    lam_clip: float = Field(0.02, ge=0, description="lambda* is clipped to [0, lam_clip] (paper Sec. 5.1 / "
                                                    "Table 6: 0.02)")
    # selector: diversity (paper Sec. 3.3; strengths Sec. 5.1 / Table 7)
    nms_window: int = Field(2, ge=0, description="soft-NMS half-window (positions)")
    nms_strength: float = Field(0.5, description="soft-NMS penalty at full overlap (nats; paper alpha_soft = 0.5)")
    excl_strength: float = Field(0.35, description="cross-head exclusivity penalty (nats, at most; paper "
                                                   "alpha_cross = 0.35)")
    excl_temperature: float = Field(1.0, gt=0, description="ownership softmax temperature")
    # unstable-head fallback (ours, not in the paper; dense_heads=0, the default, is the paper's SFI)
    dense_heads: float = Field(0.0, ge=0, le=1, description="ours (0 = off, the paper's SFI): at most this fraction "
                               "of a sequence's KV heads (all layers) take the fallback read")
    dense_min: float = Field(0.01, ge=0, le=1, description="... and only heads whose support_instability exceeds this")
    dense_budget: int = Field(1024, ge=0, description="entries a fallback head reads per step by Quest page bounds "
                                                      "(0 = all)")
    dense_page: int = Field(4, ge=1, description="page size of those bounds (Quest uses 16)")
    # fast-step implementation (ours; results equal up to float rounding)
    kernel: Literal["auto", "torch", "paged"] = Field(
        "auto", description="fast-step implementation: auto (the C++ CPU kernel on a CPU with a float32 cache, "
                            "where it builds; paged under the native engine's CUDA graphs) | torch | paged (the "
                            "graph-safe Triton runtime of kernels/sfi_paged.py; SFI alone, no fallback heads); "
                            "results equal up to float rounding")
    compact_dtype: Literal["auto", "cache", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 under the kernel with bf16 weights (bf16w), else cache | cache | bfloat16")

    @model_validator(mode="after")
    def _linear_lam(self) -> SFIOptions:
        if self.fusion == "linear" and self.lam > 1.0:
            raise ValueError(f"linear fusion needs lam <= 1 (got {self.lam})")
        return self


SINKROUTER_SCORES = ("logit_min", "logit_mean", "logit_max", "cos_min", "cos_mean")


class SinkRouterOptions(PolicyOptions):
    calibration: str = Field("", description="tau file; empty = the shipped `cotserve/calibration/<model-slug>.json` "
                                             "(server only)")
    target_skip: float = Field(0.0, ge=0, lt=1, description="which fitted tau(L) to use (a target stored in the "
                                                            "file); 0 = the file's default")
    first_layers: int = Field(2, ge=0, description="the first layers are never routed")
    surrogate: Literal["zero", "anchor_value"] = Field(
        "zero", description="zero (paper) | anchor_value (public reference implementation)")
    tau: float = Field(float("nan"), allow_inf_nan=True,
                       description="a fixed threshold for every L instead of the calibrated tau(L) (nan = "
                                   "calibrated); with it, `score` picks the score (no file needed)")
    score: Literal["logit_min", "logit_mean", "logit_max", "cos_min", "cos_mean"] = Field(
        "logit_min", description="the raw routing score used with a fixed `tau` (a calibration file names its "
                                 "own): logit_min | logit_mean | logit_max | cos_min | cos_mean")
    kernel: Literal["auto", "torch"] = Field(
        "auto", description="auto: on a CPU with a float32 cache, unrouted layers and layers with few sink groups "
                            "run `dense`'s C++ kernel | torch: the torch paths only")


class QuestOptions(PolicyOptions):
    budget: int = Field(1024, ge=1, description="tokens read per KV head per step besides the current page "
                                                "(budget // page_size top pages)")
    page_size: int = Field(16, ge=1, description="tokens per page")
    dense_layers: int = Field(2, ge=0, description="the first layers read everything (2 as in the paper)")
    group_reduce: Literal["sum", "max"] = Field(
        "sum", description="how a GQA group's query-head bounds combine per KV head (sum | max)")

    @model_validator(mode="after")
    def _one_page(self) -> QuestOptions:
        if self.budget < self.page_size:
            raise ValueError(f"budget ({self.budget}) must be at least one page ({self.page_size})")
        return self


class OracleTopKOptions(PolicyOptions):
    k: int = Field(2048, ge=0, description="entries read per KV head besides sinks and window")
    sinks: int = Field(4, ge=0, description="first entries always read")
    recent: int = Field(256, ge=0, description="most recent entries always read")
    stale: int = Field(0, ge=0, description="rank by the attention of the query this many steps back (0 = the "
                                            "current query)")


# -- eviction policies --------------------------------------------------------------------------
class EvictionOptions(PolicyOptions):
    budget: int = Field(1024, ge=2, description="KV entries kept per sequence, layer and KV head after a compaction")
    interval: int = Field(128, ge=1, description="decode steps between compactions (N); memory stays at most "
                                                 "budget + interval")
    window: int = Field(8, ge=1, description="the most recent entries always kept, and the number of observation "
                                             "queries (w)")
    compact_prefill: bool = Field(True, description="compact right after prefill when the prompt exceeds the budget")
    thought_rules: str = Field("", description="YAML/JSON file of thought classification rules "
                                               "(`thoughts.load_rules`); \"\" = the defaults (server only)")

    @model_validator(mode="after")
    def _budget_window(self) -> EvictionOptions:
        if self.budget <= self.window:
            raise ValueError(f"budget ({self.budget}) must be larger than window ({self.window})")
        return self


class RKVOptions(EvictionOptions):
    pool_width: int = Field(7, ge=1, description="max-pool width over neighbouring keys (odd)")
    sigma: float = Field(0.1, ge=0, le=1, description="weight of importance against redundancy (R-KV's lambda)")
    redundancy_threshold: float = Field(0.5, ge=-1, le=1, description="key cosine similarity above which two keys "
                                                                      "count as copies")
    redundancy_retain: int = Field(1, ge=0, description="newest copies exempted from redundancy (R-KV's beta)")
    group_reduce: Literal["prob", "logit"] = Field(
        "prob", description="how a GQA group's query heads combine: max over probabilities (prob, paper) | max over "
                            "logits (logit, R-KV code)")
    normalize: Literal["causal", "past"] = Field("causal", description="causal (paper) | past (R-KV code)")
    reference_quirk: bool = Field(False, description="reproduce the R-KV code's redundancy row without copies "
                                                     "(see scoring)")

    @model_validator(mode="after")
    def _odd_width(self) -> RKVOptions:
        if self.pool_width % 2 == 0:
            raise ValueError(f"pool_width must be odd, got {self.pool_width}")
        return self


class SkipKVOptions(RKVOptions):
    sentence_threshold: float = Field(0.95, ge=-1, le=1, description="sentence cosine similarity above which the "
                                                                     "earlier sentence is redundant")
    prompt_sentences: bool = Field(False, description="also cut the prompt into sentences (ours; the paper: the "
                                                      "output only)")


class H2OOptions(PolicyOptions):
    budget: int = Field(1024, ge=2, description="entries kept per KV head")
    recent_ratio: float = Field(0.5, ge=0, le=1, description="share of the budget kept as the most recent tokens "
                                                             "(0.5 as in the paper's experiments); the rest are "
                                                             "heavy hitters")
    interval: int = Field(1, ge=1, description="evict when a slot holds budget + interval entries (1 = each step, "
                                               "the paper's form)")
    group_reduce: Literal["sum", "max"] = Field(
        "sum", description="how the query heads of a GQA group add up into their KV head's score (sum | max)")


class StreamingLLMOptions(PolicyOptions):
    budget: int = Field(1024, ge=1, description="entries kept per KV head (sinks + recent)")
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    recent: int = Field(0, ge=0, description="window of latest tokens kept; 0 means budget - sinks (a positive "
                                             "value overrides and must satisfy sinks + recent <= budget)")
    interval: int = Field(1, ge=1, description="compact when a slot holds budget + interval entries (1 = every step, "
                                               "the paper's rolling cache)")

    @model_validator(mode="after")
    def _fits(self) -> StreamingLLMOptions:
        if self.recent == 0 and self.budget - self.sinks < 1:
            raise ValueError(f"budget ({self.budget}) must exceed sinks ({self.sinks})")
        if self.recent > 0 and self.sinks + self.recent > self.budget:
            raise ValueError(f"sinks + recent ({self.sinks + self.recent}) exceeds budget ({self.budget})")
        return self


class SnapKVOptions(PolicyOptions):
    budget: int = Field(1024, ge=2, description="prompt entries kept per KV head (window included)")
    window: int = Field(32, ge=1, description="observation window (last prompt tokens, always kept)")
    pool_width: int = Field(7, ge=1, description="pooling width (odd)")
    pooling: Literal["max", "avg"] = Field("max", description="max | avg")
    group_reduce: Literal["mean", "max"] = Field(
        "mean", description="how a GQA group's query heads combine into their KV head's score (mean | max)")

    @model_validator(mode="after")
    def _fits(self) -> SnapKVOptions:
        if self.budget <= self.window:
            raise ValueError(f"budget ({self.budget}) must exceed window ({self.window})")
        if self.pool_width % 2 == 0:
            raise ValueError(f"pool_width must be odd, got {self.pool_width}")
        return self


# -- steering -----------------------------------------------------------------------------------
class SteeringOptions(PolicyOptions):
    vector: str = Field("", description="path of a `.safetensors` vector; \"\" = the one shipped for the model's "
                                        "slug (server only)")
    layer: int = Field(-1, ge=-1, description="decoder layer whose input is steered; -1 = the layer the vector was "
                                              "built at")
    alpha0: float = Field(1.0, description="alpha_t = alpha0 + gamma * N_o (N_o: non-execution thoughts so far)")
    gamma: float = Field(0.02, description="see alpha0")
    enabled: bool = Field(True, description="false turns steering off")
    thought_rules: str = Field("", description="YAML/JSON file of thought classification rules, the same splitter "
                                               "and rules SkipKV's count uses; \"\" = the defaults (server only)")


# -- the table ----------------------------------------------------------------------------------
# name -> (axis, options model)
POLICIES: dict[str, tuple[str, type[PolicyOptions]]] = {
    "dense": ("read", DenseOptions),
    "sfi": ("read", SFIOptions),
    "sinkrouter": ("read", SinkRouterOptions),
    "quest": ("read", QuestOptions),
    "oracle_topk": ("read", OracleTopKOptions),
    "skipkv": ("evict", SkipKVOptions),
    "rkv": ("evict", RKVOptions),
    "h2o": ("evict", H2OOptions),
    "streamingllm": ("evict", StreamingLLMOptions),
    "snapkv": ("evict", SnapKVOptions),
    "steering": ("steer", SteeringOptions),
}

# Old option names (one name per idea across policies), refused with a hint: policy -> old -> new.
RENAMED: dict[str, dict[str, str]] = {
    "rkv": {"kernel": "pool_width", "gqa_pool": "group_reduce"},
    "skipkv": {"kernel": "pool_width", "gqa_pool": "group_reduce", "tau": "sentence_threshold"},
    "snapkv": {"kernel": "pool_width"},
    "h2o": {"every": "interval"},
    "streamingllm": {"every": "interval", "sink": "sinks"},
}

# Options that name files on the server: settable with `serve --policy-opt` / `--policy-file`,
# refused in a request's `cotserve.options` (a client must not point the server at its files).
SERVER_ONLY_OPTIONS = frozenset({"calibration", "vector", "thought_rules"})

MAX_OPTIONS = 64  # options in one request


def server_only_keys(options: dict[str, Any]) -> list[str]:
    """The keys of `options` (plain or `policy.key`) that only the server may set."""
    return sorted(k for k in options if isinstance(k, str) and k.rpartition(".")[2] in SERVER_ONLY_OPTIONS)


def option_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def split_spec(spec: str | None, known: dict[str, str] | None = None) -> list[str]:
    """The policy names of a spec, checked: known names, at most one per axis. `known` maps
    name -> axis (default: the built-in policies)."""
    axes_of = known if known is not None else {n: a for n, (a, _) in POLICIES.items()}
    if not isinstance(spec, str):
        raise OptionError("the policy spec must be a string", "cotserve.policy")
    spec = spec.strip() or "dense"
    if len(spec) > 200:
        raise OptionError("the policy spec is too long", "cotserve.policy")
    names = [n.strip() for n in spec.split("+") if n.strip()]
    if not names:
        raise OptionError("empty policy spec", "cotserve.policy")
    taken: dict[str, str] = {}
    for n in names:
        if n not in axes_of:
            raise OptionError(f"unknown policy {n!r} (available: {', '.join(sorted(axes_of))})", "cotserve.policy")
        axis = axes_of[n]
        if axis in taken:
            raise OptionError(f"policies {taken[axis]!r} and {n!r} conflict: both decide the {axis} axis; stack at "
                              "most one read, one evict and one steer policy", "cotserve.policy")
        taken[axis] = n
    return names


def _renamed_hint(policy: str, key: str) -> str | None:
    new = RENAMED.get(policy, {}).get(key)
    return None if new is None else f"option {key!r} of {policy!r} was renamed to {new!r}"


def route(spec: str, names: list[str], options: dict[str, Any],
          fields_of: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Options per part: `policy.key` goes to that part, a plain key to every part that has it."""
    per_part: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        param = f"cotserve.options.{key}"
        if not isinstance(key, str) or not key:
            raise OptionError("option names must be non-empty strings", "cotserve.options")
        if "." in key:
            target, _, name = key.partition(".")
            if target not in per_part:
                raise OptionError(f"option {key!r} targets {target!r}, which is not in the stack {spec!r}", param)
            if name not in fields_of[target]:
                hint = _renamed_hint(target, name)
                if hint:
                    raise OptionError(f"{hint}; use {target}.{RENAMED[target][name]}", param)
                raise OptionError(f"policy {target!r} has no option {name!r} (options: "
                                  f"{', '.join(sorted(fields_of[target])) or 'none'})", param)
            per_part[target][name] = (key, value)
            continue
        owners = [n for n in names if key in fields_of[n]]
        if not owners:
            hints = [h for h in (_renamed_hint(n, key) for n in names) if h]
            if hints:
                raise OptionError("; ".join(hints), param)
            valid = sorted({f for n in names for f in fields_of[n]})
            near = difflib.get_close_matches(key, valid, n=3)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise OptionError(f"no policy in {spec!r} has an option {key!r} ({hint}options: "
                              f"{', '.join(valid) or 'none'})", param)
        for n in owners:
            per_part[n].setdefault(key, (key, value))
    return per_part



def validate_part(name: str, given: dict[str, tuple[str, Any]], model: type[PolicyOptions],
                  strict: bool = True) -> PolicyOptions:
    """One part's options through its model; `given` maps field -> (key as given, value). A
    `strict` validation (requests) takes JSON types as they are; a lax one (server flags,
    `--policy-opt k=1024`) converts strings."""
    data = {f: v for f, (_, v) in given.items()}
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        field = loc[0] if loc else ""
        key = given[field][0] if field in given else field
        param = f"cotserve.options.{key}" if key else "cotserve.options"
        msg = err.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        where = f"policy {name!r} option {key!r}" if key else f"policy {name!r}"
        shown = repr(err.get("input"))
        if field and len(shown) <= 60:
            return_msg = f"{where}={shown}: {msg}"
        else:
            return_msg = f"{where}: {msg}"
        raise OptionError(return_msg, param) from None


def validate_spec(spec: str | None, options: dict[str, Any] | None = None,
                  strict: bool = True) -> dict[str, PolicyOptions]:
    """Check a spec and its options against the built-in policies' models (no files opened):
    the validated options per part, or an `OptionError` naming the offending `param`."""
    options = dict(options or {})
    if len(options) > MAX_OPTIONS:
        raise OptionError(f"at most {MAX_OPTIONS} policy options per request", "cotserve.options")
    names = split_spec(spec)
    fields_of = {n: option_names(POLICIES[n][1]) for n in names}
    per_part = route(spec or "dense", names, options, fields_of)
    return {n: validate_part(n, per_part[n], POLICIES[n][1], strict) for n in names}


def typed_options(spec: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """Server options (`--policy-opt k=1024` gives strings) with each value converted to its
    option's type, keys unchanged, so that a request's options can be merged over them and the
    whole checked strictly. Raises `OptionError` for options the spec does not take."""
    options = dict(options or {})
    names = split_spec(spec)
    fields_of = {n: option_names(POLICIES[n][1]) for n in names}
    per_part = route(spec or "dense", names, options, fields_of)
    typed: dict[str, Any] = {}
    for n in names:
        values = validate_part(n, per_part[n], POLICIES[n][1], strict=False)
        for field, (key, _) in per_part[n].items():
            typed.setdefault(key, getattr(values, field))
    return typed
