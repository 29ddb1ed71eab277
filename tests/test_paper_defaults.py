"""The methods' defaults are their papers' (docs/policies-paper-fidelity.md cites each); our
additions are named options that are off by default."""

from __future__ import annotations

from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger
from cotserve.policies.skipkv import SkipKVConfig


def _fires(trig, boundaries, steps):
    return [t for t in range(steps) if trig.step(t, t in boundaries)]


def test_sfi_defaults_are_the_papers():
    c = SFIConfig()
    # SFI Sec. 5.1 "Default SFI configuration"
    assert (c.sinks, c.recent, c.k, c.max_interval) == (4, 256, 2048, 64)
    assert (c.obs_window, c.prefill_window) == (1, 16)
    assert (c.lam_clip, c.nms_strength, c.excl_strength) == (0.02, 0.5, 0.35)
    assert c.fusion == "geometric" and c.lam < 0  # reverse-KL fusion, lambda by the stability rule
    # additions of ours, off
    assert c.dense_heads == 0.0 and (c.min_gap, c.cooldown) == (1, 0)


def test_paper_trigger_refreshes_after_every_boundary_and_at_the_budget():
    cfg = SFIConfig()
    trig = RefreshTrigger(cfg.trigger, cfg.min_gap, cfg.max_interval, cfg.cooldown, cfg.period)
    # boundaries right after one another each refresh (no spacing), and T_max forces one
    assert _fires(trig, {3, 4, 10}, 140) == [3, 4, 10, 74, 138]
    spaced = RefreshTrigger("boundary", min_gap=32, max_interval=64, cooldown=4)  # the named addition
    assert _fires(spaced, {3, 4, 10}, 140) == [31, 95]


def test_sfi_boundary_set_has_the_papers_characters(engine):
    from cotserve.policies.boundaries import sentence_end_ids

    ids = sentence_end_ids(engine.tokenizer)
    for text in (".", "?", "!", ";", "\n"):
        enc = engine.tokenizer.encode(text, add_special_tokens=False)
        assert len(enc) == 1 and enc[0] in ids, text
    assert engine.tokenizer.encode(",", add_special_tokens=False)[0] not in ids


def test_skipkv_segments_the_output_only_by_default():
    assert SkipKVConfig().prompt_sentences is False
    assert 0.95 <= SkipKVConfig().sentence_threshold <= 0.99  # the paper's range
