"""GPQA (and any 4-way multiple choice): the letter the reply commits to.

Phrasings are tried from the most to the least explicit, and within one phrasing the LAST match
wins (a reply may mention options before settling): `\\boxed{C}`; `Answer: C` / `answer is (C)` /
`**Answer:** C`; `correct option/choice is C`; `option C` / `choice C`; a last line that is only a
letter (`C`, `(C)`, `C.`); else the last `(C)`."""

from __future__ import annotations

import re

from cotserve.eval.graders.base import Grade

_PATTERNS = [
    re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*\(?([A-D])\)?"),
    re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:\-]?\s*[*_]*\s*[:\-]?\s*(?:(?i:option|choice)\s*)?[*_]*\(?\[?([A-D])\b"),
    re.compile(r"(?i:correct|right|best)\s+(?i:option|choice|letter)\s*(?i:is|:|would be)?\s*:?\s*[*_]*\(?([A-D])\b"),
    re.compile(r"(?i:option|choice)\s*\(?([A-D])\)?\s*(?i:is correct|is right|is the answer)"),
    re.compile(r"(?i:I choose|I pick|I select|I'll go with|go with)\s*(?:(?i:option|choice)\s*)?\(?([A-D])\b"),
    re.compile(r"(?m)^\s*[*_]*\(?([A-D])\)?[.:)]?[*_]*\s*$"),
    re.compile(r"\(([A-D])\)"),
]


def extract_letter(text: str) -> str | None:
    for pat in _PATTERNS:
        hits = pat.findall(text)
        if hits:
            return hits[-1].upper()
    return None


def grade_gpqa(text: str, gold: str) -> Grade:
    pred = extract_letter(text)
    if pred is None:
        return Grade(False, None, "no letter found")
    return Grade(pred == gold.strip().upper(), pred)
