"""Policy options checked against the served model, free of torch.

The typed option models (`options.py`) check what a value may be on any server. Some options
are only valid for the model being served and the files the server has:

* `sinkrouter` without a fixed `tau` needs a calibration for the model (the shipped
  `cotserve/calibration/<model-slug>.json`, or the server's `calibration`): `target_skip` must be
  a target fitted in it, `first_layers` the value it was fitted with;
* `steering` needs a vector for the model (shipped in `steering_vectors/<model-slug>/`, or the
  server's `vector`): `layer` must be a layer one was built at, the vector the model's size;
* layer indices and counts (`steering.layer`, `sinkrouter.first_layers`, `quest.dense_layers`)
  must lie within the model's layers.

`check_served` runs these checks where no engine is loaded (the gateway, before it enqueues a
job; `serve`, on its default policy at startup): an `OptionError` whose `param` names the option
(`cotserve.options.<key as given>`), or `cotserve.policy` when the policy cannot run on this
model whatever its options. Messages name no server path: a client learns which option to
change, the server log and the CLI keep the paths. The worker checks again when it builds the
policy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from cotserve.model_names import DEFAULT_MODEL, model_slug
from cotserve.policies.options import (
    POLICIES,
    OptionError,
    PolicyOptions,
    option_names,
    route,
    split_spec,
    validate_part,
)

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "calibration"  # the shipped sinkrouter calibrations
VECTOR_KEY = "steering_vector"  # the tensor of a steering vector file
POLICY_PARAM = "cotserve.policy"


def shipped_calibration(slug: str) -> Path:
    return CALIBRATION_DIR / f"{slug}.json"


def shipped_vector_dir() -> Path:
    """The folder of steering vectors shipped with the package (`cotserve/steering_vectors/`): one
    subfolder per model slug, `layer_<L>.safetensors` in it."""
    import cotserve.steering_vectors as sv

    return Path(sv.__file__).resolve().parent


@dataclass(frozen=True)
class ServedModel:
    """What the checks need to know of the served model."""

    name: str  # the model spec the workers load; its slug names the shipped files
    num_layers: int
    hidden_size: int | None = None
    num_kv_heads: int | None = None

    @property
    def slug(self) -> str:
        return model_slug(self.name)

    @classmethod
    def from_config(cls, name: str | None, config: Any) -> ServedModel | None:
        """From a transformers config (None when it does not say how many layers there are)."""
        cfg = getattr(config, "text_config", None) or config
        layers = getattr(cfg, "num_hidden_layers", None)
        if not isinstance(layers, int) or layers < 1:
            return None
        hidden = getattr(cfg, "hidden_size", None)
        kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
        return cls(name or DEFAULT_MODEL, layers, hidden if isinstance(hidden, int) else None,
                   kv if isinstance(kv, int) else None)

    @classmethod
    def from_info(cls, info: Any) -> ServedModel:
        """From a loaded engine's `EngineInfo`."""
        return cls(info.model_name, int(info.num_layers), int(info.hidden_size), int(info.num_kv_heads))


@dataclass
class _Part:
    """One policy of the spec: its validated options and the keys the options were given under."""

    name: str
    given: dict[str, tuple[str, Any]]
    values: PolicyOptions

    def param(self, field: str) -> str:
        return f"cotserve.options.{self.given[field][0] if field in self.given else field}"

    def has(self, field: str) -> bool:
        return field in self.given


# -- server files, read without torch (cached by path, size and modification time) ------------------
def _stamp(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_size, st.st_mtime_ns) if path.is_file() else None


@lru_cache(maxsize=64)
def _calibration(stamp: tuple[str, int, int]) -> dict[str, Any] | None:
    """The fields of a calibration file the checks use, or None when it is not a valid one."""
    try:
        data = json.loads(Path(stamp[0]).read_text())
        return {"model": str(data["model"]), "first_layers": int(data["first_layers"]),
                "default_target": round(float(data["default_target"]), 4),
                "targets": sorted(round(float(t), 4) for t in data["fits"]),
                "num_layers": int(data["num_layers"]), "num_kv_heads": int(data["num_kv_heads"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@lru_cache(maxsize=64)
def _vector(stamp: tuple[str, int, int]) -> dict[str, Any] | None:
    """A steering vector's size and metadata, from its safetensors header; None when it is not one."""
    try:
        with open(stamp[0], "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 1 << 20:
                return None
            header = json.loads(f.read(n))
        shape = header[VECTOR_KEY]["shape"]
        meta = header.get("__metadata__") or {}
        if len(shape) != 1:
            return None
        return {"size": int(shape[0]), "layer": int(meta.get("layer", -1)),
                "num_layers": int(meta["num_layers"]) if str(meta.get("num_layers", "")).isdigit() else None}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# -- the checks ------------------------------------------------------------------------------------
def _layer_count(part: _Part, field: str, model: ServedModel) -> None:
    """A count of first layers given explicitly must not exceed the model's layers."""
    value = getattr(part.values, field)
    if part.has(field) and value > model.num_layers:
        raise OptionError(f"policy {part.name!r} option {field}={value} is beyond the model's {model.num_layers} "
                          "layers", part.param(field))


def _check_sinkrouter(part: _Part, model: ServedModel) -> None:
    o = part.values
    _layer_count(part, "first_layers", model)
    if not math.isnan(o.tau):
        return  # a fixed threshold: no calibration read
    server_file = bool(o.calibration)
    path = Path(o.calibration).expanduser() if server_file else shipped_calibration(model.slug)
    whose = "the server's sinkrouter calibration" if server_file else f"the sinkrouter calibration of {model.slug!r}"
    stamp = _stamp(path)
    if stamp is None:
        raise OptionError(f"sinkrouter has no calibration for model {model.slug!r} on this server; give a fixed "
                          "threshold with the option tau (and the routing score with score)", POLICY_PARAM)
    cal = _calibration(stamp)
    if cal is None:
        raise OptionError(f"{whose} cannot be read; give a fixed threshold with the option tau", POLICY_PARAM)
    if model_slug(cal["model"]) != model.slug or cal["num_layers"] != model.num_layers or (
            model.num_kv_heads is not None and cal["num_kv_heads"] != model.num_kv_heads):
        raise OptionError(f"{whose} was made for another model ({cal['model']!r}); give a fixed threshold with "
                          "the option tau", POLICY_PARAM)
    target = cal["default_target"] if o.target_skip == 0 else round(o.target_skip, 4)
    if target not in cal["targets"]:
        have = ", ".join(str(t) for t in cal["targets"])
        raise OptionError(f"{whose} has no fit for target_skip={target} (fitted targets: {have}; 0 = the default, "
                          f"{cal['default_target']})", part.param("target_skip"))
    if o.first_layers != cal["first_layers"]:
        raise OptionError(f"{whose} was fitted with first_layers={cal['first_layers']}, not {o.first_layers}; "
                          f"send first_layers={cal['first_layers']}, or a fixed threshold with the option tau",
                          part.param("first_layers"))


def _check_steering(part: _Part, model: ServedModel) -> None:
    o = part.values
    n = model.num_layers
    if o.layer >= n:
        raise OptionError(f"steering layer {o.layer} is out of range: the model has {n} layers (0..{n - 1})",
                          part.param("layer"))
    if not o.enabled:
        return  # nothing is loaded
    if o.vector:
        stamp, whose = _stamp(Path(o.vector).expanduser()), "the server's steering vector"
        if stamp is None:
            raise OptionError(f"{whose} does not exist", POLICY_PARAM)
    else:
        folder = shipped_vector_dir() / model.slug
        found = sorted(folder.glob("layer_*.safetensors")) if folder.is_dir() else []
        layers = ", ".join(p.stem.removeprefix("layer_") for p in found) or "none"
        whose = f"the steering vector of {model.slug!r}"
        if o.layer >= 0:
            stamp = _stamp(folder / f"layer_{o.layer}.safetensors")
            if stamp is None:
                raise OptionError(f"this server has no steering vector for model {model.slug!r} at layer {o.layer} "
                                  f"(it has layers: {layers})", part.param("layer"))
        elif not found:
            raise OptionError(f"this server has no steering vector for model {model.slug!r}", POLICY_PARAM)
        elif len(found) > 1:
            raise OptionError(f"this server has steering vectors for model {model.slug!r} at several layers "
                              f"({layers}); choose one with the option layer", part.param("layer"))
        else:
            stamp = _stamp(found[0])
            if stamp is None:
                raise OptionError(f"{whose} cannot be read", POLICY_PARAM)
    vec = _vector(stamp)
    if vec is None:
        raise OptionError(f"{whose} cannot be read", POLICY_PARAM)
    if (model.hidden_size is not None and vec["size"] != model.hidden_size) or (
            vec["num_layers"] is not None and vec["num_layers"] != n):
        raise OptionError(f"{whose} was built for another model (size {vec['size']}, {vec['num_layers']} layers; "
                          f"this one: {model.hidden_size}, {n})", POLICY_PARAM)
    layer = o.layer if o.layer >= 0 else vec["layer"]
    if layer < 0:
        raise OptionError(f"{whose} does not record its layer; choose one with the option layer", part.param("layer"))
    if layer >= n:
        raise OptionError(f"{whose} is for layer {layer}, beyond the model's {n} layers", part.param("layer"))


def _check_quest(part: _Part, model: ServedModel) -> None:
    _layer_count(part, "dense_layers", model)


CHECKS = {"sinkrouter": _check_sinkrouter, "steering": _check_steering, "quest": _check_quest}


def check_served(spec: str | None, options: dict[str, Any] | None, model: ServedModel) -> None:
    """Raise an `OptionError` when the spec and its options (already valid for the option models)
    cannot run on `model` with this server's files."""
    options = dict(options or {})
    names = split_spec(spec)
    fields_of = {n: option_names(POLICIES[n][1]) for n in names}
    per_part = route(spec or "dense", names, options, fields_of)
    for n in names:
        check = CHECKS.get(n)
        if check is not None:
            check(_Part(n, per_part[n], validate_part(n, per_part[n], POLICIES[n][1], strict=False)), model)
