"""Import rules (docs/architecture.md), checked by walking every module's imports.

Imports inside functions count (they run sooner or later); imports under `if TYPE_CHECKING:` do
not (they never run)."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"cotserve": "cotserve"}
TOOLS = ("cotserve.bench", "cotserve.eval", "cotserve.cli", "cotserve.build_steering",
         "cotserve.sinkrouter_calibration")
# Gateway modules that still load torch, and why; a fix removes its line here (the test checks
# that every line is still needed, so the rule tightens as the code improves).
GATEWAY_TORCH_LEFT: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import that can run."""
    found: list[tuple[str, bool]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, top)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found.append((base, top))
                found.extend((f"{base}.{a.name}", top) for a in child.names if f"{base}.{a.name}" in MODULES)
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


IMPORTS = {m: _imports(p, m) for m, p in MODULES.items()}


def _targets(module: str, top_only: bool = False) -> set[str]:
    return {t for t, top in IMPORTS[module] if top or not top_only}


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_walker_sees_imports():
    assert "torch" in _targets("cotserve.policies.base", top_only=True)
    assert "cotserve.kv.batch" not in _targets("cotserve.policies.base")  # TYPE_CHECKING only
    assert "cotserve.models" in _targets("cotserve.engine.decoder")  # inside a function


def test_no_policy_imports_the_engine_models_or_anything_above():
    bad = []
    for module in MODULES:
        if _under(module, "cotserve.policies"):
            for target in _targets(module):
                if _under(target, "cotserve.engine", "cotserve.models", "cotserve.gateway", "cotserve.queue",
                          "cotserve.worker", *TOOLS):
                    bad.append(f"{module} -> {target}")
    assert not bad, bad


def test_engine_kernels_queue_and_worker_import_nothing_above_them():
    bad = []
    for module in MODULES:
        if _under(module, "cotserve.engine"):
            above = ("cotserve.gateway", "cotserve.queue", "cotserve.worker", *TOOLS)
        elif _under(module, "cotserve.kv"):  # the engines' and policies' contract, below both
            above = ("cotserve.engine", "cotserve.policies", "cotserve.models", "cotserve.gateway",
                     "cotserve.queue", "cotserve.worker", "cotserve.vllm", *TOOLS)
        elif _under(module, "cotserve.kernels"):
            above = ("cotserve.engine", "cotserve.policies", "cotserve.models", "cotserve.gateway",
                     "cotserve.queue", "cotserve.worker", *TOOLS)
        elif _under(module, "cotserve.queue"):
            above = ("cotserve.gateway", "cotserve.worker", "cotserve.engine", "cotserve.policies", *TOOLS)
        elif _under(module, "cotserve.worker"):
            above = ("cotserve.gateway", *TOOLS)
        else:
            continue
        bad += [f"{module} -> {t}" for t in _targets(module) if _under(t, *above)]
    assert not bad, bad


# Token types whose text is code or a literal (comments are free to name anything)
_SPELLED = {tokenize.NAME, tokenize.STRING} | {t for t in (getattr(tokenize, "FSTRING_MIDDLE", None),) if t is not None}


def _spelled(source: str, word: str) -> list[str]:
    """'line: token' for every name or string (docstrings included) of `source` containing `word`,
    any case; comments are left out."""
    return [f"{tok.start[0]}: {tok.string}" for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type in _SPELLED and word in tok.string.lower()]


def test_the_token_check_sees_names_and_strings_but_not_comments():
    assert _spelled("ok = math.isfinite(x)\n", "sfi") == ["1: isfinite"]
    assert _spelled('"""The SFI rows."""\n', "sfi") == ['1: """The SFI rows."""']
    assert _spelled("x = f'{y} sfi'\n", "sfi")
    assert _spelled("x = 1  # SFI's pooled form\n", "sfi") == []


def test_the_engine_never_names_a_policy_of_its_own():
    """The engine asks policies through their hooks (a pooled form: `Policy.pooled_form`): no name
    or string under cotserve/engine spells "sfi", and no engine module imports a module that
    defines a policy (`registry.POLICY_MODULES`; the interface, base, registry and shared
    toolboxes such as `boundaries` are fine)."""
    from cotserve.policies.registry import POLICY_MODULES

    engine = {m: p for m, p in MODULES.items() if _under(m, "cotserve.engine")}
    assert "cotserve.engine.pooled_decode" in engine and "cotserve.policies.sfi" in POLICY_MODULES
    spelled = [f"{p.relative_to(ROOT)}:{hit}" for p in engine.values() for hit in _spelled(p.read_text(), "sfi")]
    assert not spelled, spelled
    named = [f"{m} -> {t}" for m in engine for t, _ in IMPORTS[m] if _under(t, *POLICY_MODULES)]
    assert not named, named
    # imports under TYPE_CHECKING never run, but they name a policy all the same
    typed = [f"{m} -> {name}" for m, p in engine.items() for n in ast.walk(ast.parse(p.read_text()))
             for name in ([n.module or ""] if isinstance(n, ast.ImportFrom) else
                          [a.name for a in n.names] if isinstance(n, ast.Import) else [])
             if _under(name, *POLICY_MODULES)]
    assert not typed, typed


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles: list[str] = []
    state: dict[str, int] = {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node, [node])
    return cycles


def test_no_import_cycle_between_units():
    """Units are cotserve's subpackages and top-level modules (the package root excluded)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for target in _targets(module):
            if target.startswith("cotserve.") and _unit(target) != _unit(module):
                graph[_unit(module)].add(_unit(target))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert not _cycles(graph), _cycles(graph)


def test_no_import_cycle_between_modules():
    graph = {m: {t for t in _targets(m) if t in MODULES and t != m and not m.startswith(t + ".")}
             for m in MODULES}
    assert not _cycles(graph), _cycles(graph)


def _loads_torch_at_import(module: str, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    if module in seen or module not in MODULES:
        return False
    seen.add(module)
    for target in _targets(module, top_only=True):
        if _under(target, "torch", "transformers"):
            return True
        parents = [".".join(target.split(".")[:i]) for i in range(2, target.count(".") + 2)]
        if any(_loads_torch_at_import(t, seen) for t in (*parents, target) if t.startswith("cotserve.")):
            return True
    return False


def test_gateway_imports_no_torch():
    gateway = [m for m in MODULES if _under(m, "cotserve.gateway") and m != "cotserve.gateway"]
    direct = [m for m in gateway if m not in GATEWAY_TORCH_LEFT and any(_under(t, "torch") for t in _targets(m))]
    assert not direct, f"gateway modules importing torch: {direct}"
    clean = [m for m in gateway if m not in GATEWAY_TORCH_LEFT]
    assert not [m for m in clean if _loads_torch_at_import(m)]
    still = [m for m in GATEWAY_TORCH_LEFT if _loads_torch_at_import(m) or any(_under(t, "torch") for t in _targets(m))]
    assert sorted(still) == sorted(GATEWAY_TORCH_LEFT), "fixed: remove it from GATEWAY_TORCH_LEFT"
    # the same, by importing them in a fresh interpreter
    code = f"import sys\nimport {', '.join(clean)}\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_policy_interface_imports_no_torch():
    """`policies/interface.py` (axes, the config base, the hooks' protocol) stays torch-free: the
    engine and every policy import it, and so can a process without torch."""
    mod = "cotserve.policies.interface"
    assert mod in MODULES and not _loads_torch_at_import(mod)
    users = [m for m in MODULES if mod in _targets(m)]
    assert "cotserve.policies.base" in users and "cotserve.engine.continuous" in users
    code = f"import sys\nimport {mod}\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


# -- vLLM: one module holds every import of it and every internal the plugin touches --------------
COMPAT = "cotserve.vllm.compat"
# `._name` accesses under cotserve/vllm on objects cotserve did not define, and why (keep it short)
PRIVATE_ALLOWED: dict[str, str] = {}


def _is_vllm(name: str) -> bool:
    return _under(name, "vllm")


def _defined_names(skip: str) -> set[str]:
    """Every name cotserve defines (functions, classes, assigned names and attributes, arguments),
    except in `skip`: a private name found here is cotserve's own."""
    names: set[str] = set()
    for module, path in MODULES.items():
        if module == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _private_uses(path: Path, own: set[str]) -> list[str]:
    """`x._name` (and getattr/setattr/hasattr with "_name") where cotserve defines no `_name`, and
    any `super()._name` (a base class's private member: a vLLM one under cotserve/vllm)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
            base = node.value
            if (isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
                    and name.startswith("_") and not name.startswith("__")):
                bad.append(f"{path.name}:{node.lineno} super().{name}")
                continue
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        if name and name.startswith("_") and not name.startswith("__") and name not in own:
            bad.append(f"{path.name}:{node.lineno} .{name}")
    return bad


def _string_imports(path: Path) -> list[str]:
    """Modules named in strings, to be imported by name (`importlib.import_module(...)`, a table of
    module paths): every string constant but docstrings that reads as a dotted module path."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and re.fullmatch(r"\w+(\.\w+)+(:\w+)?", n.value)]


def test_only_the_compat_module_imports_vllm():
    assert COMPAT in MODULES
    assert any(_is_vllm(t) for t in _targets(COMPAT))
    bad = [f"{m} -> {t}" for m in MODULES if m != COMPAT for t in _targets(m) if _is_vllm(t)]
    bad += [f"{m} -> {t}" for m, p in MODULES.items() if m != COMPAT for t in _string_imports(p) if _is_vllm(t)]
    assert not bad, f"import vLLM's names from {COMPAT}: {bad}"
    # the compat module loads nothing of vLLM (nor torch) when imported: its imports run in functions
    assert not [t for t in _targets(COMPAT, top_only=True) if _is_vllm(t) or _under(t, "torch")]


def test_no_module_but_compat_touches_vllm_private_names():
    own = _defined_names(skip=COMPAT)
    bad = []
    for module, path in MODULES.items():
        if _under(module, "cotserve.vllm") and module != COMPAT:
            bad += [b for b in _private_uses(path, own) if b not in PRIVATE_ALLOWED]
    assert not bad, f"vLLM internals belong in {COMPAT}: {bad}"
    unused = [k for k in PRIVATE_ALLOWED if not any(k in _private_uses(p, own) for p in MODULES.values())]
    assert not unused, f"no longer needed: remove them from PRIVATE_ALLOWED: {unused}"


def test_the_private_name_check_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("class S(Base):\n    def f(self):\n        self.kv._vllm_private_field = None\n"
                      "        getattr(x, '_vllm_other', None)\n        return super()._preempt_request()\n"
                      "    def g(self):\n        return self._own_thing\n")
    own = {"_own_thing"}
    assert sorted(_private_uses(sample, own)) == ["sample.py:3 ._vllm_private_field", "sample.py:4 ._vllm_other",
                                                 "sample.py:5 super()._preempt_request"]
    sample.write_text('"""vllm.docs only"""\nimport importlib\nimportlib.import_module("vllm.model_executor.models.llama")\n'
                      'CLASSES = {"Q": "vllm.model_executor.models.qwen3"}\n')
    assert [s for s in _string_imports(sample) if _is_vllm(s)] == ["vllm.model_executor.models.llama",
                                                                   "vllm.model_executor.models.qwen3"]


def test_the_kv_contract_imports_nothing_of_cotserve_even_for_types():
    """`cotserve.kv` (BatchState, ModelInfo, KVCache) sits below the engines and the policies: not
    even a type-checking import reaches up, so no circle runs through it."""
    bad = []
    for module, path in MODULES.items():
        if not _under(module, "cotserve.kv"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{module} -> {n}" for n in names if _under(n, "cotserve") and not _under(n, "cotserve.kv")]
    assert "cotserve.kv.batch" in MODULES and not bad, bad
