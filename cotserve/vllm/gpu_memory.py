"""cotserve's GPU memory inside vLLM's budget (CUDA).

vLLM sizes its KV cache as `gpu_memory_utilization` x the GPU's memory minus what loading the model
took (measured around `load_model`), the profile run's peak and the non-torch memory. The
attention metadata builders are first made later, in the CUDA-graph memory profile, after that
peak was read: buffers allocated there are counted nowhere, and the KV cache takes their memory.

So the runtimes are made while the model loads (`at_model_load`, called at the end of cotserve's
model classes' `__init__`, inside `load_model`, runs what the CUDA backend registered with
`on_model_load`): SFI's compact buffers and rings, the eviction
runtime's rings and score buffers count as model memory. So does a scratch reservation for the
working tensors of SFI's refreshes and the eviction's compactions (`scratch_bytes`); it is
released when the first metadata builder is made, after vLLM measured the model, so that memory
is there for those tensors while the KV cache stays sized around it.

Everything here is a guest's: when it cannot run it logs one line and the runtimes are made by the
builders as before (their memory is then outside vLLM's budget: leave headroom).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from cotserve.vllm.process import runtimes
from cotserve.vllm.settings import settings

log = logging.getLogger(__name__)


# the key of vLLM's `additional_config` under which `cotserve serve/worker --engine vllm` describes
# itself to the plugin in vLLM's processes ({"engine": True}: started by cotserve)
COTSERVE_CONFIG = "cotserve"


def started_by_cotserve(vllm_config) -> bool:
    from cotserve.vllm.compat import additional_config

    return bool((additional_config(vllm_config).get(COTSERVE_CONFIG) or {}).get("engine"))


# the most of the memory vLLM's KV cache would get that SFI's buffers may take when the number of
# slots is not given. A slot holds about what C tokens of KV cache hold (C ~ 2,100 at the paper's
# k), so with an eighth the KV cache keeps 7/8 of what stock `vllm serve` gets, and there are about
# as many slots as requests of 8 x C tokens or more fit in it at once (those SFI speeds up most)
SFI_MEMORY_SHARE = 1 / 8


def sfi_slots(max_num_seqs: int, prefix_caching: bool, by_cotserve: bool, per_slot: int = 0, fixed: int = 0,
              kv_memory: int | None = None) -> int:
    """SFI requests a CUDA engine decodes at once (its compact buffers' slots):
    `$COTSERVE_VLLM_SFI_SLOTS` when set; else max_num_seqs, at most 64, and, when `kv_memory` (the
    bytes vLLM's KV cache would get without cotserve) is known, no more than fit `SFI_MEMORY_SHARE`
    of it at `per_slot` bytes a slot after the `fixed` bytes SFI needs whatever the slots (none
    when even one does not fit). None in a plain `vllm serve` with prefix caching on: its SFI
    requests may read a cached prefix, so they decode densely (the row tracker), and the memory
    stays vLLM's. Started by cotserve, SFI requests compute their whole prompt
    (`params.reads_whole_prompt`) and run beside prefix caching."""
    if prefix_caching and not by_cotserve:
        return 0
    given = settings().sfi_slots
    if given is not None:
        return max(0, given)
    n = min(max_num_seqs, 64)
    if kv_memory is not None and per_slot > 0:
        n = min(n, max(0, int((kv_memory * SFI_MEMORY_SHARE - fixed) // per_slot)))
    return n


def sfi_fixed_bytes(dtype: torch.dtype, evict: bool = False) -> int:
    """What an engine with SFI slots reserves whatever their number: the refreshes' logits buffer
    (`PagedSFI.reserve_logits`) and the working tensors (`scratch_bytes`, the eviction's when the
    engine evicts too)."""
    from cotserve.policies.sfi.paged import REFRESH_FLOATS

    return 4 * (REFRESH_FLOATS + REFRESH_FLOATS // 16) + scratch_bytes(dtype, sfi=True, evict=evict)


def kv_memory(vllm_config, device: torch.device) -> int | None:
    """The bytes vLLM's KV cache would get without cotserve's reservation, as far as they are known
    while the model loads: `gpu_memory_utilization` x the device's memory less what is allocated now
    (the model's weights; the profile run's peak comes later and is not counted). None where the
    reservation takes nothing from the KV cache (`kv_cache_memory_bytes` given: vLLM then sizes the
    cache to it whatever the model holds), where it cannot be read, and across several GPUs (each
    rank would read its own memory, and the ranks must agree on the slots); the slots are then not
    sized by memory."""
    try:
        cc = vllm_config.cache_config
        if getattr(cc, "kv_cache_memory_bytes", None):
            return None
        if device.type != "cuda":
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return None
        total = torch.cuda.mem_get_info(device)[1]
        return max(0, int(cc.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device))
    except Exception:  # a guest: sized as before
        return None


def scratch_bytes(dtype: torch.dtype, sfi: bool, evict: bool) -> int:
    """Bytes of working tensors the biggest refresh or compaction holds at once:
    `$COTSERVE_VLLM_SCRATCH_MIB` when set, else, when the engine has SFI slots, `REFRESH_FLOATS`
    floats for a refresh's tensors besides its logits (those have their own buffer, made with the
    runtime: `PagedSFI.reserve_logits`) or, with the eviction runtime, a compaction's gathered
    K and V (`GROUP_ELEMENTS` in the model dtype) and its similarity scores (twice `SCORE_FLOATS`
    floats), whichever is larger; 0 with neither."""
    mib = settings().scratch_mib
    if mib is not None:
        return max(0, mib) << 20
    from cotserve.policies.sfi.paged import REFRESH_FLOATS

    need = 4 * REFRESH_FLOATS if sfi else 0
    if evict:
        from cotserve.vllm.evict_runtime import GROUP_ELEMENTS, SCORE_FLOATS

        elem = torch.empty((), dtype=dtype).element_size()
        need = max(need, GROUP_ELEMENTS * elem + 2 * 4 * SCORE_FLOATS)
    return need


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


# what makes the runtimes at model load: `cuda_backend` registers it when vLLM imports that backend
# (while the attention layers are built, before the model's `__init__` ends)
_AT_LOAD: list[Callable[[Any], tuple[torch.device, bool, bool] | None]] = []


def on_model_load(fn: Callable[[Any], tuple[torch.device, bool, bool] | None]) -> None:
    """Register `fn(vllm_config)`: makes the runtimes, returns (device, SFI slots made?, eviction
    runtime made?), or None when the model does not run cotserve's backend."""
    if fn not in _AT_LOAD:
        _AT_LOAD.append(fn)


def at_model_load(vllm_config) -> None:
    """Make the runtimes and the scratch reservation now (inside vLLM's model loading), where the
    model's attention runs cotserve's CUDA backend; otherwise nothing. Never raises. The process
    keeps the reservation and its sizes (`process.runtimes()`: `scratch`, `reserved`)."""
    proc = runtimes()
    reserved = proc.reserved
    try:
        for fn in _AT_LOAD:
            before = _allocated()
            made = fn(vllm_config)
            if made is None:
                continue
            device, sfi, evict = made
            reserved["runtimes"] = _allocated() - before
            n = scratch_bytes(vllm_config.model_config.dtype, sfi, evict)
            proc.scratch = torch.empty(n, dtype=torch.uint8, device=device) if n else None
            reserved["scratch"] = n
            log.info("cotserve reserved %.2f GiB inside vLLM's budget (runtimes %.2f, working tensors %.2f)",
                     sum(reserved.values()) / 2**30, reserved["runtimes"] / 2**30, n / 2**30)
    except Exception as exc:  # a guest: the builders make the runtimes as before
        log.warning("cotserve could not reserve its GPU memory at model load (%s: %s); its buffers are "
                    "allocated outside vLLM's budget (leave headroom with --gpu-memory-utilization)",
                    type(exc).__name__, exc)


def release_scratch() -> None:
    """Hand the scratch reservation to PyTorch's allocator (the first metadata builder calls it)."""
    runtimes().scratch = None
