"""The builders of the process's runtimes (`process.runtimes()`), each made on first need from
vLLM's config.

The CPU backend's metadata builder calls `runtime_for` (SFI) and `evict_for` once per step; the
CUDA backend makes its eviction runtime while the model loads (`evict_for(force=True)`); the step's
pipeline calls `steer_for`. The SFI and eviction runtimes are made only when a request has asked
for them (or, on CUDA, before the graphs are captured), so a dense engine never allocates anything.
"""

from __future__ import annotations

import logging

import torch

from cotserve.vllm import compat
from cotserve.vllm.process import runtimes
from cotserve.vllm.settings import settings
from cotserve.vllm.sfi_access import SFIAccess
from cotserve.vllm.sfi_runtime import SFIRuntime

log = logging.getLogger(__name__)


def evict_for(vllm_config, device: torch.device, force: bool = False, slots: int | None = None):
    """The eviction runtime (`evict_runtime.EvictRuntime`), built on the first step that has an
    evicting request (None before that), or now with `force` (CUDA: before graph capture)."""
    proc = runtimes()
    if proc.evict is not None:
        return proc.evict
    if settings().evict_slots == 0:  # left out (the scheduler evicts nothing then)
        return None
    if not force and not any(r.evict is not None for r in proc.rows.rows.values()):
        return None
    from cotserve.vllm.evict_runtime import EvictRuntime

    layers = sorted(compat.attention_layers(vllm_config), key=SFIAccess.layer_index)
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    first = layers[0].impl
    ev = EvictRuntime(len(layers), first.num_heads, first.num_kv_heads, first.head_size, first.scale, mc.dtype,
                      device, slots=slots or sc.max_num_seqs, max_tokens=sc.max_num_batched_tokens,
                      tokenizer=model_tokenizer(mc, "SkipKV's sentences"), on_device_tables=device.type == "cuda",
                      block_size=vllm_config.cache_config.block_size,
                      max_rows=max(sc.max_num_seqs, vllm_config.compilation_config.max_cudagraph_capture_size or 0))
    ev.layers = layers
    proc.evict = ev
    log.info("eviction: runtime ready (%d layers, %d slots)", len(layers), ev.slots)
    if "EvictingScheduler" not in str(sc.scheduler_cls):
        log.warning("eviction: vLLM's scheduler is %s, not cotserve.vllm.scheduler.EvictingScheduler: evicting "
                    "requests compact their entries but their blocks do not return to the pool", sc.scheduler_cls)
    return ev


def steer_for(vllm_config):
    """The steering runtime once the model has a steering hook (None otherwise)."""
    proc = runtimes()
    if proc.steer_buffers is None:
        return None
    if proc.steer is None:
        from cotserve.vllm.steer_runtime import SteerRuntime

        proc.steer = SteerRuntime(model_tokenizer(vllm_config.model_config, "steering boundaries"))
    return proc.steer


def model_tokenizer(mc, purpose: str):
    """The served model's tokenizer, for the policies' sentence and thought boundaries; None (with a
    warning: those boundaries then never fire) when vLLM runs without one or it cannot load."""
    if compat.skip_tokenizer_init(mc):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
    except Exception as exc:
        log.warning("no tokenizer for %s (%s): they never fire", purpose, exc)
        return None


def runtime_for(vllm_config, layer_names: list[str], device: torch.device) -> SFIAccess | None:
    """The CPU backend's SFI runtime, built on the first step that has an SFI request (None before that)."""
    proc = runtimes()
    if proc.sfi_access is not None:
        return proc.sfi_access
    if not any(r.sfi is not None for r in proc.rows.rows.values()):
        return None
    ordered = sorted(compat.attention_layers(vllm_config), key=SFIAccess.layer_index)
    mc = vllm_config.model_config
    first = ordered[0]
    tok = model_tokenizer(mc, "SFI's sentence boundaries (refreshes come from max_interval only)")
    rt = SFIRuntime(len(ordered), first.impl.num_heads, first.impl.num_kv_heads, first.impl.head_size,
                    first.impl.scale, mc.dtype, device, tok)
    proc.sfi_access = SFIAccess(rt, ordered, proc.rows)
    log.info("sfi: runtime ready (%d layers)", len(ordered))
    return proc.sfi_access
