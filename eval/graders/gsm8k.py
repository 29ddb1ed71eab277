"""GSM8K: numeric comparison of the model's final number with the reference integer.

The prediction is, in order of preference: the last `\\boxed{}`, the number after the last
`####`, the number after the last "answer is"/"Answer:", else the last number in the reply.
Thousands separators, `$`, `%` and trailing units/periods are ignored; equality is numeric
(`18`, `18.0`, `$18.00` all match `18`)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from cotserve.eval.graders.base import Grade
from cotserve.eval.graders.math import extract_boxed

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?i)(?:answer\s*(?:is|:)|####)\s*:?\s*\**\s*\$?\s*(-?[\d,]*\.?\d+)")


def to_number(text: str) -> Decimal | None:
    """The number a short answer string denotes (`\\$1,234.50`, `\\frac{3}{4}`, `25\\%`), or None."""
    s = text.strip().replace("\\!", "").replace("\\,", "").replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "").replace("dfrac", "frac").replace("\\text{", "{")
    frac = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s.strip())
    if frac:
        try:
            return Decimal(frac.group(1)) / Decimal(frac.group(2))
        except (InvalidOperation, ZeroDivisionError):
            return None
    m = _NUM.search(s)
    if not m:
        return None
    try:
        return Decimal(m.group(0).replace(",", ""))
    except InvalidOperation:
        return None


def extract_number(text: str) -> str | None:
    boxed = extract_boxed(text)
    if boxed is not None and to_number(boxed) is not None:
        return boxed
    hits = _ANSWER_IS.findall(text)
    if hits:
        return hits[-1]
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def grade_gsm8k(text: str, gold: str) -> Grade:
    pred = extract_number(text)
    if pred is None:
        return Grade(False, None, "no number found")
    p, g = to_number(pred), to_number(gold)
    if p is None or g is None:
        return Grade(False, pred, "not a number")
    return Grade(abs(p - g) <= Decimal("1e-6") * max(Decimal(1), abs(g)), pred)
