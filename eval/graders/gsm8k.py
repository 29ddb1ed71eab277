"""GSM8K (and any integer/decimal answer): the reply's final answer compared with the reference.

The answer is read only where the reply states it (`cotserve.eval.graders.final`): a box, a
final-answer marker, or the last line of a reply that ended by itself; a reply cut at max_tokens
without one scores 0. The stated answer is judged whole: a single number (thousands separators,
`$`, `%` and trailing units ignored) is compared numerically (`18`, `18.0`, `$18.00` all match
`18`); anything else (`5+13=18`, `20 * 3`) is parsed and checked by math-verify as one
expression (`5+13=18` -> 18, `20 * 3` -> 60), never by its first or last number."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from cotserve.eval.graders.base import Grade
from cotserve.eval.graders.final import find_final

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_OPS = re.compile(r"=|\d\s*[-+*/\u00d7\u00f7^x]\s*\(?-?\d|\\times|\\div|\\cdot|\\frac")


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


def single_number(text: str) -> Decimal | None:
    """The number when `text` states exactly one and no calculation (`$1,234.50 total`), else None."""
    s = text.replace("\\!", "").replace("\\,", "").replace("\\$", "$").replace("\\%", "%")
    if _OPS.search(s):
        return None
    nums = _NUM.findall(s)
    if len(nums) != 1:
        return None
    try:
        return Decimal(nums[0].replace(",", ""))
    except InvalidOperation:
        return None


def number_equal(pred: str, gold: str) -> tuple[bool, str]:
    """(equal, how): a single number numerically, else the whole expression by math-verify."""
    g = to_number(gold)
    p = single_number(pred)
    if p is not None and g is not None:
        return abs(p - g) <= Decimal("1e-6") * max(Decimal(1), abs(g)), "number"
    from cotserve.eval.graders.math import math_equal

    return math_equal(gold, pred), "math-verify"


def extract_number(text: str, finish_reason: str | None = None) -> str | None:
    """The stated final answer (see the module doc), or None."""
    return find_final(text, finish_reason).text


def grade_gsm8k(text: str, gold: str, finish_reason: str | None = None) -> Grade:
    fin = find_final(text, finish_reason)
    if fin.text is None:
        detail = "cut at max_tokens before a final answer" if fin.method == "truncated" else "no final answer"
        return Grade(False, None, detail, fin.method)
    if fin.method == "last_line" and not _NUM.search(fin.text):
        return Grade(False, None, "no final answer", "none")
    ok, how = number_equal(fin.text, gold)
    return Grade(ok, fin.text, how, fin.method)
