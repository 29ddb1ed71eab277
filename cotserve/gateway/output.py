"""From a job's events to OpenAI choices: reasoning split, tool calls, logprobs (chat and text).

One `ChatChoice` per choice index follows the generated text of that sequence, streamed
(`feed` returns each chunk's delta) or whole (`message`). Both forms agree: the stream parsers
are the twins of the whole-text parsers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from cotserve.gateway.reasoning import ThinkParser
from cotserve.gateway.tools import ToolCall, ToolParser


@dataclass
class ChatPlan:
    """What a chat request asked of its output, decided when its prompt was built."""

    n: int = 1
    reasoning: ThinkParser | None = None
    tools: ToolParser | None = None  # None: no tool parsing (no tools, or tool_choice none)
    tool_names: set[str] | None = None
    call_prefix: str = ""  # forced start of the reply (tool_choice required / named), already in the prompt
    parallel_tool_calls: bool = True  # False: only the first call is returned
    logprobs: bool = False
    top_logprobs: int = 0


class TokenText:
    """Token id -> its text piece and UTF-8 bytes, cached (logprobs name every token)."""

    def __init__(self, tokenizer):
        @lru_cache(maxsize=65536)
        def piece(tid: int) -> str:
            return tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)

        self.piece = piece

    def chat_entry(self, tid: int, lp: float, top: list[list[float]]) -> dict[str, Any]:
        tok = self.piece(tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": (t := self.piece(int(i))), "logprob": v, "bytes": list(t.encode("utf-8"))}
                                 for i, v in top]}


def chat_logprobs(tt: TokenText, ids: list[int], lps: list[list[Any]], top: int) -> dict[str, Any]:
    """OpenAI chat `logprobs` for tokens `ids` with the worker's [[logprob, [[id, logprob]...]]...]."""
    return {"content": [tt.chat_entry(t, lp, tops[:top]) for t, (lp, tops) in zip(ids, lps, strict=True)]}


def completion_logprobs(tt: TokenText, ids: list[int], lps: list[list[Any]], offset: int = 0) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tokens = [tt.piece(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{tt.piece(int(i)): v for i, v in tops} for _, tops in lps], "text_offset": offsets}


@dataclass
class ChatChoice:
    index: int
    plan: ChatPlan
    text: str = ""
    ids: list[int] = field(default_factory=list)
    lps: list[list[Any]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    calls_sent: int = 0

    def __post_init__(self) -> None:
        p = self.plan
        self._rs = p.reasoning.stream() if p.reasoning is not None else None
        self._ts = p.tools.stream(p.tool_names) if p.tools is not None else None
        if self._ts is not None and p.call_prefix:
            self._ts.feed(p.call_prefix)

    # -- whole reply --------------------------------------------------------------------------
    def add(self, ev: dict[str, Any]) -> None:
        self.text += ev.get("text", "")
        self.ids.extend(ev.get("ids", []))
        self.lps.extend(ev.get("lp", []))

    def message(self) -> tuple[dict[str, Any], str]:
        """The assistant message and the finish reason."""
        p = self.plan
        reasoning, content = p.reasoning.split(self.text) if p.reasoning is not None else (None, self.text)
        calls: list[ToolCall] = []
        out_content: str | None = content
        if p.tools is not None:
            out_content, calls = p.tools.parse(p.call_prefix + content, p.tool_names)
            calls = calls if p.parallel_tool_calls else calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": out_content}
        if reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg, self._finish(bool(calls))

    def _finish(self, called: bool) -> str:
        reason = self.finish_reason or "stop"
        return "tool_calls" if called and reason == "stop" else reason

    # -- streamed -----------------------------------------------------------------------------
    def feed(self, text: str) -> dict[str, Any]:
        """The delta for a chunk of generated text (possibly empty: text held back)."""
        r, c = self._rs.feed(text) if self._rs is not None else ("", text)
        return self._delta(r, c, final=False)

    def finish(self) -> dict[str, Any]:
        r, c = self._rs.finish() if self._rs is not None else ("", "")
        return self._delta(r, c, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        calls: list[ToolCall] = []
        if self._ts is not None:
            content, calls = self._ts.feed(content)
            if final:
                more_content, more = self._ts.finish()
                content += more_content
                calls += more
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if not self.plan.parallel_tool_calls:
            calls = calls[: max(0, 1 - self.calls_sent)]
        if calls:
            delta["tool_calls"] = []
            for c in calls:
                i = self.calls_sent
                self.calls_sent += 1
                delta["tool_calls"].append({"index": i, "id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments}})
        return delta

    def stream_finish_reason(self) -> str:
        return self._finish(self.calls_sent > 0)
