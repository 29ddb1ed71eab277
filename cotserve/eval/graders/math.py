"""Math answers (MATH-500, AIME, custom): the stated final answer (normally the last `\\boxed{}`), checked for
mathematical equivalence with the reference by `math-verify` (Hugging Face), so `\\frac{1}{2}`,
`0.5` and `1/2` agree, and so do `\\left( 3, \\frac{\\pi}{2} \\right)` and `(3, \\pi/2)`."""

from __future__ import annotations

import threading

from cotserve.eval.graders.base import Grade
from cotserve.eval.graders.final import extract_boxed, find_final  # noqa: F401 (extract_boxed is part of this module's API)


def _timeouts() -> dict[str, int | None]:
    # math-verify's timeouts use signal.alarm, which works only in the main thread
    main = threading.current_thread() is threading.main_thread()
    return {"parse": 5 if main else None, "verify": 5 if main else None}


def math_equal(gold: str, pred: str, boxed: bool = True) -> bool:
    """Equivalence of two LaTeX/plain answers by math-verify (parse both, then verify). `pred` is
    parsed as one boxed expression; `boxed=False` lets math-verify find the expression in a
    sentence (a reply's last line)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    t = _timeouts()
    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_p = parse(f"${gold}$", extraction_config=cfg, parsing_timeout=t["parse"])
    pred_p = parse(f"\\boxed{{{pred}}}" if boxed else pred, extraction_config=cfg, parsing_timeout=t["parse"])
    if not gold_p or not pred_p:
        return _norm(gold) == _norm(pred)
    try:
        return bool(verify(gold_p, pred_p, timeout_seconds=t["verify"]))
    except Exception:  # a pathological expression: fall back to text equality
        return _norm(gold) == _norm(pred)


def _norm(s: str) -> str:
    return "".join(s.split()).replace("\\left", "").replace("\\right", "").replace("\\!", "").rstrip(".")


def grade_math(text: str, gold: str, finish_reason: str | None = None) -> Grade:
    """Correct when the stated final answer (`cotserve.eval.graders.final`: the last box, else a
    final-answer marker, else the last line of a reply that ended by itself) equals the reference
    as a whole expression. A reply cut at max_tokens without one scores 0."""

    fin = find_final(text, finish_reason)
    if fin.text is None:
        detail = "cut at max_tokens before a final answer" if fin.method == "truncated" else "no final answer"
        return Grade(False, None, detail, fin.method)
    return Grade(math_equal(gold, fin.text, boxed=fin.method != "last_line"), fin.text, "math-verify", fin.method)
