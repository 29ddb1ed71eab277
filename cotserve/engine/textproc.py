"""Text side of decoding: incremental detokenization, stop strings, <think> splitting."""

from __future__ import annotations

from dataclasses import dataclass, field


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids for chat messages: the tokenizer's chat template with the generation
    prompt added (and `tools`, for templates that render them; `template_kwargs`: extra template
    variables, e.g. enable_thinking), or the contents joined by newlines when the model has no
    template."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **kwargs)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    return tokenizer.encode("\n".join(m.get("content") or "" for m in messages))


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids.

    Decoding token by token breaks multi-byte characters (a UTF-8 character split over byte
    tokens) and merged tokens (leading-space rules), so each step decodes a short window
    `ids[prefix:]` and compares it with `ids[prefix:read]`: the new text is the difference,
    held back while it ends in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full_text = self._decode(self.ids[self.prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        new = full_text[len(prefix_text) :]
        self.prefix = self.read
        self.read = len(self.ids)
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full_text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


@dataclass
class StopStringMatcher:
    """Cuts the output at the first stop string, even when it spans several tokens.

    Text that could still be the start of a stop string is held back from the stream until
    it is known not to be one, so a client never sees a partial stop string."""

    stops: list[str] = field(default_factory=list)
    text: str = ""  # everything accepted so far (stop string excluded once stopped)
    emitted: int = 0
    stopped: bool = False

    def feed(self, delta: str) -> str:
        """Add decoded text; return the part that is safe to emit now."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        if self.stops:
            hits = [(i, s) for s in self.stops if s and (i := self.text.find(s, start)) >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                self.text = self.text[:cut]
                self.stopped = True
                return self._emit(len(self.text))
        hold = self._partial_suffix()
        return self._emit(len(self.text) - hold)

    def finish(self) -> str:
        """End of generation: release what was held back."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split `<think>...</think>` off a finished reply: (reasoning or None, content).

    A reply that opens a think block but never closes it is all reasoning (the model ran out of
    tokens while thinking). Some chat templates open the block in the prompt, so a reply holding
    only `</think>` also splits there."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        body = stripped[len(THINK_OPEN) :]
        if THINK_CLOSE in body:
            reasoning, _, content = body.partition(THINK_CLOSE)
            return reasoning.strip("\n"), content.lstrip("\n")
        return body.strip("\n"), ""
    if THINK_CLOSE in text and THINK_OPEN not in text:
        reasoning, _, content = text.partition(THINK_CLOSE)
        return reasoning.strip("\n"), content.lstrip("\n")
    return None, text


class ReasoningStream:
    """Streaming twin of `split_reasoning`: routes deltas to reasoning or content, holding back
    only text that may be a partial tag."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "start"  # start -> thinking -> after_think -> content, or start -> content

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf = s[len(THINK_OPEN) :].lstrip("\n")
                    self.state = "thinking"
                    continue
                if s and not THINK_OPEN.startswith(s[: len(THINK_OPEN)]):
                    self.state = "content"
                    continue
                return reasoning, content  # undecided: may still become <think>
            if self.state == "thinking":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(THINK_CLOSE) :]
                    self.state = "after_think"
                    continue
                keep = _partial_tag(self.buf, THINK_CLOSE)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                return reasoning, content
            if self.state == "after_think":  # newlines right after </think> belong to neither part
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return reasoning, content
                self.state = "content"
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "thinking" else ("", rest)


def _partial_tag(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
