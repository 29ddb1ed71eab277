"""Prometheus metrics of one worker (own registry; every series carries the `worker_id` label).

`cotserve worker --metrics-port PORT` serves them on http://HOST:PORT/metrics. They are what the
worker sees of the requests it decodes: finished requests by finish reason, prompt and generated
tokens, time to first token (enqueue to the first published token), inter-token latency (per
sequence, between published tokens), token lengths, decode tok/s and the per-request ratios a
policy reports (retained, slow-step, skip, padding), by policy. The gateway's own metrics
(`gateway/metrics.py`) share the buckets and ratio keys defined here. No torch: the gateway
imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
# chains of thought run long: token lengths up to the longest contexts served
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TOK_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
# telemetry keys in [0, 1] whose distribution per policy is worth a histogram
RATIO_KEYS = ("retained_ratio", "sfi_retained_ratio", "sfi_slow_step_ratio", "sinkrouter_skip_ratio",
              "padding_fraction")


class WorkerMetrics:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.registry = r = CollectorRegistry()
        w = ["worker_id"]
        wp = ["worker_id", "policy"]
        self.requests = Counter("cotserve_worker_requests", "Finished requests by finish reason (error: refused "
                                "or failed)", ["worker_id", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("cotserve_worker_prompt_tokens", "Prompt tokens of finished requests", w,
                                     registry=r)
        self.generated_tokens = Counter("cotserve_worker_generated_tokens", "Generated tokens published to the "
                                        "queue", w, registry=r)
        self.running = Gauge("cotserve_worker_requests_running", "Requests being decoded", w, registry=r)
        self.queue_wait = Histogram("cotserve_worker_queue_wait_seconds", "Enqueue to claim", w, registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("cotserve_worker_time_to_first_token_seconds", "Enqueue to the first published "
                              "token", w, registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("cotserve_worker_inter_token_latency_seconds", "Time between a sequence's "
                             "published tokens", w, registry=r, buckets=ITL_BUCKETS)
        self.prompt_len = Histogram("cotserve_worker_request_prompt_tokens", "Prompt tokens per request", wp,
                                    registry=r, buckets=TOKEN_BUCKETS)
        self.gen_len = Histogram("cotserve_worker_request_generation_tokens", "Generated tokens per request", wp,
                                 registry=r, buckets=TOKEN_BUCKETS)
        self.decode_tok_s = Histogram("cotserve_worker_decode_tokens_per_second", "Decode tok/s per request", wp,
                                      registry=r, buckets=TOK_S_BUCKETS)
        self.ratios = Histogram("cotserve_worker_policy_ratio", "Per-request ratios a policy reports (retained, "
                                "slow-step, skip, padding)", ["worker_id", "policy", "key"], registry=r,
                                buckets=RATIO_BUCKETS)
        self.engine_failures = Counter("cotserve_worker_engine_failures", "Times the worker's engine died (each "
                                       "followed by a restart or the worker's exit)", w, registry=r).labels(worker_id)
        self._itl = self.itl.labels(worker_id)
        self._generated = self.generated_tokens.labels(worker_id)

    def track_vllm(self, stats: Callable[[], dict[str, float] | None], model_name: str) -> None:
        """vLLM's KV and scheduler metrics under vLLM's names (`vllm:kv_cache_usage_perc`,
        `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
        labelled model_name), read from `stats()` (the engine's `KVCapacity.vllm_stats`) at every
        scrape; nothing while it returns None (not a vLLM engine)."""
        self.registry.register(_VLLMCollector(stats, model_name))

    def track_running(self, count: Callable[[], float]) -> None:
        """The running-requests gauge reads `count()` at every scrape."""
        self.running.labels(self.worker_id).set_function(count)

    def tokens(self, n: int, gap_s: float | None) -> None:
        """`n` tokens of one sequence published, `gap_s` after its previous ones (None: its first)."""
        self._generated.inc(n)
        if gap_s is not None and n > 0:
            gap = max(0.0, gap_s) / n
            for _ in range(n):
                self._itl.observe(gap)

    def finished(self, finish_reason: str, policy: str, prompt_tokens: int, generated_tokens: int,
                 ttft_s: float | None, queue_wait_s: float | None, telemetry: dict[str, Any]) -> None:
        """One finished request (done, cancelled or failed)."""
        wid = self.worker_id
        policy = str(telemetry.get("policy", policy))
        self.requests.labels(wid, finish_reason).inc()
        self.prompt_tokens.labels(wid).inc(prompt_tokens)
        if queue_wait_s is not None:
            self.queue_wait.labels(wid).observe(queue_wait_s)
        if ttft_s is not None:
            self.ttft.labels(wid).observe(ttft_s)
        if finish_reason == "error":
            return
        self.prompt_len.labels(wid, policy).observe(prompt_tokens)
        self.gen_len.labels(wid, policy).observe(generated_tokens)
        if telemetry.get("decode_tok_s"):
            self.decode_tok_s.labels(wid, policy).observe(float(telemetry["decode_tok_s"]))
        for key in RATIO_KEYS:
            v = telemetry.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.ratios.labels(wid, policy, key).observe(float(v))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VLLMCollector:
    """A scrape-time view of a vLLM engine's counters (they live in the engine's stat logger)."""

    HELP = {"kv_cache_usage_perc": "KV-cache usage (1 = full)", "num_preemptions": "Preemptions",
            "prefix_cache_queries": "Prefix-cache queries (tokens)", "prefix_cache_hits": "Prefix-cache hits (tokens)"}

    def __init__(self, stats: Callable[[], dict[str, float] | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            got = self.stats()
        except Exception:
            got = None
        if not got:
            return
        for key, help_text in self.HELP.items():
            cls = GaugeMetricFamily if key == "kv_cache_usage_perc" else CounterMetricFamily
            fam = cls(f"vllm:{key}", help_text, labels=["model_name"])
            fam.add_metric([self.model_name], float(got.get(key, 0.0)))
            yield fam
