"""The CUDA attention backend (vLLM 0.26): FlashAttention plus SFI per request, graph-safe.

Registered as `AttentionBackendEnum.CUSTOM` (a subclass of vLLM's FlashAttention backend). Every
decode step, FULL CUDA graph or not, runs the same launches per layer:

1. vLLM's FlashAttention over every row, with the lengths of SFI fast rows set to one entry (it
   reads nothing of their history); dense rows and SFI slow rows read their whole history;
2. `kernels.sfi_paged.sfi_paged_fast`, one program per (row, KV head) on a fixed grid, which
   writes the step's query rows of SFI requests into their rings and overwrites the fast rows'
   outputs with attention over compact buffer + recent window.

Which row is what lives in persistent GPU tensors that the metadata builder fills before every
step (outside the graph); so do the FlashAttention lengths. The refreshes (bootstrap after the
prompt, slow steps) need the evidence of the last `obs_window` queries over the whole history:
the queries are in the ring and the keys in the paged cache, so the builder computes it at the
next step, with the selector and the re-pack (`GraphSFI.refresh`), in eager torch outside the
graph; the selection it makes is read from that step on, exactly as in the native engine.

Memory: compact buffers of `slots x layers x KV heads x (sinks + k_max) x head_dim` for K and V
in the cache dtype, allocated while the model loads, so vLLM's KV cache is sized around them
(`gpu_memory`):
`COTSERVE_VLLM_SFI_SLOTS` (default: the engine's max_num_seqs, at most 64, no more than fit in an
eighth of the memory the KV cache would get (`gpu_memory.sfi_slots`); none in a plain `vllm serve`
with prefix caching on, where SFI is not served) SFI requests run at once; another decodes
densely, see `docs/vllm.md`. `COTSERVE_VLLM_SFI_MAX_K` (default: SFI's default k) caps k.
"""

from __future__ import annotations

import logging
import re

import torch

from cotserve.policies.options import SFIOptions, option_default
from cotserve.policies.sfi.paged import slot_bytes
from cotserve.vllm import compat, gpu_memory
from cotserve.vllm.compat import FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder
from cotserve.vllm.flash_paged import FlashPagedKV, split_kv
from cotserve.vllm.graph_sfi import GraphSFI
from cotserve.vllm.process import runtimes
from cotserve.vllm.settings import settings
from cotserve.vllm.step_plan import plan_step

log = logging.getLogger(__name__)
_LAYER = re.compile(r"layers\.(\d+)\.")


def _runtime(vllm_config, device, at_load: bool = False) -> GraphSFI:
    """The process's CUDA SFI runtime (`process.runtimes().graph_sfi`), made at the first call; made
    while the model loads (`at_load`), its slots are sized by the memory the KV cache would get."""
    proc = runtimes()
    if proc.graph_sfi is None:
        layers = compat.attention_layers(vllm_config)
        ordered = sorted(layers, key=lambda m: int(_LAYER.search(m.layer_name).group(1)))
        mc, sc = vllm_config.model_config, vllm_config.scheduler_config
        first = ordered[0].impl
        max_rows = max(sc.max_num_seqs, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
        given = settings().sfi_max_k
        max_k = given if given is not None else option_default(SFIOptions, "k")
        per_slot = slot_bytes(len(ordered), first.num_heads, first.num_kv_heads, first.head_size, mc.dtype, max_k)
        kv_memory = gpu_memory.kv_memory(vllm_config, device) if at_load else None
        terms = (sc.max_num_seqs, bool(vllm_config.cache_config.enable_prefix_caching),
                 gpu_memory.started_by_cotserve(vllm_config))
        evicts = "EvictingScheduler" in str(getattr(sc, "scheduler_cls", None) or "")
        slots = gpu_memory.sfi_slots(*terms, per_slot=per_slot, fixed=gpu_memory.sfi_fixed_bytes(mc.dtype, evicts),
                                     kv_memory=kv_memory)
        unsized = gpu_memory.sfi_slots(*terms)
        if slots < unsized:  # the memory rule lowered the number
            (log.warning if slots == 0 else log.info)(
                "sfi: %d slots, not %d: SFI's buffers (%.2f GiB a slot) take at most an eighth of the %.1f GiB "
                "the KV cache would get%s; COTSERVE_VLLM_SFI_SLOTS sets the number", slots, unsized,
                per_slot / 2**30, kv_memory / 2**30, " (SFI requests decode densely)" if slots == 0 else "")
        max_k = max_k if slots else 0
        from cotserve.vllm.runtime_builders import model_tokenizer

        tok = model_tokenizer(mc, "SFI's sentence boundaries (refreshes come from max_interval only)")
        proc.graph_sfi = GraphSFI(ordered, first.num_heads, first.num_kv_heads, first.head_size, first.scale,
                                  mc.dtype, device, slots=slots, max_rows=max_rows, rows=proc.rows, max_k=max_k,
                                  tokenizer=tok)
    return proc.graph_sfi


def _evict_runtime(vllm_config, device):
    """The eviction runtime, made before the graphs are captured (its ring write is in them);
    `COTSERVE_VLLM_EVICT_SLOTS=0` leaves it out."""
    from cotserve.vllm import runtime_builders

    given = settings().evict_slots
    slots = given if given is not None else vllm_config.scheduler_config.max_num_seqs
    if slots <= 0 or "EvictingScheduler" not in str(vllm_config.scheduler_config.scheduler_cls or ""):
        return None  # left out, or no eviction served (asynchronous scheduling or prefix caching on)
    return runtime_builders.evict_for(vllm_config, device, force=True, slots=slots)


def _at_model_load(vllm_config) -> tuple[torch.device, bool, bool] | None:
    """Both runtimes, made while the model loads (`gpu_memory`), when its attention layers run this
    backend; returns (device, SFI slots made?, eviction runtime made?), or None."""
    layers = compat.attention_layers(vllm_config)
    if not layers or not isinstance(layers[0].impl, CotserveFlashImpl):
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    sfi = _runtime(vllm_config, device, at_load=True).slots > 0
    return device, sfi, _evict_runtime(vllm_config, device) is not None


class CUDASFIStage:
    """SFI's part of the step on CUDA (`step_plan.SFIStage`), on the runtime made while the model
    loaded: the refreshes due run on the cache as the last step left it; the plan fills the row
    tensors the captured graphs read and gives FlashAttention its lengths."""

    def __init__(self, sfi: GraphSFI, head_size: int):
        self.sfi, self.head_size = sfi, head_size

    def before_compaction(self, cm, block_size: int) -> None:
        self.sfi.refresh_due(cm, block_size)

    def plan(self, cm, block_size: int, evict):
        return compat.metadata_with(cm, seq_lens=self.sfi.step(cm, block_size, self.head_size, evict=evict))

    def step_kinds(self) -> tuple[int, int, int]:
        return self.sfi.step_refreshes, self.sfi.step_slow, self.sfi.step_sfi


class CotserveFlashMetadataBuilder(FlashAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        gpu_memory.release_scratch()  # vLLM measured the model with it: its memory is the working tensors' now
        self.sfi = _runtime(vllm_config, device)
        self.evict = _evict_runtime(vllm_config, device)
        self.paged_rw = FlashPagedKV(self.block_size, self.head_size_of())
        self.stage = CUDASFIStage(self.sfi, self.head_size_of())

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = plan_step(self.vllm_config, common_attn_metadata, self.block_size, self.stage, self.evict,
                       self.paged_rw)
        return super().build(common_prefix_len, cm, fast_build)

    def head_size_of(self) -> int:
        return compat.flash_head_size(self)


class CotserveFlashImpl(FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        proc = runtimes()
        rt = proc.graph_sfi
        if attn_metadata is None or rt is None:
            return out
        ev = proc.evict
        if not rt.warmed_up and kv_cache.numel() and not torch.cuda.is_current_stream_capturing():
            kc, vc = split_kv(kv_cache, self.head_size)
            rt.warm_up(int(_LAYER.search(layer.layer_name).group(1)), query.view(-1, self.num_heads, self.head_size),
                       output.view(output.shape[0], self.num_heads, self.head_size), kc, vc, attn_metadata.block_table)
        if not rt.any_sfi and ev is None and not torch.cuda.is_current_stream_capturing():
            return out  # an eager step with no cotserve policy in it: vLLM's attention alone
        li = int(_LAYER.search(layer.layer_name).group(1))
        t = query.shape[0]
        q = query.view(t, self.num_heads, self.head_size)
        o = output.view(output.shape[0], self.num_heads, self.head_size)
        kc, vc = split_kv(kv_cache, self.head_size)
        rows = min(t, rt.max_rows, attn_metadata.block_table.shape[0])
        if ev is not None:
            ev.record(li, q)
            ev.accumulate(li, q, kv_cache, attn_metadata.block_table, key_cache=kc,  # h2o: `kernels.h2o_paged`
                          rows=min(t, ev.max_rows, attn_metadata.block_table.shape[0]))
        rt.attend_fast(li, q, o, kc, vc, attn_metadata.block_table, rows=rows, row_cws=rt.row_cws[li])
        return out


class CotserveFlashBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return CotserveFlashImpl

    @staticmethod
    def get_builder_cls():
        return CotserveFlashMetadataBuilder


gpu_memory.on_model_load(_at_model_load)
