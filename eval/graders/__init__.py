"""Graders: one per item kind. `grade(item, text)` -> `Grade`."""

from __future__ import annotations

from cotserve.eval.graders.base import Grade
from cotserve.eval.loaders import Item

GRADER_VERSION = "1"


def grade(item: Item, text: str, code_limits=None, finish_reason: str | None = None) -> Grade:
    """Grade a model reply (the answer part; reasoning may be included, graders look at the end)."""
    if item.kind == "math":
        from cotserve.eval.graders.math import grade_math

        return grade_math(text, item.answer)
    if item.kind == "gsm8k":
        from cotserve.eval.graders.gsm8k import grade_gsm8k

        return grade_gsm8k(text, item.answer)
    if item.kind == "gpqa":
        from cotserve.eval.graders.gpqa import grade_gpqa

        return grade_gpqa(text, item.answer)
    if item.kind == "code":
        from cotserve.eval.graders.code import grade_code

        return grade_code(text, item.meta, limits=code_limits)
    if item.kind == "exact":
        from cotserve.eval.graders.math import extract_boxed

        pred = extract_boxed(text)
        pred = pred if pred is not None else text.strip().splitlines()[-1] if text.strip() else ""
        return Grade(" ".join(pred.split()) == " ".join(item.answer.split()), pred)
    raise ValueError(f"no grader for kind {item.kind!r}")


__all__ = ["GRADER_VERSION", "Grade", "grade"]
