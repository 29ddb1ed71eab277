"""cotserve's schedulers: vLLM's, plus what a request's policy needs of the scheduler.

`TelemetryScheduler` / `TelemetryAsyncScheduler` (vLLM's synchronous and asynchronous schedulers,
selected by `cotserve serve --engine vllm` wherever eviction is not served) add one thing: a
finished SFI request's decode and slow steps in its output's `kv_transfer_params["cotserve"]`
(`thought_telemetry.sfi_step_telemetry`, the runtime's trigger run over its tokens), so every SFI
response carries them, also with asynchronous scheduling.

`EvictingScheduler`: vLLM's scheduler, plus the block side of physical KV eviction.

Selected with vLLM's `scheduler_cls` (`cotserve serve --engine vllm` sets it;
`--scheduler-cls cotserve.vllm.scheduler.EvictingScheduler` for a vLLM server of your own).
After each `schedule()`, for every scheduled request that asked for an eviction policy
(`rkv`, `skipkv`, `streamingllm`, `h2o`), it asks the request's `EvictionLedger` whether a compaction is
due before this step; if so, the blocks that the compacted request no longer needs become null
entries of its block list and go back to vLLM's block pool: the next `schedule()` can admit more
requests with them. The worker compacts the request's entries in the same step, before the
forward reads or writes the cache, so a block freed here is written by another request at the
earliest in the next step.

A preempted request restarts from scratch (vLLM recomputes its prompt and output so far), with a
fresh ledger: its earlier evictions are not replayed; its first decode step compacts again.
"""

from __future__ import annotations

import logging
from typing import Any

from cotserve.errors import CotserveError
from cotserve.vllm import compat
from cotserve.vllm.batch_rows import request_policy_of
from cotserve.vllm.compat import AsyncScheduler, CountsPreemptions, Scheduler
from cotserve.vllm.eviction_ledger import EvictionLedger
from cotserve.vllm.settings import settings
from cotserve.vllm.telemetry import write_telemetry
from cotserve.vllm.thought_telemetry import sfi_step_telemetry, thought_telemetry

log = logging.getLogger(__name__)


def check_config(cfg) -> None:
    """What eviction needs of vLLM's configuration; a clear error at startup otherwise."""
    if cfg.cache_config.enable_prefix_caching:
        raise ValueError("cotserve's EvictingScheduler needs prefix caching off (evicted entries are no longer "
                         "the prefix their blocks hash to): start vLLM with enable_prefix_caching=False "
                         "(--no-enable-prefix-caching)")
    if compat.async_scheduling(cfg.scheduler_config):
        raise ValueError("cotserve's EvictingScheduler runs with async scheduling off (the worker and the "
                         "scheduler apply a compaction in the same step): start vLLM with async_scheduling=False "
                         "(--no-async-scheduling)")
    if compat.speculative_config(cfg) is not None:
        raise ValueError("cotserve's EvictingScheduler does not run with speculative decoding (a compaction is "
                         "scheduled on one-token decode steps)")


class _SFITelemetry:
    """A scheduler mixin: each finished SFI request's step telemetry in its output (module
    docstring). Requests are parsed once, when they are added; the ones that never finish here
    (aborted) are dropped as their number grows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sfi_requests: dict[str, tuple[Any, Any]] = {}  # request id -> (its SFIConfig, the request)
        self._sfi_tok: Any = False  # loaded on first use (None: none available)

    def add_request(self, request) -> None:
        super().add_request(request)  # type: ignore[misc]
        try:
            pol = request_policy_of(compat.request_extra_args(request))
        except CotserveError:  # refused when it arrived; never reached in practice
            return
        if pol.sfi is None:
            return
        reqs, live = self._sfi_requests, self.requests  # type: ignore[attr-defined]
        reqs[request.request_id] = (pol.sfi, request)
        if len(reqs) > 2 * len(live) + 64:
            for gone in [r for r in reqs if r not in live]:
                reqs.pop(gone)

    def update_from_output(self, *args: Any, **kwargs: Any):
        outs = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        reqs = self._sfi_requests
        if not reqs:
            return outs
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is None or o.request_id not in reqs:
                    continue
                cfg, request = reqs.pop(o.request_id)
                tele = sfi_step_telemetry(self._model_tokenizer(), cfg, list(request.prompt_token_ids or []),
                                          list(request.output_token_ids))
                compat.add_output_telemetry(o, tele)
        return outs

    def _model_tokenizer(self):
        """The model's tokenizer (sentence boundaries, thoughts), loaded on first use; None without one."""
        if self._sfi_tok is False:
            from cotserve.vllm.runtime_builders import model_tokenizer

            self._sfi_tok = model_tokenizer(self.vllm_config.model_config,  # type: ignore[attr-defined]
                                            "the sentence boundaries and thoughts of the telemetry")
        return self._sfi_tok


class TelemetryScheduler(_SFITelemetry, Scheduler):
    """vLLM's scheduler, plus SFI's step telemetry in finished outputs."""


class TelemetryAsyncScheduler(_SFITelemetry, AsyncScheduler):
    """vLLM's asynchronous scheduler, plus SFI's step telemetry in finished outputs."""


class EvictingScheduler(_SFITelemetry, CountsPreemptions, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cfg = kwargs.get("vllm_config", args[0] if args else None)
        if cfg is not None:
            check_config(cfg)
        super().__init__(*args, **kwargs)
        groups = compat.kv_managers(self)
        if len(groups) != 1:
            raise ValueError(f"cotserve's EvictingScheduler runs models with one KV cache group; this one has "
                             f"{len(groups)} (use vLLM's own scheduler for it, without eviction)")
        # the worker's eviction runtime can be left out on CUDA; then nothing evicts here either
        self._evicting = settings().evict_slots != 0
        self._manager = groups[0]
        # request id -> (its RequestPolicy, the request) when it evicts or steers; None when it does neither
        self._policies: dict[str, tuple[Any, Any] | None] = {}
        self._ledgers: dict[str, EvictionLedger] = {}
        self._block_stats: dict[str, dict[str, Any]] = {}
        self._recomputed: dict[str, int] = {}  # preempted and recomputed from scratch (vLLM's preemptions:
        # `cotserve_preemptions`, from `CountsPreemptions`)
        # $COTSERVE_VLLM_SCHED_STATS: one line per step, "running waiting free_blocks preemptions" (`bench capacity`)
        path = settings().sched_stats
        self._stats = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (lives with the engine)

    def schedule(self, *args: Any, **kwargs: Any):
        out = super().schedule(*args, **kwargs)
        for req_id, ntok in out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            policy = self._policy(req_id, request)
            if policy is None:
                continue
            before = request.num_computed_tokens - ntok  # schedule() has advanced it already
            ledger = self._ledgers.get(req_id)
            if ledger is None or before == 0:  # new, or recomputed after a preemption
                if ledger is not None:
                    self._recomputed[req_id] = self._recomputed.get(req_id, 0) + 1
                ledger = self._ledgers[req_id] = EvictionLedger(policy, request.num_tokens)
            if ledger.due(before, ntok):
                holes = ledger.compact(before, ntok, self._manager.block_size)
                self._free(req_id, holes)
            ledger.after_step(before + ntok)
        for gone in [r for r in self._ledgers if r not in self.requests]:
            self._finish(gone)
        if len(self._policies) > 2 * len(self.requests) + 64:  # requests that left without finishing here
            for gone in [r for r in self._policies if r not in self.requests]:
                self._policies.pop(gone)
        if self._stats is not None:
            self._stats.write(f"{len(self.running)} {len(self.waiting)} "
                              f"{compat.free_blocks(self)} {self.cotserve_preemptions}\n")
        return out

    def update_from_output(self, *args: Any, **kwargs: Any):
        """vLLM's, plus each finished evicting or steered request's telemetry in its output's
        `kv_transfer_params["cotserve"]` (the way to the client that vLLM's outputs offer), beside
        an SFI request's steps."""
        outs = super().update_from_output(*args, **kwargs)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is None or not self._policies.get(o.request_id):
                    continue
                pol, request = self._policies.pop(o.request_id)  # vLLM has freed the request; we hold it
                tele = self._finish(o.request_id) if o.request_id in self._ledgers else {}
                tele.update(self._thoughts(request, pol))
                compat.add_output_telemetry(o, tele)  # beside SFI's steps (`_SFITelemetry`)
        return outs

    def _thoughts(self, request, pol) -> dict[str, Any]:
        return thought_telemetry(self._model_tokenizer(), list(request.prompt_token_ids or []),
                                 list(request.output_token_ids), pol.evict, pol.steer)

    def _policy(self, req_id: str, request) -> Any:
        """The request's eviction policy (None: it does not evict); parsed once per request."""
        if req_id not in self._policies:
            try:
                pol = request_policy_of(compat.request_extra_args(request))
            except CotserveError:  # refused when it arrived; never reached in practice
                pol = None
            tracked = pol is not None and (pol.evict is not None or pol.steer is not None or pol.sfi is not None)
            self._policies[req_id] = (pol, request) if tracked else None
        got = self._policies[req_id]
        return got[0].evict if got is not None and self._evicting else None

    def _free(self, req_id: str, holes: list[int]) -> None:
        """Null the block-list entries `holes` of the request and return their blocks to the pool."""
        before = compat.free_blocks(self)
        compat.release_blocks(self, self._manager, req_id, holes)
        after = compat.free_blocks(self)
        st = self._block_stats.setdefault(req_id, {"free_blocks": [], "blocks_freed": 0})
        st["free_blocks"].append([before, after])
        st["blocks_freed"] += after - before

    def _finish(self, req_id: str) -> dict[str, Any]:
        ledger = self._ledgers.pop(req_id)
        st = self._block_stats.pop(req_id, None) or {"free_blocks": [], "blocks_freed": 0}
        tele = {"policy": ledger.policy.name, "kv_budget": ledger.policy.budget,
                "kv_entries_peak": ledger.peak, "compactions": ledger.compactions,
                "evicted_tokens": ledger.evicted, "blocks_freed": st["blocks_freed"],
                "recomputed": self._recomputed.pop(req_id, 0)}
        write_telemetry({"request_id": req_id, **tele, "free_blocks": st["free_blocks"]})
        return tele
