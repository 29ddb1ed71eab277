"""Graders: one per item kind. `grade(item, text)` -> `Grade`."""

from __future__ import annotations

from cotserve.eval.graders.base import Grade
from cotserve.eval.loaders import Item

# Stored with every graded reply; replies graded by another version are graded again from their
# stored text when a run is resumed (no new generation).
GRADER_VERSION = "4"


def grade(item: Item, text: str, code_limits=None, finish_reason: str | None = None) -> Grade:
    """Grade a model reply (the answer part; reasoning may be included, graders look at the end).
    `finish_reason` "length" (cut at max_tokens) makes graders refuse an answer that was not
    complete before the cut (see `cotserve.eval.graders.final`)."""
    if item.kind == "math":
        from cotserve.eval.graders.math import grade_math

        return grade_math(text, item.answer, finish_reason)
    if item.kind == "gsm8k":
        from cotserve.eval.graders.gsm8k import grade_gsm8k

        return grade_gsm8k(text, item.answer, finish_reason)
    if item.kind == "gpqa":
        from cotserve.eval.graders.gpqa import grade_gpqa

        return grade_gpqa(text, item.answer, finish_reason)
    if item.kind == "code":
        from cotserve.eval.graders.code import grade_code

        return grade_code(text, item.meta, limits=code_limits, finish_reason=finish_reason)
    if item.kind == "exact":
        from cotserve.eval.graders.final import find_final

        fin = find_final(text, finish_reason)
        if fin.text is None:
            return Grade(False, None, "no final answer", fin.method)
        return Grade(" ".join(fin.text.split()) == " ".join(item.answer.split()), fin.text, "", fin.method)
    raise ValueError(f"no grader for kind {item.kind!r}")


__all__ = ["GRADER_VERSION", "Grade", "grade"]
