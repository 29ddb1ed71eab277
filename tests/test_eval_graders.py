"""Graders on known right and wrong answers (math-verify for LaTeX, GSM8K numbers, multiple-choice
letters in several phrasings, code extraction and output comparison). The multiple-choice items
here are made up for the tests."""

from __future__ import annotations

import pytest

from cotserve.eval.graders import grade
from cotserve.eval.graders.code import extract_code, grade_code, stdout_matches, values_equal
from cotserve.eval.graders.gpqa import extract_letter
from cotserve.eval.graders.gsm8k import grade_gsm8k
from cotserve.eval.graders.math import extract_boxed, grade_math, math_equal
from cotserve.eval.loaders import Item


@pytest.mark.parametrize("gold,reply", [
    ("\\frac{1}{2}", "So the probability is $\\boxed{0.5}$."),
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "\\boxed{\\dfrac12}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "Thus $(r,\\theta) = \\boxed{(3, \\frac{\\pi}{2})}$."),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{\\left(3,\\pi/2\\right)}"),
    ("204", "Adding up, Aya needs \\boxed{204} minutes."),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
])
def test_math_equivalent_forms_are_right(gold, reply):
    g = grade_math(reply, gold)
    assert g.correct, (gold, reply, g)


@pytest.mark.parametrize("gold,reply", [
    ("\\frac{1}{2}", "\\boxed{0.25}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi)}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(\\frac{\\pi}{2}, 3)}"),
    ("204", "so \\boxed{205}"),
    ("204", "I am not sure."),
])
def test_math_wrong_answers_are_wrong(gold, reply):
    assert not grade_math(reply, gold).correct


def test_math_takes_the_last_box_and_skips_a_cut_off_one():
    assert extract_boxed("first \\boxed{1}, then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_boxed("\\boxed{7} and finally \\boxed{12") == "7"  # unbalanced: cut by max_tokens
    assert extract_boxed("\\boxed 5$") == "5"
    assert extract_boxed("no box here") is None
    assert math_equal("\\frac{3}{4}", "0.75") and not math_equal("\\frac{3}{4}", "0.7")


@pytest.mark.parametrize("reply,ok", [
    ("She sells 9 eggs for $2 each, so 9 * 2 = 18.\n#### 18", True),
    ("The answer is $18.00.", True),
    ("Total: \\boxed{18}", True),
    ("That makes 1,018 dollars in all. The answer is 1,018", False),
    ("She earns \\boxed{16} dollars.", False),
    ("I cannot tell.", False),
])
def test_gsm8k_numeric(reply, ok):
    assert grade_gsm8k(reply, "18").correct is ok


def test_gsm8k_thousands_separators():
    assert grade_gsm8k("The answer is 2,125", "2125").correct
    assert grade_gsm8k("\\boxed{2,125}", "2125").correct


@pytest.mark.parametrize("reply,letter", [
    ("The reaction is exothermic.\nAnswer: C", "C"),
    ("Comparing A and B first... the answer is (B).", "B"),
    ("**Answer:** D", "D"),
    ("Therefore the final answer is $\\boxed{A}$", "A"),
    ("The correct option is C.", "C"),
    ("Option B is correct.", "B"),
    ("After weighing the options I'll go with D", "D"),
    ("Hmm, option A seems off. Answer: A\nWait, no. Answer: B", "B"),
    ("Final answer: **C**", "C"),
    ("Reasoning done.\n(D)", "D"),
    ("The answer is a subtle one and I cannot decide.", None),
])
def test_multiple_choice_letters(reply, letter):
    assert extract_letter(reply) == letter


def test_multiple_choice_grading_on_a_made_up_item():
    item = Item("mc", "made-up-1", "gpqa", "Which planet is closest to the Sun?",
                "B", {"choices": ["Venus", "Mercury", "Earth", "Mars"]})
    assert grade(item, "Mercury orbits closest.\nAnswer: B").correct
    assert not grade(item, "Venus is hottest.\nAnswer: A").correct
    assert not grade(item, "No idea.").correct


def test_code_extraction_prefers_the_last_python_block():
    reply = "Idea:\n```\npseudo\n```\nCode:\n```python\nprint(1)\n```\nand\n```python\nprint(2)\n```\n"
    assert extract_code(reply).strip() == "print(2)"
    assert extract_code("```py\nx = 1\n") == "x = 1\n"  # cut off by max_tokens: still taken
    assert extract_code("no code") is None


def test_output_comparison():
    assert stdout_matches("1 2\n3\n\n", "1 2\n3")
    assert stdout_matches("1.50\n", "1.5\n")
    assert not stdout_matches("1 2\n", "1 3\n")
    assert not stdout_matches("YES\n", "NO\n")
    assert values_equal([1, [2, 3]], [1, [2, 3]]) and not values_equal([1, 2], [2, 1])
    assert values_equal(0.30000000000000004, 0.3) and not values_equal(True, [True])


# -- graders that refuse to guess ---------------------------------------------------------------

TRUNCATED_GSM8K = (  # a reply cut at max_tokens mid-list: the list marker "6" must not count
    "First, find the distance of each leg.\n1. Monday: 2 miles\n2. Tuesday: 3 miles\n"
    "3. Wednesday: 1 mile\n4. Thursday: 0 miles\n5. Friday: 0 miles\n6. Now, calculate the total distance"
)


@pytest.mark.parametrize("reply,finish,gold,ok,method", [
    (TRUNCATED_GSM8K, "length", "6", False, "truncated"),
    (TRUNCATED_GSM8K, "stop", "6", False, "none"),  # even when it stopped: a list item is no answer
    ("Each box holds 20 and there are 3 boxes.\nFinal answer: 20 * 3", "stop", "20", False, "marker"),
    ("Each box holds 20 and there are 3 boxes.\nFinal answer: 20 * 3", "stop", "60", True, "marker"),
    ("We add them: \\boxed{5+13=18}", "stop", "18", True, "boxed"),
    ("We add them: \\boxed{5+13=18}", "stop", "5", False, "boxed"),
    ("Step 1: read\nStep 2: add\nStep 3: compute", "stop", "3", False, "none"),
    ("She has 5 + 13 = 18", "stop", "18", False, "none"),  # a calculation line is not a statement
    ("Adding 5 and 13 she ends with 18 apples.", "stop", "18", True, "last_line"),
    ("Adding 5 and 13 she ends with 18 apples.", "length", "18", False, "truncated"),
    ("So far 5 + 13 = 18, then\n#### 18\nCheck", "length", "18", True, "marker"),  # cut after stating it
    ("So far 5 + 13 = 18, then\n#### 18", "length", "18", False, "truncated"),  # 18 could have become 180
    ("The answer is: $1,018.", "stop", "1018", True, "marker"),
    ("**Final Answer**\n$18$", "stop", "18", True, "marker"),
    ("The answer is 18 and then 2 more", "stop", "18", False, "marker"),  # two numbers: judged whole
])
def test_gsm8k_refuses_to_guess(reply, finish, gold, ok, method):
    g = grade_gsm8k(reply, gold, finish)
    assert (g.correct, g.method) == (ok, method), g


@pytest.mark.parametrize("reply,finish,gold,ok,method", [
    ("Step 1: set up\nStep 2: solve\nStep 3: compute", "stop", "3", False, "none"),
    ("We simplify $x^2 = 9$ so x = 3 and", "length", "3", False, "truncated"),
    ("\\boxed{5+13=18}", "stop", "18", True, "boxed"),
    ("The final answer is $\\frac{1}{2}$.", "stop", "0.5", True, "marker"),
    ("Therefore the ratio is $\\frac{1}{2}$", "stop", "\\frac{1}{2}", True, "last_line"),
])
def test_math_refuses_to_guess(reply, finish, gold, ok, method):
    g = grade_math(reply, gold, finish)
    assert (g.correct, g.method) == (ok, method), g


@pytest.mark.parametrize("reply,finish,letter,method", [
    ("A) 2.5 eV", "stop", "A", "option_line"),
    ("(C) the second isomer", "stop", "C", "option_line"),
    ("answer: c", "stop", "C", "marker"),
    ("After all that, the answer is b.", "stop", "B", "marker"),
    ("A) x\nB) y\nC) z\nD) w", "stop", None, "none"),  # the options listed, none chosen
    ("Consider (A) first, then", "length", None, "truncated"),
    ("It must be so. Answer: D\nDone", "length", "D", "marker"),
    ("It must be so. Answer: D", "length", None, "truncated"),  # at the very end of a cut reply
])
def test_multiple_choice_forms_and_refusals(reply, finish, letter, method):
    from cotserve.eval.graders.gpqa import extract_letter_method

    assert extract_letter_method(reply, finish) == (letter, method)


def test_grade_records_the_extraction_method_for_every_kind():
    item = Item("g", "1", "gsm8k", "q", "18")
    assert grade(item, "#### 18", finish_reason="stop").method == "marker"
    assert grade(item, "and 1. then 2. then", finish_reason="length").method == "truncated"
    mc = Item("mc", "1", "gpqa", "q", "B", {"choices": ["w", "x", "y", "z"]})
    assert grade(mc, "B) x", finish_reason="stop").method == "option_line"
    ex = Item("e", "1", "exact", "q", "yes")
    assert grade(ex, "The answer is yes", finish_reason="stop").correct


# -- cut replies: an answer counts only when it was complete before the cut ----------------------

@pytest.mark.parametrize("reply,gold,ok,method", [
    ("Therefore the answer is \\boxed{12", "12", False, "truncated"),  # the box never closed
    ("The final answer is 1,2", "12", False, "truncated"),  # could have been 1,234
    ("The final answer is 1,2", "1234", False, "truncated"),
    ("The answer is 7", "7", False, "truncated"),  # a trailing number at the very end
    ("The answer is 7.", "7", False, "truncated"),  # 7. could have been 7.5
    ("The answer is 7. ", "7", True, "marker"),  # a sentence end and whitespace
    ("The answer is 7. Let me double-check the", "7", True, "marker"),
    ("The answer is 7\nLet me double-check", "7", True, "marker"),  # a newline ends it
    ("Therefore \\boxed{12}", "12", True, "boxed"),  # the closing brace ends it
    ("So \\boxed{12} is it. Checking: \\boxed{1", "12", False, "truncated"),  # restating when cut
    ("**Final Answer**\n$18$", "18", False, "truncated"),  # the answer line runs to the cut
    ("**Final Answer**\n$18$\n", "18", True, "marker"),
])
def test_cut_replies_earn_credit_only_for_complete_answers(reply, gold, ok, method):
    g = grade_gsm8k(reply, gold, "length")
    assert (g.correct, g.method) == (ok, method), g


def test_the_same_replies_that_ended_by_themselves_are_read():
    assert grade_gsm8k("The answer is 7", "7", "stop").correct
    assert grade_gsm8k("The final answer is 1,234", "1234", "stop").correct
    assert grade_math("Therefore the answer is \\boxed{\\frac{1}{2}}", "0.5", "stop").correct
    assert not grade_math("Therefore the answer is \\boxed{\\frac{1}{2", "0.5", "length").correct
    item = Item("m", "1", "math", "q", "12")
    assert grade(item, "The answer is 12", finish_reason="length").method == "truncated"
    assert grade(item, "The answer is 12", finish_reason="stop").correct


def test_cut_reply_reaches_the_grader_through_the_log_record():
    """The runner grades with the reply's finish reason: the same text scores only when it stopped."""
    from cotserve.eval.backends import EvalRequest, Output
    from cotserve.eval.runner import Variant, _record

    item = Item("gsm8k", "x", "gsm8k", "q", "12")
    job = EvalRequest(("gsm8k", "dense", "x", 0), "q", "dense", {}, 8, 0.0, 1.0, None)
    for finish, ok in (("length", False), ("stop", True)):
        rec = _record(item, Variant("dense", "dense"), Output(job, "The answer is 12", "The answer is 12",
                                                                 finish_reason=finish), None)
        assert (rec["correct"], rec["finish_reason"]) == (ok, finish)


@pytest.mark.parametrize("reply,gold,ok", [
    ("The answer is not 5.", "5", False),
    ("The answer is 5. Wait, the answer is not 5.", "5", False),  # retracted
    ("Hmm, the answer isn't 5. The answer is 7.", "7", True),
    ("The answer is not 5. The answer is 7.", "5", False),
    ("Answer: -$5", "-5", True),
    ("Answer: -$5", "5", False),  # the sign before the currency symbol is kept
    ("Answer: \\boxed{-\\$5}", "-5", True),
    ("\\boxed{$-5$}", "-5", True),
    ("\\boxed{3 \\text{ hours and } 20 \\text{ minutes}}", "3", False),  # a phrase, not the number 3
    ("\\boxed{3 \\text{ hours and } 20 \\text{ minutes}}", "20", False),
    ("\\boxed{3 \\text{ hours}}", "3", True),  # one number and its unit
    ("\\boxed{200}", "200", True),
])
def test_gsm8k_false_positives(reply, gold, ok):
    g = grade_gsm8k(reply, gold, "stop")
    assert g.correct is ok, g


@pytest.mark.parametrize("reply,letter", [
    ("The answer is not A. It is B.", "B"),
    ("The answer is A. Wait, no, the answer is not A. It is B.", "B"),
    ("Answer: C. Hmm, no: not C.", None),  # retracted, and nothing else stated
    ("Option C is correct. Actually it isn't C. The correct option is D.", "D"),
    ("So it is A good idea to check.", None),  # an article, not an answer
])
def test_multiple_choice_retractions(reply, letter):
    assert extract_letter(reply, "stop") == letter


def test_code_block_cut_by_max_tokens_earns_nothing():
    meta = {"tests": [{"input": "", "output": "3\n", "testtype": "stdin"}]}
    cut = "Here:\n```python\nprint(1 + 2)\n"  # the fence never closed
    g = grade_code(cut, meta, finish_reason="length")
    assert (g.correct, g.method) == (False, "truncated")
    closed = cut + "```\nIt prints"
    g = grade_code(closed, meta, finish_reason="length")
    assert (g.correct, g.method) == (True, "code_block"), g


@pytest.mark.parametrize("reply,gold,ok", [
    ("#### -18", "18", False),
    ("The answer is \u221218.", "18", False),  # the Unicode minus sign
    ("The answer is \u221218.", "-18", True),
    ("\\boxed{- 18}", "18", False),  # a minus spaced from its digits, as math-verify reads the box
    ("\\boxed{- 18}", "-18", True),
    ("The answer is - 18.", "18", False),
    ("The answer is - 18.", "-18", True),
    ("The answer is negative 18.", "18", False),
    ("The answer is negative 18.", "-18", True),
    ("She ends with minus 18 dollars.", "18", False),
    ("She ends with minus 18 dollars.", "-18", True),
    ("The answer is negative $5.", "5", False),
    ("\\boxed{5 - 3}", "2", True),  # after a number the minus subtracts
    ("\\boxed{5 - 3}", "-3", False),
])
def test_gsm8k_never_drops_a_sign(reply, gold, ok):
    g = grade_gsm8k(reply, gold, "stop")
    assert g.correct is ok, g


@pytest.mark.parametrize("reply,gold,ok", [
    ("\\boxed{-5}", "5", False),
    ("\\boxed{5}", "-5", False),
    ("\\boxed{- 5}", "5", False),
    ("\\boxed{\u22125}", "-5", True),
    ("The final answer is $-\\frac{1}{2}$.", "\\frac{1}{2}", False),
])
def test_math_never_drops_a_sign(reply, gold, ok):
    g = grade_math(reply, gold, "stop")
    assert g.correct is ok, g


def test_negated_answers_give_the_one_stated_after_them():
    mc = Item("mc", "made-up-2", "gpqa", "q", "B", {"choices": ["w", "x", "y", "z"]})
    assert grade(mc, "The answer is not A. It is B.", finish_reason="stop").correct
    assert not grade(Item("mc", "made-up-2", "gpqa", "q", "A", mc.meta), "The answer is not A. It is B.",
                     finish_reason="stop").correct
    assert not grade_gsm8k("The answer is not 5. It is 7.", "5", "stop").correct  # the negated number earns nothing
    assert not grade_math("The answer is not $5$. The answer is $7$.", "5", "stop").correct
    assert grade_math("The answer is not $5$. The answer is $7$.", "7", "stop").correct


@pytest.mark.parametrize("kind,gold,reply", [
    ("gsm8k", "18", "So she earns 9 * 2 = 18 dollars. The answer is 18"),
    ("math", "\\frac{1}{2}", "Therefore the probability is \\boxed{\\frac{1}{2"),
    ("gpqa", "B", "Mercury is closest, so the answer is B"),
    ("exact", "yes", "Checking both cases, the answer is yes"),
    ("code", None, "Here:\n```python\nprint(1 + 2)\n"),
])
def test_a_reply_cut_before_its_answer_ended_earns_nothing_in_every_kind(kind, gold, reply):
    """The same text graded twice: cut at max_tokens it earns nothing; ended by itself (plus the
    code block's closing fence) it is right, so the cut alone takes the credit away."""
    meta = {"choices": ["Venus", "Mercury", "Earth", "Mars"]} if kind == "gpqa" else {}
    if kind == "code":
        meta = {"tests": [{"input": "", "output": "3\n", "testtype": "stdin"}]}
    item = Item(kind, "cut-1", kind, "q", gold or "", meta)
    cut = grade(item, reply, finish_reason="length")
    assert (cut.correct, cut.method) == (False, "truncated"), cut
    ended = reply + ("```\n" if kind == "code" else "}}" if kind == "math" else "")
    assert grade(item, ended, finish_reason="stop").correct
