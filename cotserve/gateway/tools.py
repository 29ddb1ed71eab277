"""Tool calling: the tools in the prompt, and tool calls parsed out of the reply (`--tool-call-parser`).

Prompt side. When the model's chat template knows tools (its source mentions `tools`), the
request's tools go to the template as `tools=[...]` and the history's assistant `tool_calls` and
`role: "tool"` messages go to it as they are (arguments as objects, as Hugging Face templates
expect). A template without tool support gets the documented fallback: a system message that lists
the tools and asks for Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
output, past calls written back as that text, and tool results sent as user messages wrapped in
`<tool_response>` tags.

`tool_choice`: `auto` (the default with tools) lets the model choose; `none` leaves the tools out
of the prompt and parses nothing; `required` and a named function start the assistant's reply with
the parser's call prefix (e.g. `<tool_call>\n{"name": "get_weather", "arguments": `), so the model
continues a call instead of choosing whether to make one (no grammar-constrained decoding: a reply
that still is not a valid call comes back as content).

Reply side. A parser turns the generated text into (content, calls). A reply, or a tagged block
of it, that is not a valid call (bad JSON, no name, a name not among the request's tools) stays
content: malformed output is never an error. Parsers:

  hermes  `<tool_call>{...}</tool_call>` blocks (Qwen2.5/Qwen3, Hermes, many fine-tunes); a reply
          without tags that is exactly a JSON call (or a list of them, optionally in a ```json
          fence) is parsed by the JSON fallback.
  json    only the JSON form: the whole reply is `{"name": ..., "arguments": {...}}` or a list.

Streaming: content passes through as it comes, except text that may be the start of a call tag
(held back until it is known not to be one) and, for the JSON form, a reply that starts with `{`,
`[` or a code fence (held to the end, then a call or content). A call is sent as soon as its block
closes, as one OpenAI `delta.tool_calls` fragment holding its index, id, name and whole arguments
(clients that concatenate argument fragments get the same JSON).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import CotserveError

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)

FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_object(obj: Any, names: set[str] | None) -> ToolCall | None:
    """A call from a parsed JSON object {"name": ..., "arguments"|"parameters": {...}}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_json_calls(text: str, names: set[str] | None) -> list[ToolCall] | None:
    """The whole text as one JSON call or a list of calls (optionally fenced); None if it is not."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1)
    if not s or s[0] not in "{[":
        return None
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [call_from_object(o, names) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class ToolParser:
    """Base: the JSON form only."""

    name = "json"

    def call_prefix(self, function: str | None) -> str:
        """Text that starts a call (of `function`, or of any tool when None)."""
        if function is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(function) + ', "arguments": '

    def parse(self, text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall]]:
        calls = parse_json_calls(text, names)
        return (None, calls) if calls else (text, [])

    def stream(self, names: set[str] | None) -> ToolStream:
        return ToolStream(self, names, tags=False)


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks, with the JSON form as a fallback."""

    name = "hermes"

    def call_prefix(self, function: str | None) -> str:
        return OPEN + "\n" + super().call_prefix(function)

    def stream(self, names: set[str] | None) -> ToolStream:
        return ToolStream(self, names, tags=True)

    def parse(self, text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall]]:
        if OPEN not in text:
            return super().parse(text, names)
        parts = text.split(OPEN)
        outside = [parts[0]]
        calls: list[ToolCall] = []
        for block in parts[1:]:
            body, closed, after = block.partition(CLOSE)
            found = parse_json_calls(body, names)
            if found and len(found) == 1:
                calls.extend(found)
            else:  # not a valid call: the block stays content, as written
                outside.append(OPEN + body + closed)
            if not calls or after.strip():  # whitespace between or after calls is not content
                outside.append(after)
        content = "".join(outside)
        return (content.strip() or None) if calls else content, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "json": ToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise CotserveError(f"unknown tool call parser {name!r} (available: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()


class ToolStream:
    """Streaming twin of a parser's `parse`: feed content deltas, get (content, calls) to send."""

    def __init__(self, parser: ToolParser, names: set[str] | None, tags: bool):
        self.parser = parser
        self.names = names
        self.tags = tags
        self.buf = ""
        self.state = "start"  # start -> content | call | json
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        content, calls = "", []
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if not s:
                    return content, calls
                if s[0] in "{[`":
                    self.state = "json"
                elif self.tags and OPEN.startswith(s[: len(OPEN)]) and len(s) < len(OPEN):
                    return content, calls  # may still become a tag
                else:
                    self.state = "content"
                continue
            if self.state == "json":
                return content, calls  # decided at the end
            if self.state == "content":
                i = self.buf.find(OPEN) if self.tags else -1
                if i >= 0:
                    content += self._content(self.buf[:i])
                    self.buf = self.buf[i + len(OPEN):]
                    self.state = "call"
                    continue
                keep = _partial(self.buf, OPEN) if self.tags else 0
                content += self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return content, calls
            # inside a call block
            j = self.buf.find(CLOSE)
            if j < 0:
                return content, calls
            body, self.buf = self.buf[:j], self.buf[j + len(CLOSE):]
            found = parse_json_calls(body, self.names)
            if found and len(found) == 1:
                calls.extend(found)
                self.calls += 1
            else:
                content += OPEN + body + CLOSE
            self.state = "content"

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""
        if self.state == "json":
            found = parse_json_calls(rest, self.names)
            if found:
                self.calls += len(found)
                return "", found
            if self.tags and OPEN in rest:  # not one JSON call: read it as text with tagged calls
                self.state = "content"
                content, calls = self.feed(rest)
                more, more_calls = self.finish()
                return content + more, calls + more_calls
            return rest, []
        if self.state == "call":  # the reply ended inside a block (e.g. at end-of-sequence)
            found = parse_json_calls(rest, self.names)
            if found and len(found) == 1:
                self.calls += 1
                return "", found
            return OPEN + rest, []
        return self._content(rest), []

    def _content(self, text: str) -> str:
        """Whitespace between or after calls is not content."""
        return "" if self.calls and not text.strip() else text


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# -- prompt side ------------------------------------------------------------------------------
def template_supports_tools(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "tool_use" in tpl or any("tools" in t for t in tpl.values())
    return bool(tpl) and "tools" in tpl


def _arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        obj = json.loads(arguments)
    except ValueError:
        return arguments
    return obj if isinstance(obj, dict) else arguments


def native_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History for a template with tool support: call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments_object(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def fallback_history(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """History for a template without tool support: tools in a system message, calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": _arguments_object(c["function"]["arguments"])},
                                               ensure_ascii=False) + "\n" + CLOSE for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listing = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
