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

One splitter for every consumer: thoughts end at blank-line boundaries (`BlankLineTracker`,
SEAL's segmentation, which SkipKV's steering follows), for SkipKV's non-execution count (the
eviction policies' telemetry), steering's alpha_t and the steering-vector build alike. The rule
lists are configurable with a YAML/JSON file (`load_rules`), the `thought_rules` option of
`skipkv` / the eviction policies and of `steering`, and `cotserve build-steering --rules`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from cotserve.errors import CotserveError

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
    r"\blet'?s (?:re-?)?check\b",
    r"\blet us (?:re-?)?check\b",
    r"\bcheck(?:ing)? (?:our|my|the|your) (?:work|answer|result|solution|calculation)s?\b",
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
        return self._close()


    def _close(self) -> str | None:
        """End the current thought: classify and count it (None when it is empty)."""
        text = self.tok.decode(self.current, skip_special_tokens=True)
        self.current = []
        if not text.strip():
            return None
        cls = classify_thought(text, self.rules)
        self.counts[cls] += 1
        return cls


class BlankLineTracker(ThoughtTracker):
    """Thoughts split at blank-line ("\\n\\n"-type) boundaries, on token ids (SEAL's segmentation).

    SEAL (Chen et al. 2025, Sec. 3) and SkipKV's steering (arXiv 2512.07993, Sec. 4.2) cut a chain
    of thought into thoughts at "\\n\\n". Tokenizers spell a blank line as one token ("\\n\\n",
    ".\\n\\n") or as a run of newline tokens ("\\n", "\\n"). A *boundary token* is the delimiter
    token at which the current run of delimiter tokens first holds two newlines: exactly one per
    blank line, decided causally (without looking ahead), so the same position is found at build
    time (over a finished trace) and at decode time (one token at a time). A single newline inside
    a thought stays part of it.

    `push(token_id)` returns the class of the thought this token closes (at a boundary with a
    non-empty thought), else None; `at_boundary` tells whether the last pushed token was a boundary.
    `flush()` classifies the unfinished trailing thought (None when empty) without counting it."""

    def __init__(self, tokenizer, delimiter_ids: frozenset[int], rules: ThoughtRules = DEFAULT_RULES):
        super().__init__(tokenizer, delimiter_ids, rules)
        self.newlines = {i: tokenizer.decode([i]).count("\n") for i in delimiter_ids}
        self.run = 0  # newlines in the current run of delimiter tokens (0: not in a run)
        self.at_boundary = False

    def push(self, token_id: int) -> str | None:
        self.at_boundary = False
        if token_id not in self.delims:
            self.run = 0
            self.current.append(token_id)
            return None
        before = self.run
        self.run += self.newlines.get(token_id, 0)
        if not (before < 2 <= self.run):
            self.current.append(token_id)  # a single newline, or the tail of a run already cut
            return None
        self.at_boundary = True
        return self._close()

    def flush(self) -> str | None:
        text = self.tok.decode(self.current, skip_special_tokens=True)
        return classify_thought(text, self.rules) if text.strip() else None


def blank_line_thoughts(token_ids: list[int], tokenizer, delimiter_ids: frozenset[int],
                        rules: ThoughtRules = DEFAULT_RULES) -> list[tuple[int, str]]:
    """(boundary index, class of the thought that FOLLOWS it) for a finished trace.

    The boundary token is the one SEAL reads its hidden state at (the "\\n\\n" before a thought);
    boundaries followed by an empty thought are left out. The last thought runs to the end of
    the trace (it may be cut by a token limit)."""
    tracker = BlankLineTracker(tokenizer, delimiter_ids, rules)
    bounds: list[int] = []
    following: list[str | None] = []
    for i, t in enumerate(token_ids):
        cls = tracker.push(t)
        if tracker.at_boundary:
            if bounds:
                following.append(cls)
            bounds.append(i)
    if bounds:
        following.append(tracker.flush())
    return [(b, c) for b, c in zip(bounds, following, strict=True) if c is not None]


def load_rules(path: str | None) -> ThoughtRules:
    """Classification rules from a YAML/JSON file {reflection: [regex, ...], transition: [...]};
    a missing key keeps the default list. None or "" gives the defaults."""
    if not path:
        return DEFAULT_RULES
    p = Path(path).expanduser()
    if not p.is_file():
        raise CotserveError(f"rules file {p} does not exist")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(p.read_text())
        else:
            import yaml

            data = yaml.safe_load(p.read_text())
    except Exception as exc:
        raise CotserveError(f"cannot parse rules file {p}: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"reflection", "transition"}:
        raise CotserveError(f"rules file {p} must map 'reflection' and/or 'transition' to lists of regular expressions")
    out = {}
    for key in ("reflection", "transition"):
        pats = data.get(key, list(getattr(DEFAULT_RULES, key)))
        if not isinstance(pats, list) or not all(isinstance(x, str) for x in pats):
            raise CotserveError(f"rules file {p}: {key!r} must be a list of strings")
        for x in pats:
            try:
                re.compile(x)
            except re.error as exc:
                raise CotserveError(f"rules file {p}: bad regular expression {x!r}: {exc}") from exc
        out[key] = tuple(pats)
    return ThoughtRules(**out)


def thought_tracker(tokenizer, delimiter_ids: frozenset[int], rules: ThoughtRules = DEFAULT_RULES
                    ) -> BlankLineTracker:
    """The one thought splitter (blank-line boundaries) every consumer uses."""
    return BlankLineTracker(tokenizer, delimiter_ids, rules)
