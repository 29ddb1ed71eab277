"""`RowTracker`: a vLLM logits processor that changes no logits and tracks the batch's rows.

Loaded by entry point (`vllm.logits_processors`), so every engine in an environment with cotserve
installed has it; on an engine that did not ask for cotserve (`architectures.asks_for_cotserve`)
it gives no request a policy, so cotserve's attention backend runs exactly vLLM's attention there.
`validate_params` refuses, when a request arrives, a cotserve policy the vLLM engine cannot run
(the client gets a 400 from vLLM's server, a `RequestError` from cotserve's).
"""

from __future__ import annotations

import logging

import torch

from cotserve.errors import CotserveError
from cotserve.vllm import compat
from cotserve.vllm.architectures import asks_for_cotserve
from cotserve.vllm.batch_rows import RequestPolicy, RowRequest, request_policy_of
from cotserve.vllm.compat import BatchUpdate, LogitsProcessor, MoveDirectionality
from cotserve.vllm.process import runtimes

log = logging.getLogger(__name__)


class RowTracker(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            request_policy_of(sampling_params.extra_args)
        except CotserveError as exc:
            raise ValueError(str(exc)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows = runtimes().rows
        self.engaged = asks_for_cotserve(vllm_config)
        # a prefix-cache hit skips the prompt's query rows SFI's first selection reads: an SFI request
        # decodes densely then, unless it computes its whole prompt (`skip_reading_prefix_cache`, which
        # `cotserve serve` sets for every SFI request, `params.reads_whole_prompt`)
        self.prefix_caching = compat.prefix_caching(vllm_config)
        self._warned = False

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.remove(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            try:
                engaged = self.engaged and params is not None
                pol = request_policy_of(params.extra_args) if engaged else RequestPolicy()
            except CotserveError:  # validate_params refused it already; never reached in practice
                pol = RequestPolicy()
            if pol.sfi is not None and self.prefix_caching and not compat.skips_prefix_cache(params):
                if not self._warned:
                    log.warning("sfi: prefix caching is on and this SFI request may read a cached prefix, so it "
                                "decodes densely (start vLLM with --no-enable-prefix-caching, or serve it through "
                                "cotserve serve --engine vllm, whose SFI requests compute their whole prompt)")
                    self._warned = True
                pol.sfi = None
            prompt = list(prompt_ids or [])
            # a request resumed after a preemption prefills its prompt and its output so far
            self.rows.add(index, RowRequest(prompt, output_ids, sfi=pol.sfi, evict=pol.evict, steer=pol.steer,
                                            prefill_len=len(prompt) + len(output_ids or [])))
        for src, dst, direction in batch_update.moved:
            self.rows.move(src, dst, direction == MoveDirectionality.SWAP)
