"""`VLLMPool`: the continuous worker's view of a `VLLMEngine`, one request at a time.

The native continuous engine (`engine/continuous.py`) decodes its own slots; vLLM batches by
itself. The worker therefore hands each claimed sequence to vLLM at once (`submit`) and never
waits for a group to drain: `free_slots` is vLLM's sequence limit minus the sequences this pool
has in flight, and `kv_budget` the KV tokens vLLM last reported free minus what was submitted
since that report, so the worker claims whenever vLLM has room for a job. `step` waits a little
for output, then returns at most one `Delta` per request (everything that arrived for it since the
last call, merged): the worker's and the gateway's per-token work is batched per engine step.

Each request streams, finishes, fails and is cancelled on its own: an exception that vLLM raises
for one request ends that request alone with an error `Delta` (`Delta.error`); the others go on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from cotserve.engine.native import Completion, Delta, GenRequest
from cotserve.errors import EngineDead, redact_paths
from cotserve.policies.base import PolicyStack
from cotserve.vllm.compat import output_telemetry
from cotserve.vllm.failures import is_engine_dead, refusal
from cotserve.vllm.params import policy_extra_args, worker_logprobs


@dataclass
class _Flight:
    """One request in vLLM: what it produced so far."""

    req: GenRequest
    vid: str  # vLLM's request id (unique per submission)
    policy: str  # the request's policy stack (its telemetry's `policy`, as the native engines give it)
    need: int  # KV tokens counted against the budget until vLLM's next report
    report: int  # the KV report sequence number when it was submitted
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    telemetry: dict[str, Any] = field(default_factory=dict)
    aborted: bool = False
    done: bool = False


class VLLMPool:
    def __init__(self, engine: Any, slots: int | None = None, wait_s: float = 0.02):
        # `engine`: the `VLLMEngine` that opened this pool (`VLLMEngine.open_pool`); its module
        # imports this one, so this one names it only here
        self.engine = engine
        self.slots = int(slots or engine.max_batch)
        self.wait_s = wait_s  # how long `step` waits for the first output
        self._out: queue.Queue = queue.Queue()
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self.submitted = 0  # sequences handed to vLLM, over the pool's life
        self.finished = 0  # sequences ended (done, cancelled or failed)

    # -- the continuous worker's contract -------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self._flights

    @property
    def running(self) -> int:
        """Sequences in vLLM (running or waiting there) that this pool submitted."""
        return len(self._flights)

    def free_slots(self) -> int:
        return max(0, self.slots - len(self._flights))

    def kv_budget(self) -> int | None:
        """KV tokens a new claim may take: vLLM's last report of free tokens minus the needs of the
        sequences submitted since that report (None: vLLM has not reported; claim by count)."""
        free, seq = self.engine.kv.report()
        if free is None:
            return None
        pending = sum(f.need for f in self._flights.values() if f.report >= seq)
        return max(0, free - pending)

    def submit(self, req: GenRequest, stack: PolicyStack, need: int = 0) -> None:
        if self.engine.dead:
            raise EngineDead("vLLM's engine is dead")
        self.engine.check_request(req)
        extra = policy_extra_args(stack)
        params = self.engine._params(req, extra)
        _, seq = self.engine.kv.report()
        fl = _Flight(req, f"{req.request_id}-{uuid.uuid4().hex[:8]}", stack.name, need or len(req.prompt_ids), seq)
        self._flights[req.request_id] = fl
        self.submitted += 1
        asyncio.run_coroutine_threadsafe(self._consume(fl, params), self.engine.loop)

    def cancel(self, request_id: str) -> None:
        fl = self._flights.get(request_id)
        if fl is None or fl.aborted:
            return
        fl.aborted = True
        asyncio.run_coroutine_threadsafe(self.engine.llm.abort(fl.vid), self.engine.loop)

    def step(self) -> list[Delta]:
        """Every output that arrived since the last call (waiting up to `wait_s` for the first),
        one Delta per request: its new tokens, and its result when it ended."""
        items: list[tuple[str, Any]] = []
        try:
            items.append(self._out.get(timeout=self.wait_s))
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._out.get_nowait())
            except queue.Empty:
                break
        dead = next((item for _, item in items if isinstance(item, BaseException) and is_engine_dead(item)), None)
        if dead is not None or (self.engine.dead and any(isinstance(item, BaseException) for _, item in items)):
            raise EngineDead(f"vLLM's engine died ({type(dead).__name__ if dead else 'errored'})")
        order: list[str] = []
        new: dict[str, tuple[list[int], list[str], list | None]] = {}
        ended: dict[str, Delta] = {}
        for rid, item in items:
            fl = self._flights.get(rid)
            if fl is None or fl.done:
                continue
            if rid not in new:
                new[rid] = ([], [], None)
                order.append(rid)
            ids, texts, lps = new[rid]
            if isinstance(item, BaseException):
                ended[rid] = self._failed(fl, item)
                continue
            if item is None:  # the generator ended: an abort ends it without a final output
                ended[rid] = self._final(fl, "cancelled" if fl.aborted else "stop")
                continue
            o = item.outputs[0]
            got, text = list(o.token_ids), o.text or ""
            ids.extend(got)
            texts.append(text)
            fl.ids.extend(got)
            fl.text.append(text)
            lp = worker_logprobs(got, o.logprobs, fl.req.sampling.logprobs)
            if lp is not None:
                new[rid] = (ids, texts, (lps or []) + lp)
            if item.finished:
                if output_telemetry(item):
                    fl.telemetry = output_telemetry(item)
                reason = "cancelled" if fl.aborted else (o.finish_reason or "stop")
                ended[rid] = self._final(fl, reason)
        out = []
        for rid in order:
            ids, texts, lps = new[rid]
            end = ended.get(rid)
            if end is not None:
                end.token_ids, end.text, end.logprobs = ids, "".join(texts), lps
                out.append(end)
            elif ids or texts:
                out.append(Delta(rid, ids, "".join(texts), logprobs=lps))
        return out

    # -- internals ----------------------------------------------------------------------------
    async def _consume(self, fl: _Flight, params) -> None:
        try:
            async for out in self.engine.llm.generate({"prompt_token_ids": fl.req.prompt_ids}, params,
                                                      request_id=fl.vid, priority=self.engine.priority_of(fl.req)):
                self._out.put((fl.req.request_id, out))
        except Exception as exc:  # this request alone fails; the worker answers it with an error
            self._out.put((fl.req.request_id, exc))
        finally:
            self._out.put((fl.req.request_id, None))

    def _end(self, fl: _Flight) -> None:
        fl.done = True
        self._flights.pop(fl.req.request_id, None)
        self.finished += 1

    def _final(self, fl: _Flight, reason: str) -> Delta:
        self._end(fl)
        reason = {"abort": "cancelled"}.get(reason, reason)
        res = Completion(request_id=fl.req.request_id, text="".join(fl.text), token_ids=list(fl.ids),
                         finish_reason=reason, prompt_tokens=len(fl.req.prompt_ids), completion_tokens=len(fl.ids),
                         telemetry={"engine": "vllm", **fl.telemetry, "policy": fl.policy})
        return Delta(fl.req.request_id, [], "", finished=True, finish_reason=reason, result=res)

    def _failed(self, fl: _Flight, exc: BaseException) -> Delta:
        self._end(fl)
        why = refusal(exc)
        if why is not None:
            return Delta(fl.req.request_id, [], "", finished=True, finish_reason="error", refused=True,
                         error=f"vLLM refused this request: {redact_paths(why)}")
        return Delta(fl.req.request_id, [], "", finished=True, finish_reason="error",
                     error=f"vLLM failed on this request ({type(exc).__name__})")
