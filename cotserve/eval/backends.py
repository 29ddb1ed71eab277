"""Where replies come from: the native engine in this process, or an OpenAI-compatible endpoint.

Both take a list of `EvalRequest`s (one prompt, one policy variant, one sample) and yield `Output`s as
they finish, so the runner can log each one at once (the resume log).

- `LocalBackend`: `NativeEngine.generate` per batch; jobs are sorted by prompt length first and
  cut into batches of the engine's `max_batch`, so each batch holds neighbours in length
  (`cotserve.grouping.length_groups`, as the engine does; SkipKV Sec. 4.3).
- `EndpointBackend`: the openai SDK, one request per job from a thread pool of `concurrency`:
  a chat completion (`api="chat"`, the prompt as the user message) or a text completion
  (`api="completions"`, `/v1/completions` with the prompt as raw text, no chat template; the
  reasoning is split from the text by its `<think>` tags). The policy travels per request in
  `extra_body={"cotserve": {"policy", "options"}}`. `reasoning_content` and the response's
  `cotserve` telemetry object are read when present.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from cotserve.engine.textproc import split_reasoning
from cotserve.errors import CotserveError
from cotserve.grouping import length_groups


@dataclass
class EvalRequest:
    key: tuple[str, str, str, int]  # (suite, variant label, item id, sample)
    prompt: str
    policy: str
    options: dict[str, Any]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


@dataclass
class Output:
    job: EvalRequest
    text: str = ""  # the whole reply (reasoning included, as generated)
    content: str = ""  # the answer part
    reasoning: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str = ""
    telemetry: dict[str, Any] = field(default_factory=dict)
    t_start: float = 0.0  # the request starts running (its batch starts, or it is sent)
    t_end: float = 0.0  # its last token
    error: str | None = None
    t_queued: float | None = None  # it was handed to the backend (queue wait = t_start - t_queued)
    t_first: float | None = None  # its first generated token arrived


class LocalBackend:
    """The native engine, in this process."""

    kind = "local"

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> dict[str, Any]:
        return {"mode": "local", "model": self.model_name, "device": str(self.engine.device),
                "dtype": str(self.engine.dtype).replace("torch.", ""), "max_batch": self.engine.max_batch}

    def check(self, policy: str, options: dict[str, Any]) -> None:
        from cotserve.policies.registry import build_policy

        build_policy(policy, options)  # PolicyError for an unknown policy or a bad option

    def drain(self) -> list[Output]:
        """After Ctrl-C: nothing is in flight outside the engine (finished replies were yielded)."""
        return []

    def run(self, jobs: list[EvalRequest]) -> Iterator[Output]:
        eng = self.engine
        t_queued = time.time()  # every job enters the queue now; its wait ends when its batch starts
        encoded = [(j, eng.encode_prompt(j.prompt)) for j in jobs]
        # one batch runs one policy variant; neighbours in prompt length share a batch
        for batch in length_groups(encoded, lambda e: len(e[1]), eng.max_batch,
                                   key=lambda e: json.dumps([e[0].policy, e[0].options], sort_keys=True, default=str)):
            yield from self._batch(batch, t_queued)

    def _batch(self, batch: list[tuple[EvalRequest, list[int]]], t_queued: float) -> Iterator[Output]:
        """One engine batch, streamed: each reply is yielded the step it finishes, with its own
        first-token and end times (not the batch's)."""
        from cotserve.engine.native import GenRequest
        from cotserve.engine.sampling import SamplingParams

        eng = self.engine
        ok: list[tuple[EvalRequest, list[int]]] = []
        for job, ids in batch:
            try:
                eng.check_request(GenRequest(ids))
                ok.append((job, ids))
            except CotserveError as exc:  # e.g. a prompt longer than the context: this item only
                now = time.time()
                yield Output(job, prompt_tokens=len(ids), t_queued=t_queued, t_start=now, t_end=now, error=str(exc))
        if not ok:
            return
        head = ok[0][0]
        reqs = [GenRequest(ids, SamplingParams(max_tokens=j.max_tokens, temperature=j.temperature,
                                               top_p=j.top_p, seed=j.seed)) for j, ids in ok]
        jobs = {r.request_id: j for r, (j, _) in zip(reqs, ok, strict=True)}
        first: dict[str, float] = {}
        t0 = time.time()
        for deltas in eng.stream(reqs, head.policy, head.options):
            now = time.time()
            for d in deltas:
                first.setdefault(d.request_id, now)
                if d.result is None:
                    continue
                res, job = d.result, jobs[d.request_id]
                reasoning, content = split_reasoning(res.text)
                rtok = len(eng.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
                yield Output(job, res.text, content, reasoning, res.prompt_tokens, res.completion_tokens,
                             min(rtok, res.completion_tokens), res.finish_reason, dict(res.telemetry), t0, now,
                             t_queued=t_queued, t_first=first[d.request_id])


class LogBackend:
    """`--report-only`: no model and no endpoint; the run's own `run_config.json` describes where its
    replies came from, and nothing new is generated (regrading and the report still happen)."""

    kind = "log"

    def __init__(self, out_dir):
        from pathlib import Path

        path = Path(out_dir) / "run_config.json"
        if not path.is_file():
            raise CotserveError(f"--report-only: {out_dir} holds no run (no run_config.json)")
        self.backend = json.loads(path.read_text()).get("backend", {})

    def describe(self) -> dict[str, Any]:
        return dict(self.backend)

    def check(self, policy: str, options: dict[str, Any]) -> None:
        """Nothing runs: nothing to check."""

    def run(self, jobs: list[EvalRequest]) -> Iterator[Output]:
        if jobs:
            raise CotserveError("--report-only generates nothing")
        return iter(())

    def drain(self) -> list[Output]:
        return []


class EndpointBackend:
    """An OpenAI-compatible server (`cotserve serve`, or any other) through the openai SDK."""

    kind = "endpoint"

    def __init__(self, url: str, api_key: str | None, model: str | None, concurrency: int = 4,
                 timeout_s: float = 600.0, api: str = "chat"):
        if api not in ("chat", "completions"):
            raise CotserveError(f"--api must be chat or completions, not {api!r}")
        self.api = api
        try:
            import openai
        except ImportError:
            raise CotserveError("endpoint mode needs the openai package (pip install 'cotserve[eval]')") from None
        base = url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.url = base
        self.client = openai.OpenAI(base_url=base, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=2)
        self.concurrency = max(1, concurrency)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        import openai

        try:
            models = self.client.models.list().data
        except openai.APIConnectionError as exc:
            raise CotserveError(f"cannot reach the endpoint {self.url}: {exc}") from None
        except openai.APIStatusError as exc:
            raise CotserveError(f"endpoint {self.url} refused /models: {exc.status_code} {exc.message}") from None
        if not models:
            raise CotserveError(f"endpoint {self.url} lists no models; pass --model")
        return models[0].id

    def describe(self) -> dict[str, Any]:
        return {"mode": "endpoint", "endpoint": self.url, "model": self.model, "concurrency": self.concurrency,
                "api": self.api}

    def check(self, policy: str, options: dict[str, Any]) -> None:
        """The server validates policies; nothing to check here."""

    def _one(self, job: EvalRequest, t_queued: float | None = None) -> Output:
        import openai

        body: dict[str, Any] = {"cotserve": {"policy": job.policy, "options": job.options}}
        t0 = time.time()
        try:
            kwargs: dict[str, Any] = dict(model=self.model, max_tokens=job.max_tokens, temperature=job.temperature,
                                          top_p=job.top_p, extra_body=body)
            if job.seed is not None:
                kwargs["seed"] = job.seed
            stream_kw = dict(stream=True, stream_options={"include_usage": True})
            if self.api == "completions":
                parts, rparts, finish, usage, tele, t_first = self._consume(
                    self.client.completions.create(prompt=job.prompt, **kwargs, **stream_kw))
            else:
                parts, rparts, finish, usage, tele, t_first = self._consume(self.client.chat.completions.create(
                    messages=[{"role": "user", "content": job.prompt}], **kwargs, **stream_kw))
        except openai.APIConnectionError as exc:
            return Output(job, t_start=t0, t_end=time.time(), error=f"connection: {exc}", t_queued=t_queued)
        except openai.APIStatusError as exc:
            per_item = exc.status_code in (408, 429) or exc.status_code >= 500 or \
                getattr(exc, "code", None) == "context_length_exceeded"
            if not per_item:  # a bad key, model or policy fails every request alike: stop at once
                raise CotserveError(f"endpoint {self.url} refused the request: HTTP {exc.status_code}: "
                                    f"{exc.message}") from None
            return Output(job, t_start=t0, t_end=time.time(), error=f"HTTP {exc.status_code}: {exc.message}",
                          t_queued=t_queued)
        except openai.APIError as exc:
            return Output(job, t_start=t0, t_end=time.time(), error=str(exc), t_queued=t_queued)
        t1 = time.time()
        content = "".join(parts)
        reasoning = "".join(rparts) if rparts else None
        if reasoning is None:  # a server that leaves <think> in the content
            reasoning, content = split_reasoning(content)
        text = (f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "") + content
        completion = int(getattr(usage, "completion_tokens", 0) or 0)
        rtok = 0
        details = getattr(usage, "completion_tokens_details", None)
        if details is not None and getattr(details, "reasoning_tokens", None):
            rtok = int(details.reasoning_tokens)
        elif reasoning:  # no count from the server: split the total by characters
            rtok = round(completion * len(reasoning) / max(1, len(reasoning) + len(content)))
        return Output(job, text, content, reasoning, int(getattr(usage, "prompt_tokens", 0) or 0), completion,
                      rtok, finish or "", tele, t0, t1, t_queued=t_queued, t_first=t_first)

    @staticmethod
    def _consume(stream) -> tuple[list[str], list[str], str | None, Any, dict[str, Any], float | None]:
        """Read an SSE chat stream: content and reasoning pieces, finish reason, usage, cotserve
        telemetry, and when the first generated text arrived."""
        parts: list[str] = []
        rparts: list[str] = []
        finish, usage, tele, t_first = None, None, {}, None
        for chunk in stream:
            extra = chunk.model_extra or {}
            if extra.get("cotserve"):
                tele = dict(extra["cotserve"])
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                d = getattr(ch, "delta", None)
                if d is None:  # a text-completion chunk
                    d = SimpleNamespace(content=getattr(ch, "text", None), model_extra=None)
                r = getattr(d, "reasoning_content", None)
                if r is None and d.model_extra:
                    r = d.model_extra.get("reasoning_content")
                if (d.content or r) and t_first is None:
                    t_first = time.time()
                if d.content:
                    parts.append(d.content)
                if r:
                    rparts.append(r)
                if ch.finish_reason:
                    finish = ch.finish_reason
        return parts, rparts, finish, usage, tele, t_first

    def run(self, jobs: list[EvalRequest]) -> Iterator[Output]:
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        t_queued = time.time()
        self._pending = {pool.submit(self._one, j, t_queued) for j in jobs}
        self._pool = pool
        try:
            for fut in as_completed(list(self._pending)):
                self._pending.discard(fut)
                yield fut.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> list[Output]:
        """After Ctrl-C: drop the requests that have not started, wait for the ones in flight (a
        second Ctrl-C abandons them) and return their replies, so finished work is logged."""
        pending = getattr(self, "_pending", set())
        for fut in pending:
            fut.cancel()
        running = [f for f in pending if not f.cancelled()]
        if running:
            print(f"waiting for {len(running)} request(s) in flight; Ctrl-C again to drop them", file=sys.stderr)
        out: list[Output] = []
        try:
            for fut in as_completed(running):
                out.append(fut.result())
        except KeyboardInterrupt:
            pass
        self._pending = set()
        return out
