"""Reasoning parsers: which part of a reply is the chain of thought (`--reasoning-parser`).

A parser splits the generated text into `reasoning` and `content`. The gateway returns the
reasoning as `reasoning_content` (the field litellm reads) and `reasoning` (vLLM's current name),
in messages and in stream deltas. Without a parser everything stays in `content`.

`--reasoning-parser auto` (the default) picks `qwen3` when the model's chat template uses
`<think>` tags and none otherwise. The policy of a request applies to the whole generation,
reasoning and answer alike: the parser only labels text after it is generated.

Parsers:
  deepseek_r1, qwen3   `<think>...</think>`: an opened block that never closes is all reasoning
                       (the model ran out of tokens while thinking); a reply holding only
                       `</think>` (templates that open the block in the prompt) splits there; a
                       reply without tags is all content.
"""

from __future__ import annotations

from cotserve.engine.textproc import THINK_OPEN, ReasoningStream, split_reasoning
from cotserve.errors import CotserveError

AUTO = "auto"
NONE = "none"


class ThinkParser:
    """`<think>...</think>` (DeepSeek-R1, Qwen3, QwQ and their distillations)."""

    name = "think"

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text)

    def stream(self) -> ReasoningStream:
        return ReasoningStream()


REASONING_PARSERS: dict[str, type[ThinkParser]] = {"deepseek_r1": ThinkParser, "qwen3": ThinkParser}


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser name to use (None: no parser). `auto` looks for think tags in the template."""
    name = (name or AUTO).strip().lower()
    if name == NONE:
        return None
    if name == AUTO:
        return "qwen3" if chat_template and THINK_OPEN in chat_template else None
    if name not in REASONING_PARSERS:
        raise CotserveError(f"unknown reasoning parser {name!r} (available: {', '.join(sorted(REASONING_PARSERS))}, "
                            f"{AUTO}, {NONE})")
    return name


def make_reasoning_parser(name: str | None) -> ThinkParser | None:
    return REASONING_PARSERS[name]() if name else None
