"""The result of grading one reply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Grade:
    correct: bool
    extracted: str | None  # what the grader took as the model's answer (None: nothing found)
    detail: str = ""  # e.g. the failing test or the sandbox's verdict
    method: str = ""  # how the answer was found (boxed, marker, last_line, ...; truncated / none: nothing taken)
