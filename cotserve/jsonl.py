"""The one JSONL reader (one JSON object per line), torch-free.

Every JSONL file cotserve reads goes through `read_jsonl` / `numbered_jsonl`: the eval suites
(`eval/loaders.py`), the eval run log `predictions.jsonl` (`eval/runner.py`), the problems of
`build-steering`, the bench prompt text and the vLLM plugin's telemetry file.

* blank lines are skipped (`skip_blank`, the default);
* `torn_tail=True`: a last line that does not parse and has no newline (a write the process did not
  finish, e.g. a run killed mid-line) is ignored; `close_last_line` removes it from the file before
  more lines are appended;
* any other line that is not a JSON object raises a `CotserveError` naming the file and the line.

Rows are read lazily, so a caller may stop early.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError


def numbered_jsonl(path: str | Path, *, skip_blank: bool = True, torn_tail: bool = False,
                   start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each line of `path`, from byte offset `start` (line numbers
    count from there, 1-based). See the module docstring for the options."""
    with open(path, "rb") as f:
        if start:
            f.seek(start)
        for n, raw in enumerate(f, 1):
            if skip_blank and not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if torn_tail and not raw.endswith(b"\n"):
                    return  # only the last line can lack its newline
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
                raise CotserveError(f"{path}:{n}: not valid JSON ({why})") from None
            if not isinstance(row, dict):
                raise CotserveError(f"{path}:{n}: expected a JSON object per line")
            yield n, row


def read_jsonl(path: str | Path, *, skip_blank: bool = True, torn_tail: bool = False,
               start: int = 0) -> Iterator[dict[str, Any]]:
    """The objects of `path`, one per line (`numbered_jsonl` without the line numbers)."""
    for _, row in numbered_jsonl(path, skip_blank=skip_blank, torn_tail=torn_tail, start=start):
        yield row


def close_last_line(path: str | Path) -> bool:
    """Make `path` end at a line end before lines are appended: a last line without its newline is
    kept (the newline added) when it is a JSON object, and cut off otherwise (an unfinished write).
    Returns True when a line was cut off."""
    size = os.path.getsize(path)
    if size == 0:
        return False
    with open(path, "rb+") as f:
        pos = start = size
        while pos > 0:  # find the start of the last line, reading backwards
            lo = max(0, pos - (1 << 16))
            f.seek(lo)
            chunk = f.read(pos - lo)
            if lo + len(chunk) == size and chunk.endswith(b"\n"):
                return False
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                start = lo + nl + 1
                break
            pos = start = lo
        f.seek(start)
        try:
            whole = isinstance(json.loads(f.read().decode("utf-8")), dict)
        except (UnicodeDecodeError, json.JSONDecodeError):
            whole = False
        if whole:
            f.seek(size)
            f.write(b"\n")
        else:
            f.truncate(start)
        return not whole
