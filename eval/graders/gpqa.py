"""GPQA (and any 4-way multiple choice): the letter the reply commits to.

Phrasings are tried from the most to the least explicit, and within one phrasing the LAST match
wins (a reply may mention options before settling). Each is recorded as the extraction method:

- `boxed`: `\\boxed{C}`;
- `marker`: `Answer: C` / `answer is (C)` / `**Answer:** D` / `Final answer: C`, the letter in
  either case when it stands alone (`answer: c`, not "the answer is a subtle one");
- `phrase`: `correct option/choice is C`, `option C is correct`, `I'll go with D`;
- `option_line`: the reply names one option as a line of its own, `A) text` / `(B) text` /
  `C. text` / a bare `C` - only when a single letter is named that way (a reply that lists the
  options names several and commits to none);
- `parenthesis`: the last `(C)` in the reply.

A reply cut at max_tokens is graded only from `boxed`, `marker` or `phrase`: a list of options or
a parenthesis in text that never finished is not an answer (method `truncated`)."""

from __future__ import annotations

import re

from cotserve.eval.graders.base import Grade

_STRONG = [
    ("boxed", re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{)?\s*\(?([A-Da-d])\)?\s*\}")),
    ("marker", re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:\-]?\s*[*_]*\s*[:\-]?\s*(?:(?i:option|choice)\s*)?"
                          r"[*_]*\(?\[?([A-D])\b")),
    ("marker", re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:\-]?\s*[*_]*\s*[:\-]?\s*(?:(?i:option|choice)\s*)?"
                          r"[*_]*\(?\[?([a-d])(?:\)|\]|[*_]+)?(?=\s*$|\s*[.,;:!]?\s*$|[.,;:!)]\s)", re.M)),
    ("phrase", re.compile(r"(?i:correct|right|best)\s+(?i:option|choice|letter)\s*(?i:is|:|would be)?\s*:?\s*"
                          r"[*_]*\(?([A-D])\b")),
    ("phrase", re.compile(r"(?i:option|choice)\s*\(?([A-D])\)?\s*(?i:is correct|is right|is the answer)")),
    ("phrase", re.compile(r"(?i:I choose|I pick|I select|I'll go with|go with)\s*(?:(?i:option|choice)\s*)?"
                          r"\(?([A-D])\b")),
]
_OPTION_LINE = re.compile(r"(?m)^\s*[*_]*\(?([A-D])(?:[).:][*_]*(?:\s+\S.*)?|[*_]*)\s*$")
_PAREN = re.compile(r"\(([A-D])\)")


def extract_letter_method(text: str, finish_reason: str | None = None) -> tuple[str | None, str]:
    """(letter, method); (None, `truncated` | `none`) when the reply commits to no letter."""
    for method, pat in _STRONG:
        hits = pat.findall(text)
        if hits:
            return hits[-1].upper(), method
    if finish_reason == "length":
        return None, "truncated"
    named = _OPTION_LINE.findall(text)
    if named and len(set(named)) == 1:
        return named[-1], "option_line"
    hits = _PAREN.findall(text)
    if hits:
        return hits[-1], "parenthesis"
    return None, "none"


def extract_letter(text: str, finish_reason: str | None = None) -> str | None:
    return extract_letter_method(text, finish_reason)[0]


def grade_gpqa(text: str, gold: str, finish_reason: str | None = None) -> Grade:
    pred, method = extract_letter_method(text, finish_reason)
    if pred is None:
        detail = "cut at max_tokens before an answer" if method == "truncated" else "no letter found"
        return Grade(False, None, detail, method)
    return Grade(pred == gold.strip().upper(), pred, "", method)
