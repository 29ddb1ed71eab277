"""GPQA (and any 4-way multiple choice): the letter the reply commits to.

Phrasings are tried from the most to the least explicit, and within one phrasing the LAST match
wins (a reply may mention options before settling). Each is recorded as the extraction method:

- `boxed`: `\\boxed{C}`;
- `marker`: `Answer: C` / `answer is (C)` / `**Answer:** D` / `Final answer: C`, the letter in
  either case when it stands alone (`answer: c`, not "the answer is a subtle one");
- `phrase`: `correct option/choice is C`, `option C is correct`, `I'll go with D`, and a plain
  `It is B.` / `it must be (B)` (the letter ending its clause);
- `option_line`: the reply names one option as a line of its own, `A) text` / `(B) text` /
  `C. text` / a bare `C` - only when a single letter is named that way (a reply that lists the
  options names several and commits to none);
- `parenthesis`: the last `(C)` in the reply.

Negated answers do not count, and they retract: `not A`, `isn't (A)`, `never option A` cancel
every earlier statement of that letter, so `The answer is not A. It is B.` gives B and `Answer:
A ... no, the answer is not A` gives nothing for A (the last affirmative answer wins).

A reply cut at max_tokens is graded only from `boxed`, `marker` or `phrase`, and only when that
answer was complete before the cut: followed by the box's closing brace, a newline, or a
sentence end (`.`, `!`, `?`) with whitespace or more text after it (`cotserve.eval.graders.final`);
a list of options or a parenthesis in text that never finished is not an answer (method
`truncated`)."""

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
    ("phrase", re.compile(r"(?i:\b(?:it|this|that)\s*(?:is|'s|must be|has to be|should be))\s+"
                          r"(?:(?i:option|choice)\s+)?[*_]*\(?([A-D])\)?[*_]*(?=[ \t]*$|[.,;:!?])", re.M)),
]
_TIERS = ("boxed", "marker", "phrase")
_NEGATED = re.compile(r"(?i:\bnot|\bnever|n['\u2019]t)\s+(?:(?i:be)\s+)?(?:(?i:option|choice)\s+)?[*_]*\(?\[?"
                      r"([A-D])\b")
_OPTION_LINE = re.compile(r"(?m)^\s*[*_]*\(?([A-D])(?:[).:][*_]*(?:\s+\S.*)?|[*_]*)\s*$")
_PAREN = re.compile(r"\(([A-D])\)")
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def _complete(text: str, method: str, end: int) -> bool:
    """The answer that ends at `end` was finished before the end of the text (see the module doc)."""
    if method == "boxed":
        return True  # the pattern needs the closing brace
    nl = text.find("\n", end)
    return nl >= 0 or bool(_SENTENCE_END.search(text, end))


def _standing(text: str) -> list[tuple[str, str, int]]:
    """(method, letter, end) of every strong match not retracted by a later negation of its letter."""
    negations = [(m.group(1).upper(), m.start()) for m in _NEGATED.finditer(text)]
    found = []
    for method, pat in _STRONG:
        for m in pat.finditer(text):
            letter = m.group(1).upper()
            if any(n == letter and pos > m.start(1) for n, pos in negations):
                continue
            found.append((method, letter, m.start(1), m.end(1)))
    found.sort(key=lambda f: f[2])
    return [(method, letter, end) for method, letter, _, end in found]


def extract_letter_method(text: str, finish_reason: str | None = None) -> tuple[str | None, str]:
    """(letter, method); (None, `truncated` | `none`) when the reply commits to no letter."""
    cut = finish_reason == "length"
    standing = _standing(text)
    for tier in _TIERS:
        hits = [h for h in standing if h[0] == tier]
        if hits:
            method, letter, end = hits[-1]
            if cut and not _complete(text, method, end):
                return None, "truncated"
            return letter, method
    if cut:
        return None, "truncated"
    negated = {m.group(1).upper() for m in _NEGATED.finditer(text)}
    named = [x for x in _OPTION_LINE.findall(text) if x not in negated]
    if named and len(set(named)) == 1:
        return named[-1], "option_line"
    hits = [x for x in _PAREN.findall(text) if x not in negated]
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
