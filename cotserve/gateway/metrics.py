"""Prometheus metrics of one gateway (own registry, so several apps can live in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cotserve_requests", "Chat completion requests by HTTP status", ["status"], registry=r)
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
        self.ttft = Histogram("cotserve_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.decode_tok_s = Histogram("cotserve_decode_tokens_per_second", "Decode tok/s per request", ["policy"],
                                      registry=r, buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))
        self.telemetry = Gauge("cotserve_policy_telemetry", "Latest numeric telemetry value per policy and key",
                               ["policy", "key"], registry=r)

    def observe_done(self, usage: dict[str, int], telemetry: dict[str, Any]) -> None:
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.completion_tokens.inc(usage.get("completion_tokens", 0))
        policy = str(telemetry.get("policy", "dense"))
        if "queue_wait_s" in telemetry:
            self.queue_wait.observe(float(telemetry["queue_wait_s"]))
        if telemetry.get("decode_tok_s"):
            self.decode_tok_s.labels(policy).observe(float(telemetry["decode_tok_s"]))
        for k, v in telemetry.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("attempt",):
                self.telemetry.labels(policy, k).set(float(v))

    def render(self, stats: dict[str, int]) -> bytes:
        self.queue_pending.set(stats.get("pending", 0))
        self.queue_running.set(stats.get("running", 0))
        self.workers.set(stats.get("workers", 0))
        return generate_latest(self.registry)
