"""GSM8K (and any integer/decimal answer): the reply's final answer compared with the reference.

The answer is read only where the reply states it (`cotserve.eval.graders.final`): a box, a
final-answer marker, or the last line of a reply that ended by itself; a reply cut at max_tokens
without one scores 0. The stated answer is judged whole: a single number (thousands separators,
`$`, `%` and trailing units ignored) is compared numerically (`18`, `18.0`, `$18.00` all match
`18`; a sign is never dropped: `-$5` is -5, and so are `- 5` (no number before the minus, as
math-verify reads `\\boxed{- 5}`), `negative 5` and `minus 5`); anything else (`5+13=18`, `20 * 3`)
is parsed and checked by math-verify as one expression (`5+13=18` -> 18, `20 * 3` -> 60), never by
its first or last number. A boxed or marked answer with more than one number and words (`3 \\text{ hours and }
20 \\text{ minutes}`, `18 and then 2 more`) is not a number and is never correct: it is not the
number 3, nor 18."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from cotserve.eval.graders.base import Grade
from cotserve.eval.graders.final import find_final

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_OPS = re.compile(r"=|\d\s*[-+*/\u00d7\u00f7^x]\s*\(?-?\d|\\times|\\div|\\cdot|\\frac")
# a sign written before a currency symbol (`-$5`, `\\$-5` is already plain): the sign moves next to the digits
_SIGNED_CURRENCY = re.compile(r"([-\u2212+])\s*(?:\\?\$|\u20ac|\u00a3|\u00a5|USD\s*)\s*(?=[\d.])")
_WORD = re.compile(r"[A-Za-z]{2,}")
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
# a sign in words or spaced from its digits (`negative 18`, `minus 18`, `\\boxed{- 18}`)
_SIGN_WORD = re.compile(r"(?i)\b(?:negative|minus)\s+(?=\\?\$?\s*\.?\d)")
_SPACED_MINUS = re.compile(r"-\s+(?=\.?\d)")


def _after_operand(s: str, pos: int) -> bool:
    """A number or a closing bracket comes before `pos` (spaces aside): a minus there subtracts."""
    before = s[:pos].rstrip()[-1:]
    return bool(before) and (before.isdigit() or before in ")]}%")


def _sign_word(m: re.Match[str]) -> str:
    if m.group(0)[0] in "mM" and _after_operand(m.string, m.start()):
        return "- "  # `20 minus 2`: a subtraction
    return "-"  # `negative 18`, `with minus 18`: the sign of the number


def _plain(text: str) -> str:
    """Spacing macros out, the minus sign as `-`, a sign in words (`negative 18`) or spaced from its
    digits (`- 18`, where no number comes before it) next to them, and a sign before a currency
    symbol next to its digits."""
    s = text.replace("\\!", "").replace("\\,", "").replace("\u2212", "-")
    s = _SIGN_WORD.sub(_sign_word, s)
    s = _SPACED_MINUS.sub(lambda m: m.group(0) if _after_operand(m.string, m.start()) else "-", s)
    return _SIGNED_CURRENCY.sub(lambda m: "-" if m.group(1) != "+" else "", s)


def worded_numbers(text: str) -> bool:
    """More than one number and words besides (`3 \\text{ hours and } 20 \\text{ minutes}`): a
    phrase, not one value."""
    s = _plain(text)
    return len(_NUM.findall(s)) > 1 and bool(_WORD.search(_LATEX_CMD.sub(" ", s).replace("{", " ")))


def to_number(text: str) -> Decimal | None:
    """The number a short answer string denotes (`\\$1,234.50`, `\\frac{3}{4}`, `25\\%`), or None."""
    s = _plain(text.strip()).replace("\\$", "").replace("$", "")
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
    s = _plain(text).replace("\\$", "$").replace("\\%", "%")
    if _OPS.search(s):
        return None
    nums = _NUM.findall(s)
    if len(nums) != 1:
        return None
    try:
        return Decimal(nums[0].replace(",", ""))
    except InvalidOperation:
        return None


def number_equal(pred: str, gold: str, stated: bool = True) -> tuple[bool, str]:
    """(equal, how): a single number numerically, else the whole expression by math-verify. A
    stated answer (box or marker) with several numbers and words is no number (`worded`, never
    equal); `stated=False` (a reply's last line, a sentence) leaves that to math-verify."""
    g = to_number(gold)
    p = single_number(pred)
    if p is not None and g is not None:
        return abs(p - g) <= Decimal("1e-6") * max(Decimal(1), abs(g)), "number"
    if stated and worded_numbers(pred):
        return False, "worded"
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
    ok, how = number_equal(fin.text, gold, stated=fin.method != "last_line")
    return Grade(ok, fin.text, how, fin.method)
