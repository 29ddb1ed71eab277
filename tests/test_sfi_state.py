"""SFI's per-request state: one base (`policies/sfi/state.py`) under the CPU runtime's and the paged form's."""

from __future__ import annotations

from dataclasses import fields

from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.paged import SlotState
from cotserve.policies.sfi.state import SFIRequestState, ring_size, sfi_telemetry
from cotserve.vllm.sfi_runtime import SeqState

SHARED = {f.name for f in fields(SFIRequestState)}


def test_both_forms_extend_the_one_state():
    assert issubclass(SeqState, SFIRequestState) and issubclass(SlotState, SFIRequestState)
    assert {"cfg", "trigger", "prompt_len", "kv_len", "steps", "slow_steps", "retained_sum", "k_eff", "ring_pos",
            "refresh_pos", "refresh_blocks"} == SHARED
    own = {f.name for f in fields(SeqState)} - SHARED
    assert own == {"ring", "ck", "cv", "cpos", "evidence", "read_acc"}
    assert {f.name for f in fields(SlotState)} - SHARED == {"slot", "refresh_n", "refresh_lo", "refresh_hi",
                                                            "short_steps", "short", "catch_up", "catch_up_steps",
                                                            "wait_steps"}


def test_start_takes_the_trigger_and_the_ring_from_the_options():
    cfg = SFIConfig(trigger="fixed_periodic", period=9, min_gap=3, max_interval=40, cooldown=2, obs_window=8,
                    prefill_window=12)
    st = SlotState.start(cfg, 100, slot=3)
    assert isinstance(st, SlotState) and st.slot == 3 and st.prompt_len == 100 and st.cfg is cfg
    t = st.trigger
    assert (t.mode, t.period, t.min_gap, t.max_interval, t.cooldown) == ("fixed_periodic", 9, 3, 40, 2)
    assert st.ring_pos == [-1] * ring_size(cfg) == [-1] * 12
    seq = SeqState.start(cfg, 7, read_acc=0.5)
    assert isinstance(seq, SeqState) and seq.ring_pos == [-1] * 12 and seq.read_acc == 0.5 and seq.ring is None


def test_the_telemetry_is_the_same_for_both_forms():
    cfg = SFIConfig()
    a, b = SeqState.start(cfg, 10), SlotState.start(cfg, 10, slot=0)
    for st in (a, b):
        st.steps, st.slow_steps, st.retained_sum, st.k_eff = 8, 2, 6.0, 64
    want = {"sfi_steps": 8, "sfi_slow_steps": 2, "sfi_slow_step_ratio": 0.25, "sfi_retained_ratio": 0.75,
            "sfi_selected_per_head": 64}
    assert sfi_telemetry(a) == sfi_telemetry(b) == want
    b.short_steps = 5  # the paged form's own count
    assert list(sfi_telemetry(b)) == [*want, "sfi_short_dense_steps"] and sfi_telemetry(b)["sfi_short_dense_steps"] == 5
    b.catch_up_steps, b.wait_steps = 8, 3  # a late admission's dense steps
    assert {k: sfi_telemetry(b)[k] for k in ("sfi_catch_up_dense_steps", "sfi_wait_dense_steps")} == {
        "sfi_catch_up_dense_steps": 8, "sfi_wait_dense_steps": 3}
    empty = SeqState.start(cfg, 10).telemetry()
    assert empty["sfi_slow_step_ratio"] == 0.0 and empty["sfi_retained_ratio"] == 1.0
