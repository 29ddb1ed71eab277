"""Math answers (MATH-500, AIME, custom): the last `\\boxed{}` of the reply, checked for
mathematical equivalence with the reference by `math-verify` (Hugging Face), so `\\frac{1}{2}`,
`0.5` and `1/2` agree, and so do `\\left( 3, \\frac{\\pi}{2} \\right)` and `(3, \\pi/2)`."""

from __future__ import annotations

import re
import threading

from cotserve.eval.graders.base import Grade


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; `\\boxed 5` too."""
    for start in sorted((m.start() for m in _BOX.finditer(text)), reverse=True):
        m = _BOX.match(text, start)
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced (cut off by max_tokens): try an earlier box
        if m.group(0).endswith(" "):  # `\\boxed 5`
            word = re.match(r"[^\s$]+", text[i:])
            if word:
                return word.group(0)
    return None


_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def _timeouts() -> dict[str, int | None]:
    # math-verify's timeouts use signal.alarm, which works only in the main thread
    main = threading.current_thread() is threading.main_thread()
    return {"parse": 5 if main else None, "verify": 5 if main else None}


def math_equal(gold: str, pred: str) -> bool:
    """Equivalence of two LaTeX/plain answers by math-verify (parse both, then verify)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    t = _timeouts()
    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_p = parse(f"${gold}$", extraction_config=cfg, parsing_timeout=t["parse"])
    pred_p = parse(f"\\boxed{{{pred}}}", extraction_config=cfg, parsing_timeout=t["parse"])
    if not gold_p or not pred_p:
        return _norm(gold) == _norm(pred)
    try:
        return bool(verify(gold_p, pred_p, timeout_seconds=t["verify"]))
    except Exception:  # a pathological expression: fall back to text equality
        return _norm(gold) == _norm(pred)


def _norm(s: str) -> str:
    return "".join(s.split()).replace("\\left", "").replace("\\right", "").replace("\\!", "").rstrip(".")


def grade_math(text: str, gold: str) -> Grade:
    """Correct when the last boxed answer equals the reference. Without a box, math-verify's own
    extraction of the reply's final expression is used (as open-r1 does)."""
    pred = extract_boxed(text)
    if pred is None:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        t = _timeouts()
        parsed = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                       parsing_timeout=t["parse"])
        if not parsed:
            return Grade(False, None, "no answer found")
        gold_p = parse(f"${gold}$", parsing_timeout=t["parse"])
        try:
            ok = bool(verify(gold_p, parsed, timeout_seconds=t["verify"]))
        except Exception:
            ok = False
        return Grade(ok, str(parsed[-1]), "unboxed")
    return Grade(math_equal(gold, pred), pred)
