"""`cotserve bench serve`: load test of a running OpenAI-compatible endpoint.

C concurrent clients send R chat completions in total (prompts cycle through a small varied set,
so prompt lengths differ), with or without streaming. Reports latency p50/p95/p99, time to first
token (streaming: first content chunk; otherwise the whole latency), inter-token latency
(streaming: the gaps between a stream's successive content chunks, over all streams), generated
tok/s over the wall time, and errors (with the first few messages)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from cotserve.bench.progress import Progress

PROMPTS = [
    "What is 2+2?",
    "Name three colours.",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about autumn leaves falling in a quiet forest.",
    "List the first five prime numbers and say what makes a number prime.",
    "A train leaves at 3pm going 60 km/h; another leaves at 4pm going 80 km/h on the same track. "
    "When does the second catch up? Think step by step.",
    "Hi",
    "Summarize the plot of a story about a dragon who learns to bake bread for a village.",
]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    arrivals: list[float] = []  # when each content-bearing chunk arrived (streaming)
    if not stream:
        r = await client.post(url, json=body)
        lat = time.perf_counter() - t0
        if r.status_code != 200:
            return {"ok": False, "error": f"{r.status_code}: {r.text[:200]}", "latency": lat}
        data = r.json()
        return {"ok": True, "latency": lat, "ttft": lat, "tokens": data["usage"]["completion_tokens"]}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return {"ok": False, "error": f"{r.status_code}: {text[:200]}", "latency": time.perf_counter() - t0}
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                return {"ok": False, "error": str(chunk["error"].get("message")), "latency": time.perf_counter() - t0}
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content"):
                    now = time.perf_counter() - t0
                    arrivals.append(now)
                    if ttft is None:
                        ttft = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    lat = time.perf_counter() - t0
    if not done:
        return {"ok": False, "error": "stream ended without [DONE]", "latency": lat}
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ok": True, "latency": lat, "ttft": ttft if ttft is not None else lat, "tokens": tokens, "itl": gaps}


async def _run(url: str, concurrency: int, requests: int, stream: bool, max_tokens: int, model: str | None,
               api_key: str | None, temperature: float, timeout: float) -> dict[str, Any]:
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        if model is None:
            r = await client.get(base + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        counter = iter(range(requests))
        results: list[dict[str, Any]] = []
        note = Progress("serve")
        every = max(1, requests // 10)

        async def client_loop() -> None:
            for i in counter:
                body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                try:
                    results.append(await _one(client, base + "/v1/chat/completions", body, stream))
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}", "latency": 0.0})
                if len(results) % every == 0 or len(results) == requests:
                    note(f"{len(results)}/{requests} requests done ({sum(not r['ok'] for r in results)} failed)")

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    itl = [g for r in ok for g in r.get("itl", [])]  # gaps between a stream's successive chunks

    def pct(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        return {f"p{q}": round(percentile(xs, q), 4) for q in (50, 95, 99)} | {"mean": round(sum(xs) / len(xs), 4)}

    return {
        "url": base, "model": model, "concurrency": concurrency, "requests": requests, "stream": stream,
        "max_tokens": max_tokens, "temperature": temperature,
        "ok": len(ok), "errors": len(errors), "error_samples": errors[:5],
        "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3) if wall else 0.0,
        "completion_tokens": tokens, "tok_s": round(tokens / wall, 2) if wall else 0.0,
        "latency_s": pct(lat), "ttft_s": pct(ttft), "itl_s": pct(itl),
    }


def run_serve_bench(url: str, concurrency: int, requests: int, stream: bool = False, max_tokens: int = 32,
                    model: str | None = None, api_key: str | None = None, temperature: float = 0.0,
                    timeout: float = 600.0) -> dict[str, Any]:
    if concurrency < 1 or requests < 1:
        raise ValueError("--concurrency and --requests must be at least 1")
    return asyncio.run(_run(url, concurrency, requests, stream, max_tokens, model, api_key, temperature, timeout))
