"""Tool call and reasoning parsers: the whole-text parsers (the reference) on known replies, and
the streaming parsers tested for agreement with them under every way of cutting the text."""

from __future__ import annotations

import json
import random

import pytest

from cotserve.errors import CotserveError
from cotserve.gateway.defaults import SamplingDefaults, load_defaults
from cotserve.gateway.reasoning import make_reasoning_parser, resolve_reasoning_parser
from cotserve.gateway.tools import HermesParser, ToolParser, get_tool_parser

NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

# reply -> (content, [(name, arguments)]) under the hermes parser
CASES = [
    ("Plain answer.", ("Plain answer.", [])),
    ("", ("", [])),
    (CALL, (None, [("get_weather", {"city": "Paris"})])),
    ("Let me check.\n" + CALL, ("Let me check.", [("get_weather", {"city": "Paris"})])),
    (CALL + "\n" + ADD + "\n", (None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', (None, [("add", {"a": 1, "b": 2})])),
    ('```json\n[{"name": "add", "parameters": {"a": 1}}]\n```', (None, [("add", {"a": 1})])),
    ('{"name": "add", "arguments": "{\\"a\\": 5}"}', (None, [("add", {"a": 5})])),
    ('{"name": "rm_rf", "arguments": {}}', ('{"name": "rm_rf", "arguments": {}}', [])),  # not a declared tool
    ('{"answer": 4}', ('{"answer": 4}', [])),
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": \n</tool_call>",
     ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": \n</tool_call>", [])),
    ("<tool_call>not json</tool_call> and more", ("<tool_call>not json</tool_call> and more", [])),
    (CALL + "\n<tool_call>{bad}</tool_call>", ("<tool_call>{bad}</tool_call>", [("get_weather", {"city": "Paris"})])),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', (None, [("add", {"a": 1})])),  # ended at EOS
    ("a < b and <tool_ call> is text", ("a < b and <tool_ call> is text", [])),
    ('{"x": 1} then ' + CALL, ('{"x": 1} then', [("get_weather", {"city": "Paris"})])),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,want", CASES)
def test_hermes_whole_text(text, want):
    content, calls = HermesParser().parse(text, NAMES)
    assert (content, _calls(calls)) == want
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)


def _stream(parser, text, cuts):
    st = parser.stream(NAMES)
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for p in pieces:
        c, k = st.feed(p)
        content, calls = content + c, calls + k
    c, k = st.finish()
    return content + c, calls + k


@pytest.mark.parametrize("parser", [HermesParser(), ToolParser()], ids=["hermes", "json"])
@pytest.mark.parametrize("text", [t for t, _ in CASES])
def test_stream_agrees_with_whole_text(parser, text):
    want_content, want_calls = parser.parse(text, NAMES)
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), []] + [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k)))
                                                 for k in (1, 3, 8) for _ in range(3) if len(text) > 1]
    for cuts in splits:
        content, calls = _stream(parser, text, cuts)
        assert content.strip() == (want_content or "").strip(), cuts
        assert _calls(calls) == _calls(want_calls), cuts


def test_stream_holds_only_a_possible_tag():
    st = HermesParser().stream(NAMES)
    assert st.feed("Sure <tool") == ("Sure ", [])
    assert st.feed("box> x") == ("<toolbox> x", [])


def test_json_parser_ignores_tags_and_call_prefixes():
    assert ToolParser().parse(CALL, NAMES) == (CALL, [])
    assert get_tool_parser("hermes").call_prefix("add") == '<tool_call>\n{"name": "add", "arguments": '
    assert get_tool_parser("json").call_prefix(None) == '{"name": "'
    with pytest.raises(CotserveError, match="unknown tool call parser"):
        get_tool_parser("mistral9")


def test_reasoning_parser_selection():
    assert resolve_reasoning_parser("auto", "{{ '<think>\\n' }}") == "qwen3"
    assert resolve_reasoning_parser("auto", "no tags here") is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("none", "<think>") is None
    assert resolve_reasoning_parser("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(CotserveError, match="unknown reasoning parser"):
        resolve_reasoning_parser("o1", None)
    p = make_reasoning_parser("deepseek_r1")
    assert p.split("<think>\nhm\n</think>\n\nYes.") == ("hm", "Yes.")
    assert p.split("hm</think>Yes.") == ("hm", "Yes.")  # the template opened the block
    assert make_reasoning_parser(None) is None


def test_generation_config_modes(tmp_path):
    base = SamplingDefaults(temperature=1.0)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "do_sample": true}')
    auto = load_defaults("auto", tmp_path, base)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.max_tokens, auto.source) == (0.6, 0.95, 0, None, "model")
    assert load_defaults("vllm", tmp_path, base).temperature == 1.0
    assert load_defaults("auto", tmp_path / "empty", base).source == "server"  # no file: the server's
    assert load_defaults(str(tmp_path / "generation_config.json"), None, base).top_p == 0.95
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text("{nope")
    with pytest.raises(CotserveError, match="cannot parse"):
        load_defaults(str(tmp_path / "bad"), None, base)
    with pytest.raises(CotserveError, match="no such file"):
        load_defaults(str(tmp_path / "missing"), None, base)
