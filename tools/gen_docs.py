"""Write the generated parts of the documentation.

* `docs/policies/<name>.md`: the option table between the `<!-- options:begin -->` and
  `<!-- options:end -->` markers, built from the policy's typed options model in
  `cotserve/policies/options.py` (name, type, default, range, description), and where the
  policy runs (`Policy.runtimes`).
* `docs/cli.md`: the whole page, from the Typer app (`cotserve.cli.app`).

    python tools/gen_docs.py           # rewrite the generated parts
    python tools/gen_docs.py --check   # exit 1 and name the pages that are out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"
_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^=#]+=[^#]*#\s*(.+)$")


def _own_fields(cls: type) -> list[str]:
    return list(cls.__dict__.get("__annotations__", {}))


def _comment_docs(cls: type) -> dict[str, str]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    own = set(_own_fields(cls))
    docs = {}
    for line in source.splitlines():
        m = _FIELD_LINE.match(line)
        if m and m.group(1) in own:
            docs[m.group(1)] = m.group(2).strip()
    return docs


def _docstring_docs(cls: type) -> dict[str, str]:
    """`name: text` (or `a, b: text`) entries of the class's own docstring."""
    doc = cls.__dict__.get("__doc__") or ""
    names = _own_fields(cls)
    if not doc or not names:
        return {}
    alt = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.`])((?:{alt})(?:,\s*(?:{alt}))*):\s")
    matches = list(pattern.finditer(doc))
    docs = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(doc)
        text = " ".join(doc[m.end():end].split())
        for name in re.split(r",\s*", m.group(1)):
            docs.setdefault(name, text)
    return docs


def field_docs(config_cls: type) -> dict[str, str]:
    """Description of every field of a config dataclass, inherited fields included."""
    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        docs.update(_docstring_docs(cls))
        docs.update(_comment_docs(cls))
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return _model_default(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: Any) -> str:
    args = getattr(annotation, "__args__", None)
    if getattr(annotation, "__origin__", None) is not None and args and all(isinstance(a, str) for a in args):
        return "str"  # a Literal: the choices are in the meaning column
    return getattr(annotation, "__name__", str(annotation))


def _range(info: Any) -> str:
    """`>= 1`, `(0, 1]`, ... from a field's constraints."""
    lo = hi = None
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                lo = (sym, getattr(m, attr))
        for attr, sym in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                hi = (sym, getattr(m, attr))
    args = getattr(info.annotation, "__args__", None)
    if getattr(info.annotation, "__origin__", None) is not None and args and all(isinstance(a, str) for a in args):
        return " \\| ".join(f"`{a}`" for a in args)
    if lo and hi:
        return f"{'[' if lo[0] == '>=' else '('}{lo[1]:g}, {hi[1]:g}{']' if hi[0] == '<=' else ')'}"
    if lo:
        return f"{lo[0]} {lo[1]:g}"
    if hi:
        return f"{hi[0]} {hi[1]:g}"
    return ""


def _model_default(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "`nan`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def options_table(policy_cls: type) -> str:
    """The option table of a policy, from its typed options model (`cotserve/policies/options.py`)."""
    from cotserve.policies.options import POLICIES, RENAMED

    model = POLICIES[policy_cls.name][1]
    if not model.model_fields:
        return f"`{policy_cls.name}` takes no options."
    rows = ["| option | type | default | range | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        rows.append(f"| `{name}` | `{_type_name(info.annotation)}` | {_model_default(info.default)} | "
                    f"{_range(info)} | {_cell(info.description or '')} |")
    renamed = RENAMED.get(policy_cls.name)
    if renamed:
        pairs = ", ".join(f"`{old}` (now `{new}`)" for old, new in sorted(renamed.items()))
        rows.append(f"\nRenamed options, refused with a hint: {pairs}.")
    rows.append(f"\nRuns on: {runtimes_line(policy_cls)}.")
    return "\n".join(rows)


def runtimes_line(policy_cls: type) -> str:
    """Where a policy runs, from its declaration (`Policy.runtimes`)."""
    from cotserve.policies.interface import Runtime

    names = {Runtime.NATIVE_STATIC: "the native engine's static batches",
             Runtime.NATIVE_CONTINUOUS: "its continuous batching", Runtime.VLLM_CPU: "the vLLM engine on CPU",
             Runtime.VLLM_CUDA: "the vLLM engine on CUDA"}
    unknown = sorted(set(policy_cls.runtimes) - set(names))
    if unknown:
        raise SystemExit(f"{policy_cls.name}: runtimes {unknown} have no name in tools/gen_docs.py")
    return ", ".join(label for runtime, label in names.items() if runtime in policy_cls.runtimes)


def undocumented_options() -> list[str]:
    """`policy.option` for every option without a description."""
    from cotserve.policies.options import POLICIES

    return [f"{name}.{field}" for name, (_, model) in POLICIES.items()
            for field, info in model.model_fields.items() if not info.description]


def policy_pages() -> dict[Path, str]:
    """Each policy page with its option table regenerated (pages must exist and hold the markers)."""
    from cotserve.policies.registry import REGISTRY, available

    pages = {}
    for name in available():
        path = DOCS / "policies" / f"{name}.md"
        if not path.is_file():
            raise SystemExit(f"{path.relative_to(ROOT)} is missing: every registered policy has a page")
        text = path.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{path.relative_to(ROOT)} has no {BEGIN} ... {END} block")
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        pages[path] = f"{head}{BEGIN}\n{options_table(REGISTRY[name])}\n{END}{tail}"
    return pages


def _help(text: str | None) -> str:
    return _cell(" ".join((text or "").replace("\\[", "[").split()))


def _param_row(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"| `{param.name.upper()}` (argument) | | {_help(getattr(param, 'help', ''))} |"
    names = " / ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    if param.required:
        default = "(required)"
    elif param.is_flag and param.secondary_opts and param.default is not None:  # None: chosen at run time (the help says how)
        default = f"`{param.opts[0] if param.default else param.secondary_opts[0]}`"
    elif param.default is None or param.default == () or param.default == []:
        default = ""
    else:
        default = f"`{param.default}`"
    if param.envvar:
        envs = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar]
        default += (" " if default else "") + ", ".join(f"`${e}`" for e in envs)
    return f"| {names} | {default} | {_help(param.help)} |"


def _command_sections(cmd: Any, path: str, out: list[str]) -> None:
    params = [p for p in cmd.params if p.name != "help"]
    out.append(f"## `{path}`\n")
    if cmd.help:
        out.append(" ".join(cmd.help.split()) + "\n")
    if params:
        out.append("| option | default | meaning |\n|---|---|---|")
        out.extend(_param_row(p) for p in params)
        out.append("")
    for name in sorted(getattr(cmd, "commands", {})):
        _command_sections(cmd.commands[name], f"{path} {name}", out)


def cli_page() -> str:
    import typer

    from cotserve.cli import app

    out = [
        "# Command-line reference\n",
        "Generated from the Typer app by `python tools/gen_docs.py`; do not edit by hand. "
        "Every command also answers `--help`.\n",
    ]
    _command_sections(typer.main.get_command(app), "cotserve", out)
    return "\n".join(out).rstrip() + "\n"


def generated() -> dict[Path, str]:
    pages = policy_pages()
    pages[DOCS / "cli.md"] = cli_page()
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report out-of-date pages instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated().items():
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(str(path.relative_to(ROOT)))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("out of date (run python tools/gen_docs.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
