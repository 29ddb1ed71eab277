"""What agent frameworks need from the endpoint: tool calls, reasoning fields, text completions,
n choices, logprobs, the model's own sampling defaults.

The server is `cotserve serve`'s wiring (`gateway_settings` + `create_app` + a worker) on a small
random-weight Qwen2 model built here, whose chat template renders tools as Qwen2.5's does (the
bundled model's template has none). A random model does not write tool calls, so a TEST-ONLY
logits hook (`NativeEngine.logits_hook`) forces known reply text for prompts that carry a script
marker; every other prompt decodes the model's own logits. Clients: the openai SDK, litellm, httpx.
One test starts the real `cotserve serve` command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams

MODEL = "tiny-qwen"

QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# marker in the prompt -> reply text the hook forces (checked in this order: the most specific first)
SCRIPTS = [
    ("21 degrees", "It is 21 degrees and sunny in Paris."),
    ("[named]", '{"city": "Lyon"}}\n</tool_call>'),  # continues the forced call prefix
    ("[required]", 'get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'),
    ("[malformed]", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),
    ("[two]", CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")),
    ("[think]", "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"),
    ("weather", "Let me check. " + CALL_TEXT),
]


def wait_for(pred, timeout=120.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, loaded):
    """A random-weight Qwen2 model with the bundled tokenizer and a tools chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen")
    tok = AutoTokenizer.from_pretrained(str(loaded.path))  # a copy: the shared fixture's stays as it is
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.chat_template = None
    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "temperature": 0.6, "top_p": 0.95,
         "top_k": 20}))
    return path


class ScriptHook:
    """TEST-ONLY logits hook: forces SCRIPTS' reply (then end-of-sequence) for prompts holding a marker."""

    def __init__(self, tokenizer, eos: int):
        self.tok = tokenizer
        self.eos = eos
        self.prompts: list[str] = []
        self._batch = None
        self._plans: dict[int, list[int] | None] = {}

    def plan(self, batch, i: int) -> list[int] | None:
        if batch is not self._batch:  # batches run one after the other on the worker's thread
            self._batch, self._plans = batch, {}
        if i not in self._plans:
            prompt = self.tok.decode(batch.tokens[i][: int(batch.prompt_lens[i])])
            self.prompts.append(prompt)
            turns = prompt.rsplit("<|im_start|>", 2)
            last_turn = turns[-2] if len(turns) > 1 else turns[0]  # the newest user / tool turn
            reply = next((r for m, r in SCRIPTS if m in last_turn), None)
            self._plans[i] = None if reply is None else self.tok.encode(reply, add_special_tokens=False) + [self.eos]
        return self._plans[i]

    def __call__(self, batch, logits: torch.Tensor) -> torch.Tensor:
        for i in range(logits.shape[0]):
            ids = self.plan(batch, i)
            if ids is None:
                continue
            step = len(batch.tokens[i]) - int(batch.prompt_lens[i])
            logits[i] = -30.0
            logits[i, ids[min(step, len(ids) - 1)]] = 30.0
        return logits


class Stack:
    """One queue + one worker on the tiny engine, and several gateways (serve's wiring) on it."""

    def __init__(self, tiny_dir):
        from cotserve.engine.native import NativeEngine
        from cotserve.models import load_model
        from cotserve.queue import InProcessQueue
        from cotserve.worker import Worker

        self.engine = NativeEngine(load_model(str(tiny_dir), device="cpu", dtype="float32"), max_batch=8)
        self.hook = ScriptHook(self.engine.tokenizer, min(self.engine.eos_ids))
        self.engine.logits_hook = self.hook
        self.queue = InProcessQueue()
        self.worker = Worker(self.engine, self.queue, worker_id="w-agent", max_batch=8)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()
        self.servers = []

    def gateway(self, tiny_dir, **serve_opts) -> str:
        from support import ServerThread

        from cotserve.gateway.app import PromptBuilder, create_app
        from cotserve.gateway.server import ServeArgs, gateway_settings
        from cotserve.worker import EngineArgs

        args = ServeArgs(served_model_name=MODEL, **serve_opts)
        prompts = PromptBuilder.from_model(str(tiny_dir), args.max_model_len)
        app = create_app(gateway_settings(args, EngineArgs(model=str(tiny_dir)), prompts), self.queue, prompts)
        srv = ServerThread(app)
        url = srv.start()
        self.servers.append(srv)
        wait_for(lambda: httpx.get(url + "/ready").status_code == 200, what="ready")
        return url

    def close(self):
        for s in self.servers:
            s.stop()
        self.worker.stop()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def stack(tiny_dir):
    s = Stack(tiny_dir)
    s.urls = {"think": s.gateway(tiny_dir, reasoning_parser="qwen3"),
              "plain": s.gateway(tiny_dir),  # auto: this template has no think tags -> no parser
              "short": s.gateway(tiny_dir, max_model_len=96, generation_config="vllm")}
    yield s
    s.close()


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def user(text):
    return [{"role": "user", "content": text}]


# -- tool calls ------------------------------------------------------------------------------------
def _round_trip_messages(first_message_tool_calls, content=None):
    return [*user("What is the weather in Paris?"),
            {"role": "assistant", "content": content, "tool_calls": first_message_tool_calls},
            {"role": "tool", "tool_call_id": first_message_tool_calls[0]["id"], "content": '{"temp": "21 degrees"}'}]


def test_tool_round_trip_openai_sdk(stack):
    c = client(stack.urls["plain"])
    r = c.chat.completions.create(model=MODEL, messages=user("What is the weather in Paris?"), tools=[WEATHER],
                                  temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools reached the prompt through the model's template
    assert '"name": "get_weather"' in stack.hook.prompts[-1] and "<tools>" in stack.hook.prompts[-1]

    calls = [tc.model_dump() for tc in ch.message.tool_calls]
    r2 = c.chat.completions.create(model=MODEL, messages=_round_trip_messages(calls, ch.message.content),
                                   tools=[WEATHER], temperature=0)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content == "It is 21 degrees and sunny in Paris."
    prompt = stack.hook.prompts[-1]  # the history went through the template: call as text, result as a tool turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": "21 degrees"}\n</tool_response>' in prompt


def test_tool_round_trip_streamed_openai_sdk(stack):
    c = client(stack.urls["plain"])
    chunks = list(c.chat.completions.create(model=MODEL, messages=user("What is the weather in Paris?"),
                                            tools=[WEATHER], temperature=0, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    frags = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert content == "Let me check. " and finishes == ["tool_calls"]
    assert [f.index for f in frags] == [0] and frags[0].function.name == "get_weather"
    args = "".join(f.function.arguments or "" for f in frags)
    assert json.loads(args) == {"city": "Paris"}
    calls = [{"id": frags[0].id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]
    chunks2 = list(c.chat.completions.create(model=MODEL, messages=_round_trip_messages(calls), tools=[WEATHER],
                                             temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks2 if ch.choices) == \
        "It is 21 degrees and sunny in Paris."


def test_tool_round_trip_litellm(stack):
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=stack.urls["plain"] + "/v1", api_key="unused", tools=[WEATHER],
              temperature=0)
    r = litellm.completion(messages=user("What is the weather in Paris?"), **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    calls = [{"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]
    r2 = litellm.completion(messages=_round_trip_messages(calls), **kw)
    assert r2.choices[0].message.content == "It is 21 degrees and sunny in Paris."

    parts = list(litellm.completion(messages=user("What is the weather in Paris?"), stream=True, **kw))
    built = litellm.stream_chunk_builder(parts, messages=user("What is the weather in Paris?"))
    (call,) = built.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert built.choices[0].finish_reason == "tool_calls"
    parts2 = litellm.completion(messages=_round_trip_messages(calls), stream=True, **kw)
    assert "".join(p.choices[0].delta.content or "" for p in parts2) == "It is 21 degrees and sunny in Paris."


def test_malformed_call_is_content(stack):
    c = client(stack.urls["plain"])
    want = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    r = c.chat.completions.create(model=MODEL, messages=user("Weather? [malformed]"), tools=[WEATHER],
                                  temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=MODEL, messages=user("Weather? [malformed]"), tools=[WEATHER],
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)


def test_tool_choice_named_required_and_none(stack):
    c = client(stack.urls["plain"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=user("Pick a city [named]"), tools=[WEATHER],
                                  tool_choice=named, temperature=0)
    assert stack.hook.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Lyon"} and r.choices[0].finish_reason == "tool_calls"
    chunks = list(c.chat.completions.create(model=MODEL, messages=user("Pick a city [required]"), tools=[WEATHER],
                                            tool_choice="required", temperature=0, stream=True))
    frags = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert frags[0].function.name == "get_weather" and json.loads(frags[0].function.arguments) == {"city": "Nice"}
    # none: the tools stay out of the prompt and a call-looking reply stays content
    r = c.chat.completions.create(model=MODEL, messages=user("What is the weather in Paris?"), tools=[WEATHER],
                                  tool_choice="none", temperature=0)
    assert "<tools>" not in stack.hook.prompts[-1]
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "Let me check. " + CALL_TEXT
    bad = httpx.post(stack.urls["plain"] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": user("x"), "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_parallel_tool_calls(stack):
    c = client(stack.urls["plain"])
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        r = c.chat.completions.create(model=MODEL, messages=user("Two cities [two]"), tools=[WEATHER],
                                      temperature=0, parallel_tool_calls=parallel)
        assert [json.loads(t.function.arguments)["city"] for t in r.choices[0].message.tool_calls] == cities
        chunks = list(c.chat.completions.create(model=MODEL, messages=user("Two cities [two]"), tools=[WEATHER],
                                                temperature=0, parallel_tool_calls=parallel, stream=True))
        frags = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(f.index, json.loads(f.function.arguments)["city"]) for f in frags] == list(enumerate(cities))
        assert len({f.id for f in frags}) == len(cities)


# -- reasoning ------------------------------------------------------------------------------------
def test_reasoning_parser_on_and_off(stack):
    whole = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"
    on = client(stack.urls["think"]).chat.completions.create(model=MODEL, messages=user("Hi [think]"),
                                                             temperature=0)
    msg = on.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "The user greets me.\nI greet back."
    off = client(stack.urls["plain"]).chat.completions.create(model=MODEL, messages=user("Hi [think]"),
                                                              temperature=0)
    assert off.choices[0].message.content == whole
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})

    chunks = list(client(stack.urls["think"]).chat.completions.create(
        model=MODEL, messages=user("Hi [think]"), temperature=0, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas).strip("\n") == \
        "The user greets me.\nI greet back."
    assert all((d.model_extra or {}).get("reasoning") == (d.model_extra or {}).get("reasoning_content")
               for d in deltas)

    import litellm

    r = litellm.completion(model=f"openai/{MODEL}", api_base=stack.urls["think"] + "/v1", api_key="unused",
                           messages=user("Hi [think]"), temperature=0)
    assert r.choices[0].message.reasoning_content == "The user greets me.\nI greet back."
    assert r.choices[0].message.content == "Hello there!"


# -- completions, n, logprobs, defaults ----------------------------------------------------------
def _greedy(engine, ids, n, **kw):
    (res,) = engine.generate([GenRequest(list(ids), SamplingParams(max_tokens=n, **kw), record_logprobs=True)])
    return res


def test_completions_plain_and_streamed_through_litellm(stack):
    import litellm

    prompt = "The capital of France is"
    ids = stack.engine.tokenizer.encode(prompt)
    want = _greedy(stack.engine, ids, 12).text
    kw = dict(model=f"text-completion-openai/{MODEL}", api_base=stack.urls["plain"] + "/v1", api_key="unused",
              prompt=prompt, max_tokens=12, temperature=0)
    r = litellm.text_completion(**kw)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    parts = list(litellm.text_completion(stream=True, **kw))
    assert "".join(p.choices[0].text or "" for p in parts if p.choices) == want
    # token ids as the prompt; the openai SDK's stream with a stop string
    c = client(stack.urls["plain"])
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text == want
    stop = want[len(want) // 2: len(want) // 2 + 3]
    cut = "".join(p.choices[0].text for p in c.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                   temperature=0, stop=[stop], stream=True)
                  if p.choices)
    assert cut == want[: want.index(stop)]
    for bad, param in (({"echo": True}, "echo"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [10**9]}, "prompt")):
        resp = httpx.post(stack.urls["plain"] + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_n_three_choices_share_the_prefill(stack):
    c = client(stack.urls["plain"])
    r = c.chat.completions.create(model=MODEL, messages=user("Tell me a story."), n=3, max_tokens=8,
                                  temperature=1.0, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) > 1  # seeds 7, 8, 9: distinct samples
    assert r.model_extra["cotserve"]["prefill_rows"] == 1 and r.model_extra["cotserve"]["batch_size"] == 3
    assert 3 <= r.usage.completion_tokens <= 24 and len(r.model_extra["cotserve"]["choices"]) == 3
    # the same request again gives the same three samples (seeded)
    r2 = c.chat.completions.create(model=MODEL, messages=user("Tell me a story."), n=3, max_tokens=8,
                                   temperature=1.0, seed=7)
    assert [ch.message.content for ch in r2.choices] == [ch.message.content for ch in r.choices]
    chunks = list(c.chat.completions.create(model=MODEL, messages=user("Tell me a story."), n=3, max_tokens=8,
                                            temperature=1.0, seed=7, stream=True))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in range(3)]
    assert texts == [ch.message.content for ch in r.choices]
    cr = c.completions.create(model=MODEL, prompt="Once upon a time", n=3, max_tokens=6, temperature=0)
    assert len(cr.choices) == 3 and len({ch.text for ch in cr.choices}) == 1  # greedy copies agree


def test_shared_prefill_matches_separate_prefills(stack):
    """n copies decoded from one shared prefill give what one request alone gives (greedy)."""
    eng = stack.engine
    ids = eng.tokenizer.encode("Shared prefill check")
    alone = _greedy(eng, ids, 10, ignore_eos=True)
    reqs = [GenRequest(list(ids), SamplingParams(max_tokens=10, ignore_eos=True)) for _ in range(3)]
    other = GenRequest(eng.tokenizer.encode("Another prompt here"), SamplingParams(max_tokens=10, ignore_eos=True))
    res = eng.generate([*reqs, other])
    assert all(r.token_ids == alone.token_ids for r in res[:3])
    assert res[0].telemetry["prefill_rows"] == 2 and alone.telemetry["prefill_rows"] == 1


def test_logprobs_match_the_engine(stack):
    eng = stack.engine
    c = client(stack.urls["plain"])
    r = c.chat.completions.create(model=MODEL, messages=user("Count with me"), max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=5)
    ids = eng.apply_chat_template(user("Count with me"))
    ref = _greedy(eng, ids, 6)
    content = r.choices[0].logprobs.content
    assert len(content) == ref.completion_tokens
    rows = ref.logprobs.float()  # [steps, V] log-softmax of the engine's logits, stored as float16 (hence rel=1e-3)
    for step, entry in enumerate(content):
        tok = ref.token_ids[step]
        assert entry.token == eng.tokenizer.decode([tok], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(float(rows[step, tok]), rel=1e-3, abs=2e-3)
        top = torch.topk(rows[step], 5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), rel=1e-3, abs=2e-3)
        assert entry.top_logprobs[0].token == eng.tokenizer.decode([int(top.indices[0])], skip_special_tokens=False)
    cr = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = cr.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([float(rows[i, t]) for i, t in enumerate(ref.token_ids)], rel=1e-3, abs=2e-3)
    assert all(len(d) <= 3 for d in lp.top_logprobs) and lp.text_offset[0] == 0


def test_generation_config_and_context_defaults(stack, tiny_dir):
    from cotserve.errors import CotserveError
    from cotserve.gateway.app import PromptBuilder
    from cotserve.gateway.server import ServeArgs, gateway_settings
    from cotserve.worker import EngineArgs

    v = httpx.get(stack.urls["plain"] + "/version").json()
    assert v["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": None}
    assert v["max_model_len"] == 1024 and v["reasoning_parser"] is None and v["tool_call_parser"] == "hermes"
    assert httpx.get(stack.urls["think"] + "/version").json()["reasoning_parser"] == "qwen3"
    short = httpx.get(stack.urls["short"] + "/version").json()
    assert short["sampling_defaults"]["temperature"] == 1.0 and short["max_model_len"] == 96
    prompts = PromptBuilder.from_model(str(tiny_dir))
    other = tiny_dir.parent / "genconf"
    other.mkdir(exist_ok=True)
    (other / "generation_config.json").write_text('{"temperature": 0.3, "max_new_tokens": 50}')
    s = gateway_settings(ServeArgs(generation_config=str(other)), EngineArgs(model=str(tiny_dir)), prompts)
    assert (s.default_temperature, s.default_top_p, s.default_max_tokens) == (0.3, 1.0, 50)
    with pytest.raises(CotserveError, match="no such file"):
        gateway_settings(ServeArgs(generation_config=str(tiny_dir / "nope")), EngineArgs(), prompts)
    with pytest.raises(CotserveError, match="unknown reasoning parser"):
        gateway_settings(ServeArgs(reasoning_parser="nope"), EngineArgs(), prompts)
    # no max_tokens: generation runs to the end of the (capped) context
    r = client(stack.urls["short"]).chat.completions.create(
        model=MODEL, messages=user("Go on"), temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 96 and r.choices[0].finish_reason == "length"
    too_long = httpx.post(stack.urls["short"] + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "word " * 200})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_detokenize(stack):
    url = stack.urls["plain"]
    tok = stack.engine.tokenizer
    t = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert t["tokens"] == tok.encode("Hello world") and t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    chat = httpx.post(url + "/tokenize", json={"messages": user("Hi"), "tools": [WEATHER]}).json()
    assert "<tools>" in tok.decode(chat["tokens"]) and chat["count"] == len(chat["tokens"])
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    assert httpx.post(url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400


def test_template_without_tools_gets_the_fallback(engine):
    """The bundled model's template has no tools: they go into a system message, calls and
    results into text the template can render."""
    from cotserve.gateway.app import PromptBuilder

    pb = PromptBuilder(engine.tokenizer, engine.info.max_positions)
    assert not pb.native_tools
    msgs = [*user("Weather in Paris?"),
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}]
    text = engine.tokenizer.decode(pb.encode(msgs, [WEATHER]))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response>" in text


def test_cotserve_serve_command(tiny_dir, tmp_path):
    """The real command: parsers and limits from its options, tools rendered, completions served."""
    from support import free_port

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "serve", "--model", str(tiny_dir), "--port",
                             str(port), "--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1",
                             "--tool-call-parser", "json", "--max-model-len", "200", "--threads", "1",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or httpx.get(url + "/ready").status_code == 200, timeout=240,
                 what="cotserve serve")
        assert proc.poll() is None, proc.stdout.read().decode()
        v = httpx.get(url + "/version").json()
        assert (v["reasoning_parser"], v["tool_call_parser"], v["max_model_len"]) == ("deepseek_r1", "json", 200)
        r = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("stop", "length")
        r = client(url).chat.completions.create(model=MODEL, messages=user("Hi"), tools=[WEATHER], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "--model", str(tiny_dir), "--port", "1",
                          "--tool-call-parser", "nope"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown tool call parser" in bad.stderr
