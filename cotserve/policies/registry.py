"""Policy registry and spec parsing.

A spec names one policy, or a stack of at most one per axis joined with `+`
(e.g. `skipkv+sfi+steering`). Options are a flat dict; a key may be prefixed with the policy
name (`sfi.k=1024`) to target one part of a stack, otherwise it goes to every part whose config
has that field. An option no part knows is an error, as is a stack with two parts on one axis.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

from cotserve.errors import PolicyError
from cotserve.policies.base import Axis, Policy, PolicyConfig, PolicyStack
from cotserve.policies.options import (
    RENAMED,
    SERVER_ONLY_OPTIONS,
    OptionError,
    route,
    server_only_keys,
    split_spec,
    validate_part,
)

__all__ = ["REGISTRY", "RENAMED", "SERVER_ONLY_OPTIONS", "OptionError", "available", "build_policy", "make_config",
           "parse_options", "register", "runs_on", "server_only_keys"]

REGISTRY: dict[str, type[Policy]] = {}

# Modules that define policies; imported lazily so a missing optional piece breaks only itself.
POLICY_MODULES = [
    "cotserve.policies.dense",
    "cotserve.policies.sfi",
    "cotserve.policies.sinkrouter",
    "cotserve.policies.rkv",
    "cotserve.policies.skipkv",
    "cotserve.policies.streamingllm",
    "cotserve.policies.h2o",
    "cotserve.policies.snapkv",
    "cotserve.policies.quest",
    "cotserve.policies.steering",
    "cotserve.policies.oracle",
]


def register(cls: type[Policy]) -> type[Policy]:
    REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for mod in POLICY_MODULES:
        importlib.import_module(mod)


def available() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


def runs_on(*runtimes: str) -> list[str]:
    """The policies that declare one of `runtimes` (`Policy.runtimes`, `interface.Runtime`), sorted."""
    _load_all()
    return sorted(name for name, cls in REGISTRY.items() if cls.runtimes & set(runtimes))


def _coerce(value: Any, target: Any) -> Any:
    """Turn CLI strings into the type of the config field's default."""
    if not isinstance(value, str):
        return value
    if isinstance(target, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if isinstance(target, int):
        return int(value)
    if isinstance(target, float):
        return float(value)
    if isinstance(target, (list, tuple)):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _options_model(cls: type[Policy]):
    """The typed options model the policy's config is built from (`options.options_config`); None
    for a plain dataclass config."""
    model = getattr(cls.config_cls, "options_model", None)
    if model is None or set(model.model_fields) != {f.name for f in dataclasses.fields(cls.config_cls)}:
        return None  # a config that adds fields of its own (tests): its dataclass rules
    return model


def make_config(cls: type[Policy], options: dict[str, Any]) -> PolicyConfig:
    """The policy's config from options (strings from the command line are converted): checked
    by the policy's typed options model (`policies.options`), then by the config's own
    `validate` (files that must exist)."""
    model = _options_model(cls)
    fields = {f.name: f for f in dataclasses.fields(cls.config_cls)}
    if model is not None:
        values = validate_part(cls.name, {k: (k, v) for k, v in options.items()}, model, strict=False)
        kwargs = values.model_dump()
    else:
        defaults = cls.config_cls()
        kwargs = {}
        for key, value in options.items():
            if key not in fields:
                known = ", ".join(sorted(fields)) or "none"
                raise PolicyError(f"policy {cls.name!r} has no option {key!r} (options: {known})")
            try:
                kwargs[key] = _coerce(value, getattr(defaults, key))
            except (TypeError, ValueError) as exc:
                raise PolicyError(f"policy option {cls.name}.{key}={value!r}: {exc}") from exc
    try:
        config = cls.config_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy {cls.name!r}: {exc}") from exc
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as exc:
            raise OptionError(f"policy {cls.name!r}: {exc}") from exc
    return config


def build_policy(spec: str | None, options: dict[str, Any] | None = None) -> PolicyStack:
    """Build a fresh stack (policies hold per-batch state: build one per batch)."""
    _load_all()
    spec = (spec or "dense").strip() or "dense"
    names = split_spec(spec, {n: c.axis for n, c in REGISTRY.items()})
    classes = [REGISTRY[n] for n in names]
    fields_of = {c.name: [f.name for f in dataclasses.fields(c.config_cls)] for c in classes}
    routed = route(spec, names, dict(options or {}), fields_of)
    per_part = {n: {k: v for k, (_, v) in given.items()} for n, given in routed.items()}
    parts = [cls(make_config(cls, per_part[cls.name])) for cls in classes]
    if len(parts) > 1:  # dense beside an eviction/steering part: those parts' default read
        parts = [p for p in parts if p.name != "dense"]
    # Hooks run evict -> read -> steer whatever the spec's order: an eviction policy records the
    # step's queries in decode_attention (returning None) before the read policy answers.
    order = {Axis.EVICT: 0, Axis.READ: 1, Axis.STEER: 2}
    parts.sort(key=lambda p: order.get(p.axis, 1))
    return PolicyStack(parts)


def parse_options(pairs: list[str] | None, file: str | None = None) -> dict[str, Any]:
    """`--policy-opt key=value` pairs plus an optional YAML/JSON file (pairs win)."""
    options: dict[str, Any] = {}
    if file:
        path = Path(file)
        if not path.is_file():
            raise PolicyError(f"policy options file {file} does not exist")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as exc:
            raise PolicyError(f"cannot parse policy options file {file}: {exc}") from exc
        if not isinstance(data, dict):
            raise PolicyError(f"policy options file {file} must hold a mapping")
        for k, v in data.items():
            if isinstance(v, dict):  # {"sfi": {"k": 1024}} -> sfi.k
                for k2, v2 in v.items():
                    options[f"{k}.{k2}"] = v2
            else:
                options[k] = v
    for pair in pairs or []:
        if "=" not in pair:
            raise PolicyError(f"--policy-opt {pair!r}: expected key=value")
        k, _, v = pair.partition("=")
        options[k.strip()] = v.strip()
    return options
