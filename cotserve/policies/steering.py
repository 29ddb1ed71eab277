"""`steering`: adaptive steering of the hidden state at thought boundaries (steer axis).

Method: SkipKV (arXiv 2512.07993, Sec. 4.2) adaptive steering, with the offline steering vector of
SEAL (Chen et al. 2025, "SEAL: Steerable reasoning calibration of LLMs for free", Sec. 4).

Offline (`cotserve build-steering`, see `cotserve/build_steering.py`) a vector is extracted from
the hidden states entering decoder layer L at the blank-line boundary token before each thought:

    v = mean(h | reflection or transition thought) - mean(h | execution thought)

Sign convention: cotserve's v points FROM execution TOWARD reflection/transition. SEAL defines
its vector the other way round, S = mean(execution) - mean(reflection/transition) = -v, and adds
alpha * S. Steering here SUBTRACTS alpha_t * v, which is exactly SEAL's h + alpha * S: it pushes
the next thought away from reflection/transition (toward execution). A positive alpha0 shortens
wandering; a negative alpha0 would encourage more reflection.

Decode time: at each boundary token (`thoughts.BlankLineTracker`: the delimiter token at which a
run of newline-type tokens first holds a blank line), the hidden state entering layer L at that
position only becomes

    h <- h - alpha_t * v,     alpha_t = alpha0 + gamma * N_o          (SkipKV, Sec. 4.2)

where N_o is the number of non-execution (reflection + transition) thoughts this sequence has
produced so far, including the thought that the boundary token closes. Only generated tokens are
steered (the prompt is not); when the sequence contains a `<think>` token (the tokenizer's own
single-token `<think>` / `</think>`, from the prompt or generated), only boundaries inside the
thinking region are steered; a sequence without one is steered everywhere.

Per-request control (`batch.extras[slot]`, i.e. `GenRequest.extras`): either
`{"steering": {"enabled": bool, "alpha0": float, "gamma": float}}` (any subset; `"steering": false`
switches it off), or the request's flat `cotserve.options` dict as `{"options": {...}}` whose keys
`enabled`, `alpha0`, `gamma` (or `steering.enabled`, ...) override the stack's config for that
request only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cotserve.errors import CotserveError, PolicyError
from cotserve.policies.base import Axis, Policy, PolicyConfig, Runtime
from cotserve.policies.boundaries import think_ids, thought_delimiter_ids
from cotserve.policies.options import SteeringOptions, check_config, options_config
from cotserve.policies.registry import _coerce, register
from cotserve.policies.served import VECTOR_KEY, shipped_vector_dir
from cotserve.policies.thoughts import DEFAULT_RULES, ThoughtRules, load_rules, thought_tracker

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState

BUILD_HINT = "cotserve build-steering --model {model} --data math_train.jsonl --layer L --samples N --out DIR"


def shipped_dir() -> Path:
    """The folder of vectors shipped with the package (`cotserve/steering_vectors/`)."""
    return shipped_vector_dir()


def vector_path(out_dir: str | Path, slug: str, layer: int) -> Path:
    return Path(out_dir) / slug / f"layer_{layer}.safetensors"


def save_vector(path: str | Path, vector: torch.Tensor, layer: int, hidden_size: int, num_layers: int,
                **meta: str) -> Path:
    """Write a vector file (atomically): tensor `steering_vector` [H] float32 plus metadata."""
    import os

    from safetensors.torch import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    info = {"layer": str(layer), "hidden_size": str(hidden_size), "num_layers": str(num_layers),
            **{k: str(v) for k, v in meta.items()}}
    tmp = p.with_name(p.name + ".tmp")
    save_file({VECTOR_KEY: vector.detach().float().cpu().contiguous()}, str(tmp), metadata=info)
    os.replace(tmp, p)
    return p


@dataclass
class SteeringVector:
    vector: torch.Tensor  # [H] float32, CPU
    layer: int
    meta: dict[str, str]
    path: Path


_LOADED: dict[tuple[str, float], SteeringVector] = {}


def load_vector(path: str | Path) -> SteeringVector:
    """Read a vector written by `cotserve build-steering` (tensor `steering_vector` [H] and
    metadata: layer, hidden_size, num_layers, model). Cached per file and modification time."""
    from safetensors import safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise PolicyError(f"steering vector {p} does not exist")
    key = (str(p.resolve()), p.stat().st_mtime)
    if key in _LOADED:
        return _LOADED[key]
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if VECTOR_KEY not in f.keys():
                raise PolicyError(f"{p} holds no tensor {VECTOR_KEY!r}: not a cotserve steering vector")
            vec = f.get_tensor(VECTOR_KEY)
    except PolicyError:
        raise
    except Exception as exc:
        raise PolicyError(f"cannot read steering vector {p}: {type(exc).__name__}: {exc}") from exc
    if vec.dim() != 1:
        raise PolicyError(f"steering vector {p} has shape {tuple(vec.shape)}; expected one dimension [hidden_size]")
    if not torch.isfinite(vec).all():
        raise PolicyError(f"steering vector {p} holds non-finite values")
    try:
        layer = int(meta.get("layer", "-1"))
    except ValueError:
        layer = -1
    sv = SteeringVector(vec.float().contiguous(), layer, meta, p)
    _LOADED[key] = sv
    return sv


def resolve_vector(config: SteeringConfig, model_name: str) -> SteeringVector:
    """The configured vector file, else the shipped one for the model's slug."""
    from cotserve.model_names import model_slug

    if config.vector:
        return load_vector(config.vector)
    slug = model_slug(model_name)
    folder = shipped_dir() / slug
    hint = BUILD_HINT.format(model=model_name)
    if config.layer >= 0:
        path = folder / f"layer_{config.layer}.safetensors"
        if not path.is_file():
            raise PolicyError(
                f"no steering vector shipped for model {slug!r} at layer {config.layer} ({path}); "
                f"build one with `{hint}` and pass steering.vector=DIR/{slug}/layer_L.safetensors"
            )
        return load_vector(path)
    found = sorted(folder.glob("layer_*.safetensors")) if folder.is_dir() else []
    if not found:
        raise PolicyError(
            f"no steering vector shipped for model {slug!r} (looked in {folder}); build one with "
            f"`{hint}` and pass steering.vector=DIR/{slug}/layer_L.safetensors"
        )
    if len(found) > 1:
        layers = ", ".join(p.stem.removeprefix("layer_") for p in found)
        raise PolicyError(f"several steering vectors shipped for model {slug!r} (layers {layers}); choose one with steering.layer")
    return load_vector(found[0])


def check_vector(sv: SteeringVector, layer: int, hidden_size: int, num_layers: int, model_name: str) -> None:
    """Refuse a vector that cannot belong to this model (hidden size, layer range, depth)."""
    n = sv.vector.numel()
    hint = BUILD_HINT.format(model=model_name)
    if n != hidden_size:
        raise PolicyError(
            f"steering vector {sv.path} has size {n}, but model {model_name!r} has hidden size {hidden_size}; "
            f"build one for this model with `{hint}`"
        )
    if not 0 <= layer < num_layers:
        raise PolicyError(f"steering layer {layer} is out of range: model {model_name!r} has {num_layers} layers (0..{num_layers - 1})")
    built_layers = sv.meta.get("num_layers")
    if built_layers is not None and built_layers.isdigit() and int(built_layers) != num_layers:
        raise PolicyError(
            f"steering vector {sv.path} was built for a model with {built_layers} layers, but model "
            f"{model_name!r} has {num_layers}; build one for this model with `{hint}`"
        )


@options_config(SteeringOptions)
class SteeringConfig(PolicyConfig):
    """`SteeringOptions` (SkipKV Sec. 4.2 defaults): alpha_t = alpha0 + gamma * N_o (N_o:
    non-execution thoughts so far); `enabled` may also be set per request (extras, see the module
    docstring)."""

    def validate(self) -> None:
        check_config(self)
        if self.vector and not Path(self.vector).expanduser().is_file():
            raise ValueError(f"steering vector {self.vector} does not exist")
        if self.thought_rules:
            try:
                load_rules(self.thought_rules)
            except CotserveError as exc:
                raise ValueError(str(exc)) from exc


@dataclass
class _Knobs:
    enabled: bool
    alpha0: float
    gamma: float


_KNOBS = ("enabled", "alpha0", "gamma")


def request_knobs(config: SteeringConfig, extras: dict[str, Any] | None) -> _Knobs:
    """The stack's knobs with one request's overrides (see the module docstring)."""
    knobs = {k: getattr(config, k) for k in _KNOBS}
    extras = extras or {}
    given: dict[str, Any] = {}
    options = extras.get("options")
    if isinstance(options, dict):
        for k, v in options.items():
            name = k.removeprefix("steering.")
            if name in _KNOBS and (k == name or k.startswith("steering.")):
                given[name] = v
    block = extras.get("steering")
    if isinstance(block, bool):
        given["enabled"] = block
    elif isinstance(block, dict):
        unknown = sorted(set(block) - set(_KNOBS))
        if unknown:
            raise PolicyError(f"per-request steering option(s) {', '.join(unknown)} unknown (known: {', '.join(_KNOBS)})")
        given.update(block)
    elif block is not None:
        raise PolicyError(f"per-request 'steering' must be a boolean or an object, got {type(block).__name__}")
    for k, v in given.items():
        try:
            val = _coerce(v, knobs[k])
            val = bool(val) if k == "enabled" else float(val)
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"per-request steering option {k}={v!r}: {exc}") from exc
        if k != "enabled" and not math.isfinite(val):
            raise PolicyError(f"per-request steering option {k}={v!r} must be finite")
        knobs[k] = val
    return _Knobs(**knobs)


class SlotThoughts:
    """One sequence's thought state, fed with the tokens the engine appends (generated only)."""

    def __init__(self, tokenizer, delims: frozenset[int], prompt: list[int], think: tuple[int | None, int | None],
                 rules: ThoughtRules = DEFAULT_RULES):
        self.tracker = thought_tracker(tokenizer, delims, rules)
        self.open_id, self.close_id = think
        self.consumed = len(prompt)
        self.region = "none"  # none (no <think> seen) | inside | after
        for t in prompt:
            self._think(t)

    def _think(self, t: int) -> None:
        if self.open_id is not None and t == self.open_id:
            self.region = "inside"
        elif self.close_id is not None and t == self.close_id and self.region == "inside":
            self.region = "after"

    def feed(self, tokens: list[int]) -> bool:
        """Push the tokens not seen yet; True when the latest one is a steerable boundary."""
        if len(tokens) <= self.consumed:
            return False
        for t in tokens[self.consumed:]:
            self._think(t)
            self.tracker.push(t)
        self.consumed = len(tokens)
        return self.tracker.at_boundary and self.region != "after"


class ThoughtFollower(Policy):
    """Shared mechanics of policies that act at the thought boundaries of generated tokens:
    per-slot `SlotThoughts`, fed once per decode forward when the hook reaches `self.layer`."""

    axis = Axis.STEER

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self.slots: list[SlotThoughts] = []
        self.layer = 0

    def begin(self, batch: BatchState) -> None:
        tok = batch.info.tokenizer
        delims = thought_delimiter_ids(tok)
        think = think_ids(tok)
        rules = load_rules(getattr(self.config, "thought_rules", ""))
        self.slots = [SlotThoughts(tok, delims, batch.tokens[i], think, rules) for i in range(batch.batch_size)]

    def boundaries(self, batch: BatchState) -> list[int]:
        """Slots whose current token (the one being forwarded) is a steerable boundary."""
        out = []
        for i, st in enumerate(self.slots):
            if batch.active is not None and not bool(batch.active[i]):
                continue
            if st.feed(batch.tokens[i]):
                out.append(i)
        return out


@register
class SteeringPolicy(ThoughtFollower):
    """Adaptive steering (SkipKV Sec. 4.2) with a SEAL vector; see the module docstring."""

    name = "steering"
    axis = Axis.STEER
    config_cls = SteeringConfig
    runtimes = Runtime.ALL

    def __init__(self, config: SteeringConfig | None = None):
        super().__init__(config)
        self.vector: torch.Tensor | None = None
        self.knobs: list[_Knobs] = []
        self.applications: list[int] = []
        self.alpha_sum: list[float] = []

    def begin(self, batch: BatchState) -> None:
        cfg: SteeringConfig = self.config  # type: ignore[assignment]
        self.knobs = [request_knobs(cfg, batch.extras.get(i)) for i in range(batch.batch_size)]
        self.applications = [0] * batch.batch_size
        self.alpha_sum = [0.0] * batch.batch_size
        super().begin(batch)
        self.vector = None
        self.layer = max(cfg.layer, 0)
        if not any(k.enabled for k in self.knobs):
            return  # thoughts are still followed (telemetry), nothing is loaded
        info = batch.info
        sv = resolve_vector(cfg, info.model_name)
        self.layer = cfg.layer if cfg.layer >= 0 else sv.layer
        if self.layer < 0:
            raise PolicyError(f"steering vector {sv.path} does not record its layer; set steering.layer")
        check_vector(sv, self.layer, info.hidden_size, info.num_layers, info.model_name)
        self.vector = sv.vector

    def alpha(self, slot: int) -> float:
        k = self.knobs[slot]
        return k.alpha0 + k.gamma * self.slots[slot].tracker.non_execution

    def steer(self, layer: int, hidden: torch.Tensor, batch: BatchState) -> torch.Tensor:
        if layer != self.layer or batch.mode != "decode":
            return hidden
        rows = self.boundaries(batch)  # also keeps N_o counting while steering is off
        rows = [i for i in rows if self.knobs[i].enabled]
        if self.vector is None or not rows:
            return hidden
        if self.vector.dtype != hidden.dtype or self.vector.device != hidden.device:
            self.vector = self.vector.to(device=hidden.device, dtype=hidden.dtype)
        alphas = [self.alpha(i) for i in rows]
        for i, a in zip(rows, alphas, strict=True):
            self.applications[i] += 1
            self.alpha_sum[i] += a
        idx = torch.tensor(rows, device=hidden.device)
        scale = torch.tensor(alphas, device=hidden.device, dtype=hidden.dtype).view(-1, 1)
        hidden = hidden.clone()
        hidden[idx, -1] -= scale * self.vector
        return hidden

    def telemetry(self, slot: int) -> dict[str, Any]:
        if not self.slots:
            return {}
        n = self.applications[slot]
        return {
            "steering_applications": n,
            "steering_alpha_mean": round(self.alpha_sum[slot] / n, 6) if n else 0.0,
            "steering_non_execution": self.slots[slot].tracker.non_execution,
        }
