"""Benchmark loaders: local JSONL files (the data directory), Hugging Face datasets, custom JSONL.

Every loader yields `Item`s in one schema, whatever the source, so prompts and graders never see
where an item came from. Local files are the ones described in the data directory's SOURCES.md;
the Hugging Face names are the usual public copies of the same benchmarks (loaded lazily with the
`datasets` library, only when `--data-source hf` asks for them and a network is there).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError
from cotserve.jsonl import numbered_jsonl, read_jsonl

LETTERS = "ABCD"


@dataclass
class Item:
    """One benchmark problem.

    kind: which prompt and grader apply (math, gsm8k, gpqa, code, exact).
    question: the problem text (for gpqa without the choices; for code the statement).
    answer: the reference (LaTeX/number string, a letter for gpqa, unused for code).
    meta: kind-specific extras (gpqa `choices`; code `starter_code`, `tests`, `func_name`)."""

    suite: str
    id: str
    kind: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    kind: str
    file: str  # in the data directory
    hf: tuple[str, str | None, str]  # (dataset name, config, split)
    from_row: Callable[[dict[str, Any], int, str], Item]


# -- row converters (local schema; HF rows are first mapped onto it) -------------------------------

def gsm8k_final(answer: str) -> str:
    """GSM8K's reference: the text after the last `####`, thousands separators removed."""
    tail = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return tail.strip().replace(",", "")


def _gsm8k(row: dict[str, Any], idx: int, suite: str) -> Item:
    final = row.get("final_answer") or gsm8k_final(str(row["answer"]))
    return Item(suite, str(row.get("id", f"gsm8k-test-{idx}")), "gsm8k", str(row["question"]), str(final))


def _math(row: dict[str, Any], idx: int, suite: str) -> Item:
    rid = row.get("unique_id") or row.get("id") or f"{suite}-{idx}"
    meta = {k: row[k] for k in ("subject", "level") if k in row}
    return Item(suite, str(rid), "math", str(row["problem"]), str(row["answer"]).strip(), meta)


def _aime(row: dict[str, Any], idx: int, suite: str) -> Item:
    answer = str(row["answer"]).strip()
    if answer.isdigit():
        answer = str(int(answer))  # "025" -> "25"
    return Item(suite, str(row.get("id", f"{suite}-{idx}")), "math", str(row["problem"]), answer)


def shuffle_choices(correct: str, incorrect: list[str], key: str) -> tuple[list[str], int]:
    """A fixed shuffle of the four options seeded by sha256(key), so the correct one moves around
    but every run (and every policy) sees the same order."""
    options = [correct, *incorrect]
    order = list(range(4))
    random.Random(int(hashlib.sha256(key.encode()).hexdigest(), 16)).shuffle(order)
    choices = [options[i] for i in order]
    return choices, order.index(0)


def _gpqa(row: dict[str, Any], idx: int, suite: str) -> Item:
    rid = str(row.get("id") or row.get("Record ID") or f"{suite}-{idx}")
    if "choices" in row and "answer_index" in row:
        choices = [str(c).strip() for c in row["choices"]]
        ans = int(row["answer_index"])
        question = str(row["question"])
    else:  # the original column names (HF Idavidrein/gpqa, simple-evals CSV)
        correct = str(row["Correct Answer"]).strip()
        incorrect = [str(row[f"Incorrect Answer {i}"]).strip() for i in (1, 2, 3)]
        choices, ans = shuffle_choices(correct, incorrect, rid)
        question = str(row["Question"])
    if len(choices) != 4:
        raise CotserveError(f"gpqa item {rid}: expected 4 choices, got {len(choices)}")
    return Item(suite, rid, "gpqa", question.strip(), LETTERS[ans], {"choices": choices})


def _maybe_json(value: Any) -> Any:
    """HF LiveCodeBench stores tests and metadata as JSON strings; the local file as objects."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


def _lcb(row: dict[str, Any], idx: int, suite: str) -> Item:
    tests = _maybe_json(row.get("public_test_cases")) or []
    meta_raw = _maybe_json(row.get("metadata")) or {}
    starter = str(row.get("starter_code") or "")
    meta = {
        "starter_code": starter,
        "tests": [{"input": t["input"], "output": t["output"], "testtype": t.get("testtype", "stdin")} for t in tests],
        "func_name": meta_raw.get("func_name"),
        "platform": row.get("platform"),
        "difficulty": row.get("difficulty"),
        "title": row.get("question_title"),
        "contest_date": row.get("contest_date"),
    }
    rid = str(row.get("question_id", f"{suite}-{idx}"))
    return Item(suite, rid, "code", str(row["question_content"]), "", meta)


SUITES: dict[str, SuiteSpec] = {
    "gsm8k": SuiteSpec("gsm8k", "gsm8k", "gsm8k_test.jsonl", ("openai/gsm8k", "main", "test"), _gsm8k),
    "math500": SuiteSpec("math500", "math", "math500_test.jsonl", ("HuggingFaceH4/MATH-500", None, "test"), _math),
    "aime24": SuiteSpec("aime24", "math", "aime2024.jsonl", ("HuggingFaceH4/aime_2024", None, "train"), _aime),
    "aime25": SuiteSpec("aime25", "math", "aime2025.jsonl", ("math-ai/aime25", None, "test"), _aime),
    "gpqa": SuiteSpec("gpqa", "gpqa", "gpqa_diamond.jsonl", ("Idavidrein/gpqa", "gpqa_diamond", "train"), _gpqa),
    "livecodebench": SuiteSpec(
        "livecodebench", "code", "livecodebench_v1_public.jsonl",
        ("livecodebench/code_generation_lite", "release_v1", "test"), _lcb,
    ),
}
ALIASES = {"math-500": "math500", "aime": "aime24", "aime2024": "aime24", "aime2025": "aime25", "gpqa_diamond": "gpqa",
           "gpqa-diamond": "gpqa", "lcb": "livecodebench"}
KINDS = ("math", "gsm8k", "gpqa", "code", "exact")


# -- readers --------------------------------------------------------------------------------------

def load_hf_rows(name: str, config: str | None, split: str) -> Iterable[dict[str, Any]]:
    """Rows of a Hugging Face dataset (needs the `datasets` package and a network or HF cache)."""
    try:
        import datasets  # noqa: PLC0415 - optional, heavy
    except ImportError:
        raise CotserveError("--data-source hf needs the `datasets` package (pip install datasets)") from None
    try:
        if name == "livecodebench/code_generation_lite":
            # a script dataset, which `datasets` >= 4 no longer runs: read its release file directly
            # (release_v1 is test.jsonl, v2 adds test2.jsonl, ...)
            files = {"release_v1": "test.jsonl"}
            url = f"hf://datasets/{name}/{files.get(config or 'release_v1', 'test.jsonl')}"
            ds = datasets.load_dataset("json", data_files=url, split="train")
        elif config:
            ds = datasets.load_dataset(name, config, split=split)
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as exc:  # network, auth (GPQA is gated), missing cache: one clear line
        raise CotserveError(f"cannot load Hugging Face dataset {name} ({config or 'default'}, {split}): {exc}") from None
    return (dict(r) for r in ds)


@dataclass(frozen=True)
class SuiteRef:
    """A parsed `--suite` entry: a known suite or `custom:PATH[:QUESTION[:ANSWER[:KIND[:ID]]]]`."""

    name: str
    spec: SuiteSpec | None = None
    path: Path | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    kind: str = "math"
    id_field: str = "id"


def parse_suites(text: str) -> list[SuiteRef]:
    refs: list[SuiteRef] = []
    for raw in [s.strip() for s in text.split(",") if s.strip()]:
        if raw.startswith("custom:"):
            parts = raw.split(":")[1:]
            if not parts or not parts[0]:
                raise CotserveError(f"--suite {raw!r}: expected custom:PATH[:QUESTION[:ANSWER[:KIND[:ID]]]]")
            path = Path(parts[0]).expanduser()
            fields = parts[1:] + [""] * 4
            q, a, kind, idf = (fields[0] or "question", fields[1] or "answer", fields[2] or "math", fields[3] or "id")
            if kind not in KINDS:
                raise CotserveError(f"--suite {raw!r}: grader kind {kind!r} unknown (one of {', '.join(KINDS)})")
            refs.append(SuiteRef(f"custom:{path.stem}", None, path, q, a, kind, idf))
            continue
        key = ALIASES.get(raw.lower(), raw.lower())
        if key not in SUITES:
            raise CotserveError(f"unknown suite {raw!r} (known: {', '.join(SUITES)}, or custom:PATH:QUESTION:ANSWER)")
        refs.append(SuiteRef(key, SUITES[key]))
    if not refs:
        raise CotserveError("no suite given (--suite gsm8k,math500,...)")
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise CotserveError(f"--suite lists a suite twice: {','.join(names)}")
    return refs


@dataclass(frozen=True)
class DateWindow:
    """`--date-from` / `--date-to` (YYYY-MM-DD, both inclusive): LiveCodeBench problems whose
    `contest_date` falls inside; a problem without a date is outside any window."""

    start: str | None = None
    end: str | None = None

    def __bool__(self) -> bool:
        return self.start is not None or self.end is not None

    def holds(self, date: Any) -> bool:
        day = str(date or "")[:10]
        if not _DAY.fullmatch(day):
            return False
        return (self.start is None or day >= self.start) and (self.end is None or day <= self.end)

    def describe(self) -> str:
        return f"{self.start or '...'} to {self.end or '...'}"


_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def parse_window(date_from: str | None, date_to: str | None) -> DateWindow:
    import datetime as dt

    for flag, value in (("--date-from", date_from), ("--date-to", date_to)):
        if value is None:
            continue
        try:
            dt.date.fromisoformat(value)
        except ValueError:
            raise CotserveError(f"{flag} {value!r}: expected a date YYYY-MM-DD") from None
        if not _DAY.fullmatch(value):
            raise CotserveError(f"{flag} {value!r}: expected a date YYYY-MM-DD")
    if date_from and date_to and date_from > date_to:
        raise CotserveError(f"--date-from {date_from} is after --date-to {date_to}")
    return DateWindow(date_from, date_to)


def load_suite(ref: SuiteRef, data_dir: Path | None, source: str = "local", limit: int | None = None,
               window: DateWindow | None = None) -> list[Item]:
    """Items of one suite, in file order; `window` keeps the code problems of a contest-date
    window (other kinds are not dated and are kept whole), then `limit` keeps the first N.

    source: `local` (the data directory), `hf` (Hugging Face), or `auto` (local when the file is
    there, else hf)."""
    dated = bool(window) and (ref.spec.kind if ref.spec is not None else ref.kind) == "code"
    if ref.spec is None:
        items = _load_custom(ref)
        if dated:
            items = [it for it in items if window.holds(it.meta.get("contest_date"))]
    else:
        spec = ref.spec
        path = data_dir / spec.file if data_dir is not None else None
        use_local = source == "local" or (source == "auto" and path is not None and path.is_file())
        if use_local:
            if path is None or not path.is_file():
                raise CotserveError(f"suite {spec.name}: {spec.file} not found in the data directory "
                                    f"({data_dir}){_what(spec)}; pass --data-dir or use --data-source hf")
            rows: Iterable[dict[str, Any]] = read_jsonl(path)
        elif source in ("hf", "auto"):
            rows = (_from_hf(spec.name, r) for r in load_hf_rows(*spec.hf))
        else:
            raise CotserveError(f"--data-source {source!r}: expected local, hf or auto")
        items = []
        for i, row in enumerate(rows):
            if limit is not None and len(items) >= limit:
                break
            try:
                item = spec.from_row(row, i, spec.name)
            except (KeyError, TypeError, ValueError, SyntaxError) as exc:
                raise CotserveError(f"suite {spec.name}: row {i} does not match the expected fields ({exc})") from None
            if not dated or window.holds(item.meta.get("contest_date")):
                items.append(item)
    if limit is not None:
        items = items[:limit]
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise CotserveError(f"suite {ref.name}: item ids are not unique")
    return items


def check_suite(ref: SuiteRef, data_dir: Path | None, source: str = "local") -> None:
    """The cheap checks of `load_suite` (the file is there), run before a model is loaded."""
    if ref.spec is None:
        assert ref.path is not None
        if not ref.path.is_file():
            raise CotserveError(f"custom suite file {ref.path} does not exist")
        return
    if source == "local":
        path = data_dir / ref.spec.file if data_dir is not None else None
        if path is None or not path.is_file():
            raise CotserveError(f"suite {ref.spec.name}: {ref.spec.file} not found in the data directory "
                                f"({data_dir}){_what(ref.spec)}; pass --data-dir or use --data-source hf")


_FILE_ABOUT = {
    "aime25": " (AIME 2025 I and II as JSONL, one problem a line with `id`, `problem` and `answer`, "
              "as aime2024.jsonl)",
}


def _what(spec: SuiteSpec) -> str:
    """What the missing file should hold, for suites whose file is not in every data directory."""
    return _FILE_ABOUT.get(spec.name, "")


def _from_hf(suite: str, row: dict[str, Any]) -> dict[str, Any]:
    """Map a Hugging Face row onto the local schema where the names differ."""
    if suite in ("aime24", "aime25") and "problem" not in row and "Problem" in row:
        row = {"id": row.get("ID"), "problem": row["Problem"], "answer": row["Answer"]}
    return row


def _load_custom(ref: SuiteRef) -> list[Item]:
    assert ref.path is not None
    if not ref.path.is_file():
        raise CotserveError(f"custom suite file {ref.path} does not exist")
    items = []
    for i, (line, row) in enumerate(numbered_jsonl(ref.path)):
        needed = (ref.question_field,) if ref.kind == "code" else (ref.question_field, ref.answer_field)
        for fld in needed:  # code items are judged by their tests: no answer field
            if fld not in row:
                raise CotserveError(f"{ref.path}: line {line} has no field {fld!r} (fields: {', '.join(row)})")
        answer = row.get(ref.answer_field, "")
        rid = str(row.get(ref.id_field, i))
        if ref.kind == "gsm8k":
            answer = gsm8k_final(str(answer))
        meta: dict[str, Any] = {}
        if ref.kind == "gpqa":
            choices = row.get("choices")
            if not isinstance(choices, list) or len(choices) != 4:
                raise CotserveError(f"{ref.path}: line {i + 1}: a gpqa-kind item needs a `choices` list of 4")
            meta["choices"] = [str(c) for c in choices]
            answer = _letter_of(answer, meta["choices"])
        if ref.kind == "code":
            meta = {"starter_code": row.get("starter_code", ""), "tests": row.get("tests", []),
                    "func_name": row.get("func_name"), "contest_date": row.get("contest_date")}
        items.append(Item(ref.name, rid, ref.kind, str(row[ref.question_field]), str(answer), meta))
    return items


def _letter_of(answer: Any, choices: list[str]) -> str:
    if isinstance(answer, int) and 0 <= answer < 4:
        return LETTERS[answer]
    text = str(answer).strip()
    if re.fullmatch(r"[A-Da-d]", text):
        return text.upper()
    if text in choices:
        return LETTERS[choices.index(text)]
    raise CotserveError(f"gpqa-kind answer {text!r} is neither a letter A-D, an index 0-3, nor one of the choices")
