"""Thought classification rules on hand-written thoughts, and the per-sequence tracker."""

from __future__ import annotations

import pytest

from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.thoughts import (
    EXECUTION,
    REFLECTION,
    TRANSITION,
    ThoughtRules,
    ThoughtTracker,
    classify_thought,
    split_thoughts,
)


@pytest.mark.parametrize("text,cls", [
    ("Wait, that is not right. 3 * 4 is 12.", REFLECTION),
    ("Let me check the arithmetic once more.", REFLECTION),
    ("I should verify that x = 3 satisfies both equations.", REFLECTION),
    ("To make sure, substitute back into the original.", REFLECTION),
    ("Hmm, so the answer might be 7 again.", REFLECTION),
    ("Alternatively, we could factor the quadratic.", TRANSITION),
    ("Let's try another approach using symmetry.", TRANSITION),
    ("There is a different method: complete the square.", TRANSITION),
    ("First, compute 3 * 4 = 12.", EXECUTION),
    ("So the total cost is $45.", EXECUTION),
    ("The waiter brought 3 plates.", EXECUTION),  # 'wait' inside a word is not a reflection
])
def test_classification(text, cls):
    assert classify_thought(text) == cls


def test_rules_are_configurable():
    rules = ThoughtRules(reflection=(r"\bhmm\b",), transition=(r"\bpivot\b",))
    assert classify_thought("Wait, no.", rules) == EXECUTION
    assert classify_thought("Hmm.", rules) == REFLECTION
    assert classify_thought("Let us pivot.", rules) == TRANSITION


def test_split_thoughts():
    assert split_thoughts("a\n\nb\n \nc\n\n\n") == ["a", "b", "c"]


def test_tracker_counts_non_execution(loaded):
    tok = loaded.tokenizer
    delims = thought_delimiter_ids(tok)
    text = "Compute 2+3=5.\n\nWait, let me check that.\n\nAlternatively, count on fingers.\n\nSo 5.\n\n"
    tracker = ThoughtTracker(tok, delims)
    closed = [c for t in tok.encode(text) if (c := tracker.push(t))]
    assert closed == [EXECUTION, REFLECTION, TRANSITION, EXECUTION]
    assert tracker.non_execution == 2
