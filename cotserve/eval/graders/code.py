"""LiveCodeBench: extract the program from the reply and run it against the public tests in the
sandbox (`cotserve.eval.sandbox`). Passing means every test passes (pass@1, as LiveCodeBench
scores it); the first failing test stops the run.

- stdin tests: the program reads the input on stdin; its stdout must equal the expected output
  line by line after trailing whitespace is removed, tokens compared as exact text or, when
  both are numbers, as exact decimals (`1.50` == `1.5`), as LiveCodeBench's checker does.
- functional tests (LeetCode): each input line is one JSON argument; the value returned by
  `Solution().<func_name>(*args)` must equal the JSON-decoded expected output (tuples as lists,
  floats within 1e-9 relative).

A reply cut at max_tokens (finish reason `length`) inside its code block earns nothing (method
`truncated`): the program's end was never written, so the block is not run. A block closed by its
fence before the cut runs as usual.

Programs run as LiveCodeBench's runner runs them: its import prelude (`from math import *`,
`from collections import *`, ... `sys.setrecursionlimit(50000)`) comes first, in stdin and
functional mode alike (`cotserve.eval.sandbox.LCB_PRELUDE`); a stdin program's top-level code is
wrapped in a function as LiveCodeBench wraps it (a top-level `return` works, `sys.exit` of any status
keeps the output); the stack is 8 MiB, as LiveCodeBench's programs get on a stock Linux host."""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from cotserve.eval.graders.base import Grade
from cotserve.eval.sandbox import Limits, run_program

_PY = ("python", "python3", "py")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str) -> str | None:
    """The last fenced code block, preferring blocks marked python/py (an unterminated block at the
    very end, cut off by max_tokens, counts too)."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    py = [b for lang, b in blocks if lang.lower() in _PY]
    code = (py or [b for _, b in blocks])[-1]
    return code if code.strip() else None


def _tokens_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Decimal(a) == Decimal(b)
    except (InvalidOperation, ValueError):
        return False


def stdout_matches(got: str, expected: str) -> bool:
    g = [ln.rstrip() for ln in got.strip().splitlines()]
    e = [ln.rstrip() for ln in expected.strip().splitlines()]
    if g == e:
        return True
    if len(g) != len(e):
        return False
    for gl, el in zip(g, e, strict=True):
        gt, et = gl.split(), el.split()
        if len(gt) != len(et) or not all(_tokens_equal(x, y) for x, y in zip(gt, et, strict=True)):
            return False
    return True


def values_equal(got: Any, expected: Any) -> bool:
    if isinstance(got, float) or isinstance(expected, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=1e-9, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(values_equal(a, b) for a, b in zip(got, expected, strict=True))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return got == expected


def run_tests(code: str, meta: dict[str, Any], limits: Limits | None = None) -> tuple[bool, str]:
    tests = meta.get("tests") or []
    if not tests:
        return False, "no tests"
    for i, t in enumerate(tests):
        if t.get("testtype", "stdin") == "functional":
            name = meta.get("func_name")
            if not name:
                return False, f"test {i}: functional test without func_name"
            try:
                args = [json.loads(line) for line in str(t["input"]).split("\n") if line.strip()]
                expected = json.loads(t["output"])
            except json.JSONDecodeError as exc:
                return False, f"test {i}: cannot parse test case ({exc.msg})"
            r = run_program(code, mode="functional", func_name=name, args=args, limits=limits)
            if r.status != "ok":
                return False, f"test {i}: {r.status}: {_last_line(r.stderr)}"
            if not values_equal(r.value, expected):
                return False, f"test {i}: wrong answer (got {json.dumps(r.value)[:80]})"
        else:
            r = run_program(code, stdin=str(t["input"]), mode="stdin", limits=limits)
            if r.status != "ok":
                return False, f"test {i}: {r.status}: {_last_line(r.stderr)}"
            if not stdout_matches(r.stdout, str(t["output"])):
                return False, f"test {i}: wrong answer"
    return True, f"passed {len(tests)} tests"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _last_block_closed(text: str) -> bool:
    """The block `extract_code` takes ends with its fence (it is not an unterminated tail)."""
    blocks = list(_FENCE.finditer(text))
    py = [b for b in blocks if b.group(1).lower() in _PY]
    last = (py or blocks)[-1]
    return text[: last.end()].endswith("```")


def grade_code(text: str, meta: dict[str, Any], limits: Limits | None = None,
               finish_reason: str | None = None) -> Grade:
    code = extract_code(text)
    if code is None:
        return Grade(False, None, "no code block", "none")
    closed = _last_block_closed(text)
    if finish_reason == "length" and not closed:
        return Grade(False, None, "cut at max_tokens inside the code block", "truncated")
    ok, detail = run_tests(code, meta, limits)
    return Grade(ok, code, detail, "code_block" if closed else "unterminated_block")
