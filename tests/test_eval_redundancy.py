"""The reasoning-redundancy report: sentence splitting, the batched similar-pair count against its
per-pair torch reference, non-execution thoughts by the policy's rules, and the real
all-MiniLM-L6-v2 model (shipped in a package, loaded offline) on replies written for the test."""

from __future__ import annotations

import pytest
import torch

from cotserve.eval.redundancy import (
    Embedder,
    maybe_report,
    non_execution,
    redundancy_report,
    similar_pairs,
    similar_pairs_reference,
    split_sentences,
)


def test_split_sentences():
    text = "First we add 5 and 13. That gives 18!\nWait, check it.\n\n- \n18?"
    assert split_sentences(text) == ["First we add 5 and 13.", "That gives 18!", "Wait, check it.", "18?"]
    assert split_sentences("") == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_count_agrees_with_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 16, generator=g)
    # near-duplicates (cosine well above 0.95), exact repeats and unrelated rows
    emb = torch.cat([base, base[:3] + 0.01 * torch.randn(3, 16, generator=g), base[:2] * 3.0])
    fast, ref = similar_pairs(emb), similar_pairs_reference(emb)
    assert fast == ref and fast[0] >= 5 and fast[1] == 11 * 10 // 2
    for t in (0.0, 0.5, 0.99):
        assert similar_pairs(emb, t) == similar_pairs_reference(emb, t)
    assert similar_pairs(emb[:1]) == (0, 0)


def test_non_execution_thoughts_follow_the_policy_rules():
    text = "We add 5 and 13.\nWait, let me verify that.\nAlternatively, count up.\nSo 18."
    assert non_execution(text) == (2, 4)


@pytest.fixture(scope="module")
def minilm():
    try:
        return Embedder()
    except RuntimeError as exc:
        pytest.fail(f"the bundled all-MiniLM-L6-v2 must load offline (make installs cotserve[redundancy]): {exc}")


def test_real_model_finds_repeated_sentences_and_splits_by_outcome(minilm):
    looping = ("Each box holds 6 eggs. There are 3 boxes. Each box holds 6 eggs. There are 3 boxes. "
               "Each box holds six eggs. So the total is 18.")
    plain = "The train leaves at noon. It arrives at three. The trip takes three hours."
    records = [
        {"suite": "s", "policy": "a", "content": looping, "reasoning": None, "correct": True},
        {"suite": "s", "policy": "a", "content": plain, "reasoning": None, "correct": False},
        {"suite": "s", "policy": "b", "content": plain, "reasoning": "Wait, check.\nOk.", "correct": True},
    ]
    rep = redundancy_report(records, ["s"], ["a", "b"], minilm)
    a, b = rep["runs"]
    assert a["correct"]["similar_pair_share"] > 0.1  # the repeated sentences (cosine 1.0)
    assert a["incorrect"]["similar_pair_share"] == 0.0  # three different sentences
    assert b["non_execution_share"] == pytest.approx(1 / 3, abs=1e-3)  # "Wait, check." of 3 lines
    assert rep["model"] == "all-MiniLM-L6-v2" and rep["sentences"] == 6 + 3 + 5


def test_off_and_unknown_model():
    recs = [{"suite": "s", "policy": "a", "content": "x. y.", "reasoning": None, "correct": True}]
    assert maybe_report(recs, ["s"], ["a"], None) is None
    bad = maybe_report(recs, ["s"], ["a"], "/nonexistent/model-folder")
    assert bad["runs"] == [] and "cannot load" in bad["error"]
