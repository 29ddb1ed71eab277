"""`streamingllm`: attention sinks + a recent window; everything else is evicted.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453),
Sec. 3.2 and Fig. 4: the KV cache holds the first `sinks` tokens (the attention sinks, 4 in the paper)
and a rolling window of the `recent` latest tokens.

Here: the prompt is prefilled with full causal attention, then the cache of every layer and KV head
is physically compacted to sinks + recent entries; during decoding a slot is compacted back to
sinks + recent as soon as it holds sinks + recent + `interval` entries (`interval=1`, the default, is the
paper's rolling cache: one token out per token in). So after any step a slot holds at most
sinks + recent + interval - 1 entries, and a decode step attends over at most sinks + recent + interval.
The compaction is `eviction.ScoredEviction`'s with the sinks and the recent window as its protected
first and last entries and nothing left to choose by score.

Deviation, stated: the paper re-assigns positions inside the cache (Sec. 3.2, "positions within the
cache") so that text can stream past the pre-trained context; this engine keeps every entry's true
position (RoPE applied once at write), as kvpress's StreamingLLM press does. For contexts inside the
model's window (all of cotserve's benchmarks) the difference is the sinks' relative distance only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cotserve.policies.base import PolicyConfig, Runtime
from cotserve.policies.eviction import ScoredEviction
from cotserve.policies.options import StreamingLLMOptions, check_config, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(StreamingLLMOptions)
class StreamingLLMConfig(PolicyConfig):
    """`StreamingLLMOptions`: the budget, its sinks and recent window, the compaction interval."""

    def validate(self) -> None:
        check_config(self)

    @property
    def window(self) -> int:
        return self.recent if self.recent > 0 else self.budget - self.sinks

    @property
    def kept(self) -> int:
        return self.sinks + self.window


@register
class StreamingLLMPolicy(ScoredEviction):
    """Sink + recent window (Xiao et al. 2023); physical eviction, nothing scored."""

    name = "streamingllm"
    config_cls = StreamingLLMConfig
    runtimes = Runtime.ALL

    def capacity(self, prompt_lens: list[int], max_new: int) -> int:
        return max(max(prompt_lens), self.config.kept + self.config.interval) + 1

    @property
    def budget(self) -> int:
        return self.config.kept

    @property
    def keep_first(self) -> int:
        return self.config.sinks

    @property
    def keep_last(self) -> int:
        return self.config.window

    def threshold(self, batch: BatchState) -> int:
        # after prefill compact anything over the kept entries; during decoding wait for `interval` more
        cfg: StreamingLLMConfig = self.config
        return cfg.kept if batch.mode == "prefill" else cfg.kept + cfg.interval - 1

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        """The rule does not look at the content: sinks and recent are the whole budget, so no
        candidate is ever chosen (the base does not ask); every candidate scores the same."""
        cache = batch.cache
        return torch.zeros(cache.shape.kv_heads, n - self.keep_first - self.keep_last, device=cache.device)
