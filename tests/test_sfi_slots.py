"""How many SFI slots a vLLM engine makes (`cotserve.vllm.gpu_memory.sfi_slots`) and what a slot
costs (`cotserve.policies.sfi.paged.slot_bytes`): without a number given, SFI's buffers take at most
an eighth of the memory the KV cache would get, so a dense request keeps most of stock vLLM's cache
on a card with little room, and a model too large for any slot serves SFI requests densely."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from cotserve.policies.sfi.paged import PagedSFI, compact_len, slot_bytes
from cotserve.vllm import gpu_memory
from cotserve.vllm.settings import settings

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _no_slots_given(monkeypatch):
    monkeypatch.delenv("COTSERVE_VLLM_SFI_SLOTS", raising=False)
    monkeypatch.delenv("COTSERVE_VLLM_SCRATCH_MIB", raising=False)


def _allocated(p: PagedSFI) -> int:
    return sum(t.numel() * t.element_size() for t in (p.ck, p.cv, p.cpos, p.ring))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_bytes_is_what_a_slot_allocates(dtype):
    shape = dict(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16)
    made = [PagedSFI(**shape, scale=0.25, dtype=dtype, device="cpu", slots=s, max_rows=4, max_k=100)
            for s in (2, 5)]
    assert made[0].C == compact_len(100) == 128
    per = (_allocated(made[1]) - _allocated(made[0])) // 3
    assert per == slot_bytes(**shape, dtype=dtype, max_k=100)


def test_the_slots_fit_an_eighth_of_the_kv_memory():
    per, fixed = 300 << 20, 2 * GiB
    # an 80 GB card with a 4B model: ~64 GiB for the KV cache, an eighth less the fixed part
    assert gpu_memory.sfi_slots(64, False, True, per_slot=per, fixed=fixed, kv_memory=64 * GiB) == 20
    # room for more than the sequence limit: the limit (and never more than 64)
    assert gpu_memory.sfi_slots(16, False, True, per_slot=per, fixed=fixed, kv_memory=1024 * GiB) == 16
    assert gpu_memory.sfi_slots(256, False, True, per_slot=per, fixed=fixed, kv_memory=1024 * GiB) == 64
    # a model that leaves little room: no slot (SFI requests then decode densely), never a negative count
    assert gpu_memory.sfi_slots(64, False, True, per_slot=per, fixed=fixed, kv_memory=8 * GiB) == 0
    # memory not known (the builders made the runtime after the KV cache): the sequence limit, as before
    assert gpu_memory.sfi_slots(64, False, True, per_slot=per, fixed=fixed, kv_memory=None) == 64
    # a plain `vllm serve` with prefix caching on serves no SFI, whatever the memory
    assert gpu_memory.sfi_slots(64, True, False, per_slot=per, fixed=fixed, kv_memory=1024 * GiB) == 0


def test_a_given_number_of_slots_wins_over_the_memory_rule(monkeypatch):
    monkeypatch.setenv("COTSERVE_VLLM_SFI_SLOTS", "48")
    assert settings().sfi_slots == 48
    assert gpu_memory.sfi_slots(64, False, True, per_slot=300 << 20, fixed=2 * GiB, kv_memory=8 * GiB) == 48


def test_the_fixed_part_is_the_logits_buffer_and_the_working_tensors():
    from cotserve.policies.sfi.paged import REFRESH_FLOATS

    p = PagedSFI(1, 2, 1, 16, 0.25, torch.float32, "cpu", slots=1, max_rows=2, max_k=16)
    p.reserve_logits()
    logits = p._logits.numel() * p._logits.element_size()
    assert gpu_memory.sfi_fixed_bytes(torch.bfloat16) == logits + gpu_memory.scratch_bytes(
        torch.bfloat16, sfi=True, evict=False)
    assert logits >= 4 * REFRESH_FLOATS


def test_kv_memory_is_unknown_where_the_reservation_takes_nothing_from_it_and_never_raises():
    # a KV cache of a given size (`--kv-cache-memory-bytes`): vLLM sizes it to that whatever the model
    # holds, so SFI's buffers take nothing from it and the slots are not capped
    given = NS(cache_config=NS(kv_cache_memory_bytes=6 * GiB, gpu_memory_utilization=0.9))
    assert gpu_memory.kv_memory(given, torch.device("cuda", 0)) is None
    by_share = NS(cache_config=NS(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9))
    assert gpu_memory.kv_memory(by_share, torch.device("cpu")) is None  # no CUDA memory to read here
    assert gpu_memory.kv_memory(NS(), torch.device("cuda", 0)) is None  # an unfamiliar config


def test_the_cuda_runtime_made_at_model_load_sizes_its_slots_by_memory(monkeypatch, caplog):
    """`cuda_backend._runtime` (here on CPU tensors, with vLLM's layers and memory reading stood in
    for: no GPU) makes the slots the rule gives at model load, and max_num_seqs when the builders
    make it later (the memory is then not known)."""
    from cotserve.vllm import compat, cuda_backend, runtime_builders
    from cotserve.vllm.process import runtimes

    L, HQ, HKV, D = 2, 4, 2, 16  # noqa: N806
    impl = NS(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=0.25)
    layers = [NS(layer_name=f"model.layers.{i}.self_attn.attn", impl=impl, kv_cache=None) for i in range(L)]
    monkeypatch.setattr(compat, "attention_layers", lambda cfg: layers)
    monkeypatch.setattr(runtime_builders, "model_tokenizer", lambda mc, why: None)
    per = slot_bytes(L, HQ, HKV, D, torch.float32, 2048)
    fixed = gpu_memory.sfi_fixed_bytes(torch.float32)
    monkeypatch.setattr(gpu_memory, "kv_memory", lambda cfg, dev: 8 * (fixed + 3 * per))
    cfg = NS(model_config=NS(dtype=torch.float32), scheduler_config=NS(max_num_seqs=16),
             compilation_config=NS(max_cudagraph_capture_size=0),
             cache_config=NS(enable_prefix_caching=False), additional_config={})
    proc = runtimes()
    monkeypatch.setattr(proc, "graph_sfi", None)
    try:
        with caplog.at_level("INFO", logger="cotserve.vllm.cuda_backend"):
            assert cuda_backend._runtime(cfg, torch.device("cpu"), at_load=True).slots == 3
        assert any("3 slots, not 16" in r.getMessage() for r in caplog.records)
        proc.graph_sfi = None
        assert cuda_backend._runtime(cfg, torch.device("cpu")).slots == 16
        proc.graph_sfi = None  # no room for one slot: none, and a warning says SFI decodes densely
        monkeypatch.setattr(gpu_memory, "kv_memory", lambda cfg, dev: 8 * fixed)
        with caplog.at_level("WARNING", logger="cotserve.vllm.cuda_backend"):
            assert cuda_backend._runtime(cfg, torch.device("cpu"), at_load=True).slots == 0
        assert any(r.levelname == "WARNING" and "decode densely" in r.getMessage() for r in caplog.records)
    finally:
        proc.graph_sfi = None


def test_kv_memory_is_the_share_of_the_card_less_what_the_model_holds(monkeypatch):
    """The CUDA arithmetic, with the card's memory readings stood in for (no GPU here): utilization x
    total memory less what is allocated while the model loads; nothing across several ranks."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7 * GiB)
    cfg = NS(cache_config=NS(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9))
    assert gpu_memory.kv_memory(cfg, torch.device("cuda", 0)) == int(0.9 * 80 * GiB) - 7 * GiB
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 79 * GiB)
    assert gpu_memory.kv_memory(cfg, torch.device("cuda", 0)) == 0  # never negative
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert gpu_memory.kv_memory(cfg, torch.device("cuda", 0)) is None  # ranks would disagree


def test_the_fixed_part_with_eviction_is_the_larger_working_reservation(monkeypatch):
    assert gpu_memory.sfi_fixed_bytes(torch.bfloat16, evict=True) > gpu_memory.sfi_fixed_bytes(torch.bfloat16)
