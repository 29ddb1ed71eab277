"""Free KV capacity as vLLM reports it, for the worker's token-bounded claims.

vLLM V1 hands every engine step's `SchedulerStats` to the stat loggers of its `AsyncLLM`
(`stat_loggers=[factory]` in `AsyncLLM.from_engine_args`; custom loggers turn stats on even with
`disable_log_stats`). `KVCapacity.logger_factory()` is such a factory (`attach` passes it to
`from_engine_args`): its logger keeps the latest
`kv_cache_usage` (the fraction of KV blocks in use after the step; finished requests' blocks are
already back) per engine. The total is the KV cache vLLM allocated at startup, num_gpu_blocks *
block_size tokens from `vllm_config.cache_config`, so

    free tokens = total * (1 - usage)

Unknown (None) until vLLM has sized its cache; before the first step nothing is in use, so the
whole cache is free. Block granularity is not modelled: every sequence's last block is partly
empty, so the figure is an upper bound on what new requests can use.
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace
from typing import Any


class KVCapacity:
    """The latest KV usage per vLLM engine and the cache's size; thread-safe (vLLM's stats arrive
    on the engine's event loop thread, the worker reads from its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[int, float] = {}  # engine index -> fraction of KV blocks in use
        self._config: Any = None  # vllm_config (its cache_config is filled in at startup)
        self._seq = 0  # reports received (the continuous pool counts what it submitted since the last)
        # totals over the engine's life, mirrored as vLLM's own metrics (`vllm_stats`)
        self._preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    def bind(self, vllm_config: Any) -> None:
        """The engine's `VllmConfig` (its cache_config carries num_gpu_blocks after startup)."""
        with self._lock:
            self._config = vllm_config

    def observe(self, engine_idx: int, usage: float) -> None:
        """One step's `SchedulerStats.kv_cache_usage` of engine `engine_idx`."""
        with self._lock:
            self._usage[engine_idx] = min(1.0, max(0.0, float(usage)))
            self._seq += 1

    def count(self, preempted: int = 0, prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """One step's preemptions and prefix-cache lookups (tokens queried, tokens found)."""
        with self._lock:
            self._preemptions += int(preempted)
            self._prefix_queries += int(prefix_queries)
            self._prefix_hits += int(prefix_hits)

    def vllm_stats(self) -> dict[str, float]:
        """What vLLM's own metrics of these names report: KV usage now (a fraction), preemptions
        and prefix-cache queries and hits (tokens) so far."""
        with self._lock:
            usage = sum(self._usage.values()) / len(self._usage) if self._usage else 0.0
            return {"kv_cache_usage_perc": usage, "num_preemptions": self._preemptions,
                    "prefix_cache_queries": self._prefix_queries, "prefix_cache_hits": self._prefix_hits}

    def report(self) -> tuple[int | None, int]:
        """(free tokens, how many reports came so far): a sequence submitted at report n is in the
        free figure once a report later than n has come."""
        with self._lock:
            seq = self._seq
        return self.free_tokens(), seq

    def total_tokens(self) -> int | None:
        """KV tokens vLLM allocated (all engines), or None before it sized its cache."""
        from cotserve.vllm.compat import kv_cache_size

        with self._lock:
            config = self._config
        blocks, block_size = kv_cache_size(config)
        if not blocks or not block_size:
            return None
        return int(blocks) * int(block_size)

    def free_tokens(self) -> int | None:
        """total * (1 - mean usage over the engines), or None when the total is unknown."""
        total = self.total_tokens()
        if total is None:
            return None
        with self._lock:
            usage = sum(self._usage.values()) / len(self._usage) if self._usage else 0.0
        return int(total * (1.0 - usage))

    def logger_factory(self):
        """A per-engine stat logger class for `AsyncLLM.from_engine_args(stat_loggers=[...])` that
        feeds this object (imports vLLM)."""
        from cotserve.vllm.compat import StatLoggerBase, preempted_count, prefix_cache_counts

        capacity = self

        class KVCapacityLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.engine_index = engine_index
                capacity.bind(vllm_config)

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    capacity.observe(engine_idx, scheduler_stats.kv_cache_usage)
                    queries, hits = prefix_cache_counts(scheduler_stats)
                    capacity.count(prefix_queries=queries, prefix_hits=hits)
                if iteration_stats is not None:
                    capacity.count(preempted=preempted_count(iteration_stats))

            def log_engine_initialized(self) -> None:
                pass

        return KVCapacityLogger

    def attach(self, async_llm_cls: Any) -> Any:
        """vLLM's `AsyncLLM` as far as starting it goes: `from_engine_args(args)` with this
        object's stat logger passed in `stat_loggers`."""
        return SimpleNamespace(from_engine_args=functools.partial(async_llm_cls.from_engine_args,
                                                                  stat_loggers=[self.logger_factory()]))
