"""Policy rows of a benchmark: `NAME` or `NAME[key=value,key=value]`, comma-separated.

`--policy "dense,dense[kernel=torch],sfi,sfi[dense_heads=0.08]"` compares four rows; a row's own
options (in brackets) apply on top of the run's `--policy-opt` / `--policy-file` options and
are reported with the row, so two rows of one policy can differ in one knob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import PolicyError


@dataclass
class RowSpec:
    label: str  # as given, e.g. "sfi[dense_heads=0.08]"
    policy: str  # the policy spec, e.g. "sfi" or "skipkv+steering"
    options: dict[str, Any] = field(default_factory=dict)


def split_rows(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise PolicyError(f"--policy {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise PolicyError(f"--policy {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_row(text: str) -> RowSpec:
    if "[" not in text:
        return RowSpec(text, text)
    name, _, rest = text.partition("[")
    if not rest.endswith("]") or not name.strip():
        raise PolicyError(f"policy row {text!r}: expected NAME[key=value,...]")
    options: dict[str, Any] = {}
    for pair in rest[:-1].split(","):
        if not pair.strip():
            continue
        if "=" not in pair:
            raise PolicyError(f"policy row {text!r}: {pair!r} is not key=value")
        k, _, v = pair.partition("=")
        options[k.strip()] = v.strip()
    return RowSpec(text, name.strip(), options)


def parse_rows(text: str | list[str]) -> list[RowSpec]:
    items = split_rows(text) if isinstance(text, str) else [t for item in text for t in split_rows(item)]
    return [parse_row(t) for t in items]
