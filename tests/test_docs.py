"""The documentation: links resolve, generated parts are current, the README stays short, and the
repository speaks of the product only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# Pages written alongside this one; a link to them may exist before the page does.
PENDING = {
    "docs/operations.md", "docs/eval-grading.md", "docs/api-agents.md", "docs/scheduling.md",
    "docs/policies-paper-fidelity.md", "docs/vllm.md",
}
PENDING_PATTERNS = [re.compile(r"docs/results/2026-11-30-[^/]+\.md")]


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line and (ROOT / line).is_file()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _markdown_files() -> list[Path]:
    return [p for p in _tracked("*.md") if "/.venv/" not in str(p)]


def test_markdown_links_resolve():
    broken = []
    files = _markdown_files()
    assert ROOT / "README.md" in files and len(files) > 10
    for md in files:
        in_code = False
        for n, line in enumerate(md.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http(s), mailto
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (md.parent / file_part).resolve() if file_part else md
                rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
                where = f"{md.relative_to(ROOT)}:{n}: {target}"
                if not dest.is_relative_to(ROOT):
                    broken.append(f"{where} (outside the repository)")
                elif not dest.exists():
                    if rel in PENDING or any(p.fullmatch(rel) for p in PENDING_PATTERNS):
                        continue
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short_and_points_at_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in ("docs/architecture.md", "docs/api.md", "docs/configuration.md", "docs/deployment.md",
                 "docs/eval.md", "docs/benchmarks.md", "docs/cli.md", "docs/engine.md"):
        assert page in text or page.removeprefix("docs/") in (ROOT / "docs/index.md").read_text(), page


def test_every_policy_has_a_page_with_a_current_option_table(load_tool):
    gen = load_tool("gen_docs")
    stale = [str(p.relative_to(ROOT)) for p, text in gen.policy_pages().items() if p.read_text() != text]
    assert not stale, f"run python tools/gen_docs.py: {stale}"
    assert gen.undocumented_options() == [], "describe these options in their config class"


def test_cli_reference_is_current(load_tool):
    gen = load_tool("gen_docs")
    assert (ROOT / "docs/cli.md").read_text() == gen.cli_page(), "run python tools/gen_docs.py"


def test_option_docs_come_from_the_config_class(load_tool):
    """A description is read from a field's comment or its class docstring, never invented."""
    from dataclasses import dataclass

    from cotserve.policies.base import PolicyConfig

    gen = load_tool("gen_docs")

    @dataclass
    class Demo(PolicyConfig):
        """alpha, beta: shared text. gamma: its own text."""

        alpha: int = 1
        beta: float = 0.5
        gamma: str = "x"
        delta: bool = True  # a comment wins

    docs = gen.field_docs(Demo)
    assert docs == {"alpha": "shared text.", "beta": "shared text.", "gamma": "its own text.",
                    "delta": "a comment wins"}


# Development-process words that belong in a tracker, not in the product. Built from parts so
# that this file does not match itself.
_WORDS = [
    "done" + r"[- ]when", "scratch" + " script", "issue" + r" ?#?[0-9]", "the " + "issue",
    r"(this|previous|next|earlier|development|later) " + "session", "lab " + "note",
    r"\b[0-2]?[0-9]:[0-5][0-9](-[0-2]?[0-9]:[0-5][0-9])? " + "UTC",
]
TRACKER = re.compile("|".join(f"(?:{w})" for w in _WORDS), re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cpp", ".yml", ".yaml", ".txt", ".cfg", ".sh", ""}


# (the examples are assembled from pieces, so this file itself never spells the words out)
@pytest.mark.parametrize("pattern", [
    "Done" + "-when", "done" + " when", "a scratch" + " script", "issue" + " 3", "issue" + " #21",
    "THE" + " ISSUE", "this" + " session", "the previous" + " session's code", "22:53" + " UTC",
    "14:22-14:35" + " UTC",
])
def test_tracker_pattern_catches(pattern):
    assert TRACKER.search(pattern)


@pytest.mark.parametrize("fine", ['@pytest.fixture(scope="session")', "an HTTP session", "requests.Session()",
                                  "issues a request"])
def test_tracker_pattern_allows(fine):
    assert not TRACKER.search(fine)


def test_repository_speaks_of_the_product_only():
    hits = []
    for path in _tracked():
        if path.suffix not in TEXT_SUFFIXES or path.name == "LICENSE" or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if TRACKER.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "development-process words:\n" + "\n".join(hits)
