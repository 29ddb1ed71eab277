"""Where a reply states its final answer. Shared by the number and math graders.

The graders refuse to guess: an answer is read only from

1. `boxed` - the last complete `\\boxed{...}`;
2. `marker` - the text after the last final-answer marker: `####`, "final answer", "the answer
   is", "answer:" (to the end of that line; on the next line when the marker ends its line);
3. `last_line` - only for a reply that ended by itself (not cut at max_tokens): its last line,
   when that line is a plain statement - not a list item or step header (`6.`, `Step 3:`), not
   a calculation (`=`, operators between numbers), not a line ending in `:`.

Otherwise nothing is taken: method `truncated` when the reply was cut at max_tokens (finish
reason `length`), `none` when it ended without a final answer. Each grade records its method so
the report can show the share of answers found each way."""

from __future__ import annotations

import re
from dataclasses import dataclass


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


MARKER = re.compile(
    r"(?i)(?:####|\bfinal\s+answer\b(?:\s+is)?|\bthe\s+(?:correct\s+)?answer\s+is\b|\banswer\s*:)"
)
_LIST_ITEM = re.compile(r"(?i)^\s*(?:[-*\u2022]\s|\(?\d+[.)](?:\s|$)|step\s*\d+\b|#+\s)")
_CALC = re.compile(r"=|\d\s*[-+*/\u00d7\u00f7^x]\s*\d|\\times|\\div|\\cdot")


@dataclass
class Final:
    text: str | None  # the answer as written (None: nothing taken)
    method: str  # boxed | marker | last_line | truncated | none


def after_marker(text: str) -> str | None:
    """The text after the last final-answer marker, to the end of its line (or the next
    non-empty line when the marker ends its line); None without a marker."""
    hits = list(MARKER.finditer(text))
    if not hits:
        return None
    rest = text[hits[-1].end():]
    line, _, tail = rest.partition("\n")
    cand = _clean(line)
    if not cand:
        nxt = next((ln for ln in tail.splitlines() if ln.strip()), "")
        cand = _clean(nxt)
    return cand or None


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
    return line


def find_final(text: str, finish_reason: str | None = None) -> Final:
    boxed = extract_boxed(text)
    if boxed is not None:
        return Final(boxed, "boxed")
    cand = after_marker(text)
    if cand is not None:
        return Final(cand, "marker")
    if finish_reason == "length":
        return Final(None, "truncated")
    line = last_statement(text)
    if line is not None:
        return Final(line, "last_line")
    return Final(None, "none")
