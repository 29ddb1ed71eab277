"""Prometheus metrics of one gateway (own registry, so several apps can live in one process).

Two families: cotserve's own (`cotserve_*`, with the policy where it matters) and, where the
meaning is the same, vLLM's names with a `model_name` label (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:request_prompt_tokens`,
`vllm:request_generation_tokens`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total`, `vllm:num_requests_running`, `vllm:num_requests_waiting`), so a
dashboard built for vLLM's server works on cotserve's gateway. The buckets and the ratio keys are
the worker's (`cotserve/worker/metrics.py`, what `cotserve worker --metrics-port` serves)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

from cotserve.worker.metrics import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    RATIO_KEYS,
    TOK_S_BUCKETS,
    TOKEN_BUCKETS,
)


class Metrics:
    def __init__(self, model_name: str = "cotserve") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.requests = Counter("cotserve_requests", "Requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("cotserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("cotserve_completion_tokens", "Generated tokens", registry=r)
        self.cancelled = Counter("cotserve_cancelled", "Requests cancelled by a client disconnect", registry=r)
        self.in_flight = Gauge("cotserve_requests_in_flight", "Requests accepted and not yet answered", registry=r)
        self.queue_pending = Gauge("cotserve_queue_pending", "Jobs waiting in the queue", registry=r)
        self.queue_running = Gauge("cotserve_queue_running", "Jobs claimed by workers", registry=r)
        self.workers = Gauge("cotserve_workers", "Workers with a live heartbeat", registry=r)
        self.queue_wait = Histogram("cotserve_queue_wait_seconds", "Enqueue to claim", registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.latency = Histogram("cotserve_request_latency_seconds", "Request latency", registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("cotserve_time_to_first_token_seconds",
                              "Request arrival to its first generated token (streamed or not)", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("cotserve_inter_token_latency_seconds", "Time between generated tokens", registry=r,
                             buckets=ITL_BUCKETS)
        self.prompt_len = Histogram("cotserve_request_prompt_tokens", "Prompt tokens per request", ["policy"],
                                    registry=r, buckets=TOKEN_BUCKETS)
        self.gen_len = Histogram("cotserve_request_generation_tokens", "Generated tokens per request", ["policy"],
                                 registry=r, buckets=TOKEN_BUCKETS)
        self.decode_tok_s = Histogram("cotserve_decode_tokens_per_second", "Decode tok/s per request", ["policy"],
                                      registry=r, buckets=TOK_S_BUCKETS)
        self.ratios = Histogram("cotserve_policy_ratio", "Per-request ratios a policy reports (retained, "
                                "slow-step, skip, padding)", ["policy", "key"], registry=r, buckets=RATIO_BUCKETS)
        # a summary (sum and count, no quantiles): averages and totals aggregate across gateways and time
        self.telemetry = Summary("cotserve_policy_telemetry", "Numeric telemetry of finished requests per policy "
                                 "and key (sum and count)", ["policy", "key"], registry=r)
        m = ["model_name"]
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m, registry=r,
                                buckets=LATENCY_BUCKETS)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", m, registry=r,
                               buckets=ITL_BUCKETS)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", m, registry=r,
                               buckets=LATENCY_BUCKETS)
        self.v_prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", m, registry=r,
                                      buckets=TOKEN_BUCKETS)
        self.v_gen_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request", m, registry=r,
                                   buckets=TOKEN_BUCKETS)
        self.v_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", m, registry=r)
        self.v_gen_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                 ["model_name", "finished_reason"], registry=r)
        self.v_running = Gauge("vllm:num_requests_running", "Requests being decoded", m, registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a worker", m, registry=r)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.v_ttft.labels(self.model_name).observe(seconds)

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        """`tokens` generated over `seconds` since the previous ones: one gap per token."""
        if tokens <= 0:
            return
        gap = max(0.0, seconds) / tokens
        for _ in range(tokens):
            self.itl.observe(gap)
            self.v_itl.labels(self.model_name).observe(gap)

    def observe_latency(self, seconds: float) -> None:
        self.latency.observe(seconds)
        self.v_e2e.labels(self.model_name).observe(seconds)

    def observe_done(self, usage: dict[str, int], telemetry: dict[str, Any], finish_reason: str | None = None) -> None:
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        policy = str(telemetry.get("policy", "dense"))
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
        self.prompt_len.labels(policy).observe(prompt)
        self.gen_len.labels(policy).observe(completion)
        name = self.model_name
        self.v_prompt_tokens.labels(name).inc(prompt)
        self.v_gen_tokens.labels(name).inc(completion)
        self.v_prompt_len.labels(name).observe(prompt)
        self.v_gen_len.labels(name).observe(completion)
        if finish_reason:
            self.v_success.labels(name, finish_reason).inc()
        if "queue_wait_s" in telemetry:
            self.queue_wait.observe(float(telemetry["queue_wait_s"]))
        if telemetry.get("decode_tok_s"):
            self.decode_tok_s.labels(policy).observe(float(telemetry["decode_tok_s"]))
        for k, v in telemetry.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("attempt",):
                self.telemetry.labels(policy, k).observe(float(v))
                if k in RATIO_KEYS:
                    self.ratios.labels(policy, k).observe(float(v))

    def render(self, stats: dict[str, int]) -> bytes:
        self.queue_pending.set(stats.get("pending", 0))
        self.queue_running.set(stats.get("running", 0))
        self.workers.set(stats.get("workers", 0))
        self.v_waiting.labels(self.model_name).set(stats.get("pending", 0))
        self.v_running.labels(self.model_name).set(stats.get("running", 0))
        return generate_latest(self.registry)

    def clock(self) -> TokenClock:
        return TokenClock(self)


class TokenClock:
    """One request's token timing: time to first token at its first generated token (streamed or
    not), then one inter-token gap per later token (per choice), and the end-to-end latency."""

    def __init__(self, metrics: Metrics) -> None:
        import time

        self._now = time.perf_counter
        self.metrics = metrics
        self.t0 = self._now()
        self.first = True
        self.last: dict[int, float] = {}

    def tokens(self, choice: int, n: int) -> None:
        if n <= 0:
            return
        now = self._now()
        if self.first:
            self.metrics.observe_ttft(now - self.t0)
            self.first = False
            n -= 1  # the first token has no gap before it
        if choice in self.last:
            self.metrics.observe_itl(now - self.last[choice], n)
        elif n > 0:  # another choice's first tokens: gaps measured from the request's first token
            self.metrics.observe_itl(now - self.t0, n)
        self.last[choice] = now

    def finish(self) -> float:
        latency = self._now() - self.t0
        self.metrics.observe_latency(latency)
        return latency
