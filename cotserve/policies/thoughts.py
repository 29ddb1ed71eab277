"""Thought segmentation and classification for chains of thought.

A thought is the text between two thought delimiters (newline-type tokens, see
`boundaries.thought_delimiter_ids`). Each thought is classified, by documented and configurable
rules, as

* reflection: re-checking earlier work ("Wait", "verify", "make sure", "let me check", ...),
* transition: switching approach ("Alternatively", "another way/approach/method", ...),
* execution: everything else (the reasoning steps that move the solution forward).

Reflection and transition thoughts are the "non-execution" thoughts of SkipKV (arXiv 2512.07993,
Sec. 4.2; the classes follow SEAL, Chen et al. 2025): their running count N_o drives the adaptive
steering strength alpha_t = alpha0 + gamma * N_o, and SkipKV reports it per sequence.

Rules are case-insensitive regular expressions searched anywhere in the thought; reflection rules
are checked first (a thought that both reflects and switches counts as reflection).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REFLECTION_RULES: tuple[str, ...] = (
    r"^\W*wait\b",
    r"\bwait,",
    r"\bverif(?:y|ied|ying|ication)\b",
    r"\bdouble[- ]check",
    r"\bmake sure\b",
    r"\blet me check\b",
    r"\blet me re-?check\b",
    r"\bcheck (?:again|that|this|if|whether)\b",
    r"\bagain\b",
    r"\bre-?examine\b",
    r"\bre-?consider\b",
    r"\bhold on\b",
    r"\bhmm+\b",
)

TRANSITION_RULES: tuple[str, ...] = (
    r"^\W*alternatively\b",
    r"\balternatively\b",
    r"\banother (?:way|approach|method|idea|strategy)\b",
    r"\ba different (?:way|approach|method|strategy)\b",
    r"\btry (?:a different|another)\b",
    r"\binstead,",
)

EXECUTION = "execution"
REFLECTION = "reflection"
TRANSITION = "transition"


@dataclass
class ThoughtRules:
    """Configurable classification rules (regular expressions, case-insensitive)."""

    reflection: tuple[str, ...] = REFLECTION_RULES
    transition: tuple[str, ...] = TRANSITION_RULES
    _compiled: tuple[list[re.Pattern], list[re.Pattern]] | None = field(default=None, repr=False, compare=False)

    def compiled(self) -> tuple[list[re.Pattern], list[re.Pattern]]:
        if self._compiled is None:
            self._compiled = ([re.compile(r, re.IGNORECASE) for r in self.reflection],
                              [re.compile(r, re.IGNORECASE) for r in self.transition])
        return self._compiled

    def as_dict(self) -> dict[str, list[str]]:
        return {"reflection": list(self.reflection), "transition": list(self.transition)}


DEFAULT_RULES = ThoughtRules()


def classify_thought(text: str, rules: ThoughtRules = DEFAULT_RULES) -> str:
    """reflection, transition or execution (see module docstring)."""
    refl, trans = rules.compiled()
    body = text.strip()
    if any(p.search(body) for p in refl):
        return REFLECTION
    if any(p.search(body) for p in trans):
        return TRANSITION
    return EXECUTION


def split_thoughts(text: str) -> list[str]:
    """Split a finished trace into thoughts at blank-line (\\n\\n-type) delimiters."""
    return [t for t in re.split(r"\n\s*\n", text) if t.strip()]


class ThoughtTracker:
    """Follows one sequence's generated tokens and counts non-execution thoughts.

    `push(token_id)` returns the class of the thought that this token closes (when the token is
    a thought delimiter and the thought is not empty), else None."""

    def __init__(self, tokenizer, delimiter_ids: frozenset[int], rules: ThoughtRules = DEFAULT_RULES):
        self.tok = tokenizer
        self.delims = delimiter_ids
        self.rules = rules
        self.current: list[int] = []
        self.counts = {REFLECTION: 0, TRANSITION: 0, EXECUTION: 0}

    @property
    def non_execution(self) -> int:
        return self.counts[REFLECTION] + self.counts[TRANSITION]

    def push(self, token_id: int) -> str | None:
        if token_id not in self.delims:
            self.current.append(token_id)
            return None
        text = self.tok.decode(self.current, skip_special_tokens=True)
        self.current = []
        if not text.strip():
            return None
        cls = classify_thought(text, self.rules)
        self.counts[cls] += 1
        return cls
