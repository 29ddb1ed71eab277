"""Where a reply states its final answer. Shared by the number and math graders.

The graders refuse to guess: an answer is read only from

1. `boxed` - the last complete `\\boxed{...}`;
2. `marker` - the text after the last affirmative final-answer marker: `####`, "final answer",
   "the answer is", "answer:" (to the end of that line or of its sentence, whichever comes first;
   on the next line when the marker ends its line). A negated statement ("the answer is not 5")
   is no answer, and it retracts an earlier statement of the same answer;
3. `last_line` - only for a reply that ended by itself (not cut at max_tokens): its last line,
   when that line is a plain statement - not a list item or step header (`6.`, `Step 3:`), not
   a calculation (`=`, operators between numbers), not a line ending in `:`, not a negation.

A reply cut at max_tokens (finish reason `length`) earns credit only for an answer that was
complete before the cut: the stated answer must be followed by something that ends it - the
closing brace of a closed `\\boxed{}`, a sentence end (`.`, `!`, `?`) followed by whitespace or
more text, or a newline - before the end of the text. `\\boxed{12` (still open), `The final
answer is 1,2` (could have become 1,234) and `The answer is 7` at the very end take nothing, and
neither does a box that was opened after the stated answer and never closed (the reply was
restating its answer when it was cut).

Otherwise nothing is taken: method `truncated` when the reply was cut at max_tokens, `none` when
it ended without a final answer. Each grade records its method so the report can show the share
of answers found each way."""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def _box_spans(text: str) -> list[tuple[int, int | None, str | None]]:
    """Every `\\boxed{`: (start, end after its closing brace or None when never closed, content)."""
    spans: list[tuple[int, int | None, str | None]] = []
    for m in _BOX.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        spans.append((m.start(), j + 1, text[i + 1 : j].strip()))
                        break
            else:
                spans.append((m.start(), None, None))
        elif m.group(0).endswith(" "):  # `\\boxed 5`
            word = re.match(r"[^\s$]+", text[i:])
            if word:
                spans.append((m.start(), i + word.end(), word.group(0)))
    return spans


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; `\\boxed 5` too. An
    unbalanced box (cut off by max_tokens) is skipped for an earlier one."""
    closed = [s for s in _box_spans(text) if s[1] is not None]
    return closed[-1][2] if closed else None


MARKER = re.compile(
    r"(?i)(?:####|\bfinal\s+answer\b(?:\s+is)?|\bthe\s+(?:correct\s+)?answer\s+is\b|\banswer\s*:)"
)
_LIST_ITEM = re.compile(r"(?i)^\s*(?:[-*\u2022]\s|\(?\d+[.)](?:\s|$)|step\s*\d+\b|#+\s)")
_CALC = re.compile(r"=|\d\s*[-+*/\u00d7\u00f7^x]\s*\d|\\times|\\div|\\cdot")
_SENTENCE_END = re.compile(r"[.!?](?=\s)")  # a sentence ends where whitespace follows its stop
_NEGATED = re.compile(r"(?i)^(?:not|never|n['\u2019]t)\b")
_NEGATION_WORD = re.compile(r"(?i)\b(?:not|never)\b|n['\u2019]t\b")


@dataclass
class Final:
    text: str | None  # the answer as written (None: nothing taken)
    method: str  # boxed | marker | last_line | truncated | none


@dataclass
class Stated:
    """One answer after a final-answer marker."""

    text: str  # the answer, cleaned (`_clean`)
    start: int  # where its marker starts in the reply
    end: int  # where the answer's line or sentence ends
    complete: bool  # a newline or a sentence end followed by whitespace came before the end of the text
    negated: bool  # "the answer is not 5"


def _statement(text: str, pos: int) -> tuple[str, int, bool]:
    """The line from `pos`, up to its first sentence end: (text, end, complete)."""
    nl = text.find("\n", pos)
    line_end = len(text) if nl < 0 else nl
    line = text[pos:line_end]
    m = _SENTENCE_END.search(line)
    if m:
        return line[: m.start()], pos + m.end(), True
    return line, line_end, nl >= 0


def stated_answers(text: str) -> list[Stated]:
    """Every final-answer marker's answer, in order (see the module doc)."""
    out = []
    for m in MARKER.finditer(text):
        raw, end, complete = _statement(text, m.end())
        if not _clean(raw):  # the marker ends its line (`**Final Answer**` then `$18$`)
            nxt = re.compile(r"\n[ \t]*(?=\S)").search(text, end)
            if nxt is None:
                continue
            raw, end, complete = _statement(text, nxt.end())
        cand = _clean(raw)
        if not cand:
            continue
        negated = bool(_NEGATED.match(cand))
        if negated:
            cand = _clean(_NEGATED.sub("", cand, count=1))
        out.append(Stated(cand, m.start(), end, complete, negated))
    return out


def _same(a: str, b: str) -> bool:
    return "".join(a.split()).rstrip(".") == "".join(b.split()).rstrip(".")


def affirmed(stated: list[Stated]) -> list[Stated]:
    """The statements that stand: not negated, and not retracted by a later negation of the same
    answer ("the answer is 5 ... no, the answer is not 5")."""
    keep = []
    for i, s in enumerate(stated):
        if s.negated:
            continue
        if any(t.negated and _same(t.text, s.text) for t in stated[i + 1 :]):
            continue
        keep.append(s)
    return keep


def after_marker(text: str) -> str | None:
    """The answer after the last affirmative final-answer marker, to the end of its line or
    sentence (or on the next non-empty line when the marker ends its line); None without one."""
    ok = affirmed(stated_answers(text))
    return ok[-1].text if ok else None


def _clean(s: str) -> str:
    s = s.strip().strip("*_ ").lstrip(":").strip().strip("*_ ")
    s = re.sub(r"^(?i:is)\b\s*:?\s*", "", s)
    s = s.strip().rstrip(".").strip()
    if s.startswith("$") and s.endswith("$") and len(s) > 1 and s.count("$") == 2:
        s = s[1:-1].strip()
    return s


def last_statement(text: str) -> str | None:
    """The last non-empty line when it reads as a concluding statement (see the module doc)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    line = lines[-1]
    if _LIST_ITEM.match(line) or _CALC.search(line) or line.rstrip("*_ ").endswith(":"):
        return None
    if _NEGATION_WORD.search(line):
        return None
    return line


def _opened_after(spans: list[tuple[int, int | None, str | None]], pos: int) -> bool:
    """A box opens at or after `pos` and is never closed."""
    return any(end is None and start >= pos for start, end, _ in spans)


def find_final(text: str, finish_reason: str | None = None) -> Final:
    cut = finish_reason == "length"
    spans = _box_spans(text)
    closed = [s for s in spans if s[1] is not None]
    if closed:
        _, end, content = closed[-1]
        if cut and _opened_after(spans, end or 0):
            return Final(None, "truncated")
        return Final(content, "boxed")
    stated = stated_answers(text)
    ok = affirmed(stated)
    if ok:
        last = ok[-1]
        if cut and (not last.complete or _opened_after(spans, last.end)):
            return Final(None, "truncated")
        return Final(last.text, "marker")
    if cut:
        return Final(None, "truncated")
    if stated:  # only negated answers ("the answer is not 5"): nothing stands
        return Final(None, "none")
    line = last_statement(text)
    if line is not None:
        return Final(line, "last_line")
    return Final(None, "none")
