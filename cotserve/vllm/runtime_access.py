"""The worker process's one `SFIRuntime`, built at the first step from vLLM's config.

Attention backends call `runtime_for` from their metadata builder (once per step) and `current`
from their layers. The runtime is created only when a request has asked for SFI, so a dense
engine never allocates anything.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from cotserve.vllm import compat
from cotserve.vllm.requests import ROWS
from cotserve.vllm.settings import settings
from cotserve.vllm.sfi_runtime import SFIRuntime, StepPlan

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Access:
    runtime: SFIRuntime
    layers: list  # vLLM Attention modules in layer order
    paged: object = None

    def kv_caches(self) -> list[torch.Tensor]:
        return layer_caches(self.layers)

    @staticmethod
    def layer_index(layer) -> int:
        m = _LAYER.search(layer.layer_name)
        return int(m.group(1)) if m else 0

    def select_pending(self) -> None:
        """Pending selections of requests that also evict, before the eviction runtime's `plan`
        (`SFIRuntime.select_pending`)."""
        if self.paged is not None:
            self.runtime.select_pending(ROWS, self.paged, self.kv_caches())

    def plan_step(self, cm, block_size: int, evict=None) -> StepPlan | None:
        """The step's SFI plan; `evict`: the eviction runtime whose `plan` rewrote `cm` to physical terms."""
        if not any(r.sfi is not None for r in ROWS.rows.values()) and not ROWS.released:
            self.runtime.plan_now = None
            return None
        if self.paged is None:
            self.paged = make_paged(self.layers[0], block_size, self.runtime.dtype)
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        lens, positions = None, None
        if evict is not None and any(r.sfi is not None and r.evict is not None for r in ROWS.rows.values()):
            from cotserve.vllm.compat import host_lens

            lens = host_lens(cm)[: cm.num_reqs].tolist()

            def positions(req, n: int) -> torch.Tensor | None:
                est = req.evict_state
                return evict.positions(est, n) if est is not None and est.pos is not None else None

        return self.runtime.plan(ROWS, cm.num_reqs, qsl, self.paged, self.kv_caches(), cm.block_table_tensor,
                                 lens, positions)


_ACCESS: Access | None = None


def layer_caches(layers: list) -> list[torch.Tensor]:
    """Each layer's paged KV cache tensor."""
    return [compat.layer_cache(layer) for layer in layers]


def current() -> Access | None:
    return _ACCESS


def make_paged(layer, block_size: int, dtype: torch.dtype):
    """The CPU cache reader (this runtime serves the CPU backend; CUDA has `graph_sfi`)."""
    from cotserve.vllm.cpu_paged import CPUPagedKV, key_layout

    return CPUPagedKV(block_size, key_layout(compat.cpu_isa(layer), dtype, layer.impl.head_size))


_EVICT = None


def evict_current():
    return _EVICT


def evict_for(vllm_config, device: torch.device, force: bool = False, slots: int | None = None):
    """The eviction runtime (`evict_runtime.EvictRuntime`), built on the first step that has an
    evicting request (None before that), or now with `force` (CUDA: before graph capture)."""
    global _EVICT
    if _EVICT is not None:
        return _EVICT
    if settings().evict_slots == 0:  # left out (the scheduler evicts nothing then)
        return None
    if not force and not any(r.evict is not None for r in ROWS.rows.values()):
        return None
    from cotserve.vllm.evict_runtime import EvictRuntime

    layers = sorted(compat.attention_layers(vllm_config), key=Access.layer_index)
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    first = layers[0].impl
    _EVICT = EvictRuntime(len(layers), first.num_heads, first.num_kv_heads, first.head_size, first.scale, mc.dtype,
                          device, slots=slots or sc.max_num_seqs, max_tokens=sc.max_num_batched_tokens,
                          tokenizer=model_tokenizer(mc, "SkipKV's sentences"), on_device_tables=device.type == "cuda",
                          block_size=vllm_config.cache_config.block_size,
                          max_rows=max(sc.max_num_seqs, vllm_config.compilation_config.max_cudagraph_capture_size or 0))
    _EVICT.layers = layers
    log.info("eviction: runtime ready (%d layers, %d slots)", len(layers), _EVICT.slots)
    if "EvictingScheduler" not in str(sc.scheduler_cls):
        log.warning("eviction: vLLM's scheduler is %s, not cotserve.vllm.scheduler.EvictingScheduler: evicting "
                    "requests compact their entries but their blocks do not return to the pool", sc.scheduler_cls)
    return _EVICT


_STEER = None


def steer_for(vllm_config):
    """The steering runtime once the model has a steering hook (None otherwise)."""
    global _STEER
    from cotserve.vllm import steer_runtime

    if steer_runtime.BUFFERS is None:
        return None
    if _STEER is None:
        _STEER = steer_runtime.SteerRuntime(model_tokenizer(vllm_config.model_config, "steering boundaries"))
    return _STEER


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


def runtime_for(vllm_config, layer_names: list[str], device: torch.device) -> Access | None:
    """The runtime, built on the first step that has an SFI request (None before that)."""
    global _ACCESS
    if _ACCESS is not None:
        return _ACCESS
    if not any(r.sfi is not None for r in ROWS.rows.values()):
        return None
    ordered = sorted(compat.attention_layers(vllm_config), key=Access.layer_index)
    mc = vllm_config.model_config
    first = ordered[0]
    tok = model_tokenizer(mc, "SFI's sentence boundaries (refreshes come from max_interval only)")
    rt = SFIRuntime(len(ordered), first.impl.num_heads, first.impl.num_kv_heads, first.impl.head_size,
                    first.impl.scale, mc.dtype, device, tok)
    _ACCESS = Access(rt, ordered)
    log.info("sfi: runtime ready (%d layers)", len(ordered))
    return _ACCESS
