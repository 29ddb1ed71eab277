"""Prompts, one user message per item, as the reasoning-model evaluations use them.

- math / gsm8k / exact: the DeepSeek-R1 / Qwen2.5-Math instruction, final answer in `\\boxed{}`.
- gpqa: simple-evals' multiple-choice template (the last line is `Answer: LETTER`).
- code: LiveCodeBench's generation prompt (a fenced ```python block; starter code included for
  LeetCode-style functional problems, stdin/stdout instructions otherwise).
"""

from __future__ import annotations

from cotserve.eval.loaders import LETTERS, Item

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."

GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of the "
    "following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by "
    "step before answering.\n\n{question}\n\n{options}"
)

CODE_HEAD = (
    "You will be given a question (problem specification) and will generate a correct Python program "
    "that matches the specification and passes all tests.\n\nQuestion: {question}\n\n"
)
CODE_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your "
    "code within delimiters.\n```python\n{starter}\n```\n"
)
CODE_STDIN = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
    "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
    "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
    "```python\n# YOUR CODE HERE\n```\n"
)


def build_prompt(item: Item) -> str:
    if item.kind in ("math", "gsm8k", "exact"):
        return f"{item.question.strip()}\n{MATH_SUFFIX}"
    if item.kind == "gpqa":
        options = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(item.meta["choices"]))
        return GPQA_TEMPLATE.format(question=item.question.strip(), options=options)
    if item.kind == "code":
        head = CODE_HEAD.format(question=item.question.strip())
        starter = (item.meta.get("starter_code") or "").rstrip()
        return head + (CODE_STARTER.format(starter=starter) if starter else CODE_STDIN)
    raise ValueError(f"no prompt for kind {item.kind!r}")
