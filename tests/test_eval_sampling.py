"""Sampling conventions: the unbiased pass@k estimator against hand computations, maj@n, intervals
over items (not over items x samples), presets from generation_config.json, the LiveCodeBench
contest-date window, the aime25 suite, and the report's sampling section."""

from __future__ import annotations

import json
import math

import pytest

from cotserve.errors import CotserveError
from cotserve.eval.loaders import load_suite, parse_suites, parse_window
from cotserve.eval.presets import read_generation_config, resolve_sampling
from cotserve.eval.report import aggregate, render_markdown
from cotserve.eval.sampling import (
    item_interval,
    ks_for,
    majority_correct,
    pass_at_k,
    sample_metrics,
    t_quantile,
)


@pytest.mark.parametrize("n,c,k,want", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 4, 1.0),
    (4, 2, 1, 0.5), (4, 2, 2, 1 - 1 / 6), (4, 2, 3, 1.0),  # C(2,2)/C(4,2) = 1/6
    (4, 0, 4, 0.0), (4, 4, 1, 1.0),
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
])
def test_pass_at_k_matches_hand_computation(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_is_the_chance_a_draw_of_k_holds_a_correct_one():
    """Counted by brute force over every k-subset of the n samples."""
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks_reported():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6] and ks_for(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("df,t", [(1, 12.706205), (2, 4.302653), (5, 2.570582), (29, 2.045230), (100, 1.983972)])
def test_t_quantile_textbook_values(df, t):
    assert t_quantile(0.95, df) == pytest.approx(t, abs=1e-5)


def test_interval_treats_an_item_as_one_unit():
    """Ten items, four samples each: items 0-4 always right, 5-9 always wrong. The interval is the
    one of ten per-item scores (t with 9 df), far wider than one over 40 'independent' replies."""
    records = [{"id": str(i), "sample": s, "correct": i < 5, "extracted": "1" if i < 5 else "2"}
               for i in range(10) for s in range(4)]
    m = sample_metrics(records, 4, "gsm8k")
    lo, hi = m["avg@4"]["ci95"]
    half = t_quantile(0.95, 9) * 0.5270463 / math.sqrt(10)  # sd of five 1s and five 0s
    assert m["avg@4"]["value"] == 0.5 and m["avg@4"]["items"] == 10
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-4)
    assert hi - lo > 0.7  # a binomial interval over 40 replies would be about 0.3 wide
    assert item_interval([1.0]) == (0.0, 1.0) and item_interval([0.5, 0.5]) == (0.5, 0.5)


def test_sample_metrics_on_known_counts():
    """Item a: 1 of 4 correct; item b: 2 of 4; item c: 0 of 4."""
    correct = {"a": [True, False, False, False], "b": [False, True, True, False], "c": [False] * 4}
    extracted = {"a": ["7", "3", "3", "5"], "b": ["4", "9", "9", "4"], "c": [None, None, "1", None]}
    records = [{"id": i, "sample": s, "correct": correct[i][s], "extracted": extracted[i][s]}
               for i in correct for s in range(4)]
    m = sample_metrics(records, 4, "gsm8k")
    assert set(m) == {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"}
    assert m["pass@1"]["value"] == pytest.approx((0.25 + 0.5 + 0) / 3, abs=1e-4)
    assert m["avg@4"]["value"] == m["pass@1"]["value"]
    assert m["pass@2"]["value"] == pytest.approx((0.5 + (1 - 1 / 6) + 0) / 3, abs=1e-4)
    assert m["pass@4"]["value"] == pytest.approx(2 / 3, abs=1e-4)
    # a: 3 wins (wrong); b: 4 and 9 tie 2-2, 4 came first (wrong); c: only 1 votes (wrong)
    assert m["maj@4"]["value"] == 0.0
    for name in m:
        lo, hi = m[name]["ci95"]
        assert 0 <= lo <= m[name]["value"] <= hi <= 1


def test_majority_vote_groups_equal_answers():
    assert majority_correct([("5", True), ("5.0", True), ("6", False)])  # correct answers form one group
    assert not majority_correct([("6", False), ("5", True), ("6.00", False)], lambda a, b: float(a) == float(b))
    assert not majority_correct([("6", False), ("5", True)])  # a 1-1 tie goes to the answer given first
    assert majority_correct([("5", True), ("6", False)])
    assert not majority_correct([(None, True), (None, True), ("6", False)])  # no extraction: no vote


def test_code_suites_report_no_majority_vote():
    records = [{"id": "p", "sample": s, "correct": s == 0, "extracted": "print(1)"} for s in range(2)]
    m = sample_metrics(records, 2, "code")
    assert "maj@2" not in m and m["pass@2"]["value"] == 1.0


def _records(n_items: int, samples: int) -> list[dict]:
    recs = []
    for i in range(n_items):
        for s in range(samples):
            recs.append({"suite": "aime24", "policy": "dense", "id": f"q{i}", "sample": s, "correct": (i + s) % 3 == 0,
                         "extracted": str(i + s), "completion_tokens": 10, "t_start": 0.0, "t_end": 1.0,
                         "finish_reason": "stop", "telemetry": {}})
    return recs


def test_report_shows_pass_at_k_and_majority_with_intervals():
    run = aggregate(_records(5, 4), n_items=5, samples=4, kind="math")
    assert {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"} <= set(run["metrics"])
    assert run["accuracy"] == run["metrics"]["avg@4"]["value"]
    results = {"meta": {"samples": 4, "generation": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 8}},
               "suites": ["aime24"], "policies": ["dense"],
               "runs": [{"suite": "aime24", "policy": "dense", "spec": "dense", "options": {}, **run}]}
    text = render_markdown(results, [])
    assert "## Sampling" in text and "| aime24 | pass@4 |" in text and "| aime24 | maj@4 |" in text
    assert "Temperature 0 with" not in text
    assert "Two runs of the same greedy request" in text and "batch" in text and "dtype" in text
    results["meta"]["generation"]["temperature"] = 0
    assert "Temperature 0 with 4 samples" in render_markdown(results, [])


def test_report_names_the_engine_dtype_and_batching_that_greedy_replies_depend_on():
    run = aggregate(_records(2, 1), n_items=2, samples=1, kind="math")
    results = {"meta": {"samples": 1, "generation": {"model": "m", "temperature": 0, "top_p": 1.0, "max_tokens": 8},
                        "backend": {"mode": "local", "model": "m", "device": "cpu", "dtype": "bfloat16",
                                    "max_batch": 8}},
               "suites": ["aime24"], "policies": ["dense"],
               "runs": [{"suite": "aime24", "policy": "dense", "spec": "dense", "options": {}, **run}]}
    text = render_markdown(results, [])
    assert "- model: `m` via local native engine (cpu, bfloat16, max batch 8)" in text
    assert "Two runs of the same greedy request" in text and "`meta.backend`" in text
    results["meta"]["backend"] = {"mode": "endpoint", "endpoint": "http://127.0.0.1:8000/v1", "model": "m",
                                  "concurrency": 4, "api": "chat"}
    text = render_markdown(results, [])
    assert ("via http://127.0.0.1:8000/v1 (chat API, concurrency 4; the server's engine, dtype and batching are "
            "not known here)") in text


# -- presets -----------------------------------------------------------------------------------------

def test_r1_preset_reads_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))
    values, sources = resolve_sampling("r1", tmp_path, None, None, None)
    assert values == {"temperature": 0.7, "top_p": 0.8, "max_tokens": 32768}
    assert sources["temperature"].startswith("generation_config.json") and sources["max_tokens"] == "preset r1"
    values, _ = resolve_sampling("r1", tmp_path / "nowhere", None, None, None)  # no file: R1's own values
    assert values == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 32768}
    values, sources = resolve_sampling("r1", tmp_path, 0.0, None, 64)  # flags given win
    assert values == {"temperature": 0.0, "top_p": 0.8, "max_tokens": 64}
    assert sources["temperature"] == "--temperature" and sources["max_tokens"] == "--max-tokens"
    values, _ = resolve_sampling("none", tmp_path, None, None, None)
    assert values == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 2048}
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4096, "temperature": 0.5}))
    values, _ = resolve_sampling("model", tmp_path, None, None, None)
    assert values == {"temperature": 0.5, "top_p": 1.0, "max_tokens": 4096}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CotserveError, match="cannot parse"):
        read_generation_config(tmp_path)
    with pytest.raises(CotserveError, match="--preset 'r2'"):
        resolve_sampling("r2", None, None, None, None)


# -- suites: the contest-date window and aime25 ------------------------------------------------------

def test_livecodebench_date_window(data_dir):
    (ref,) = parse_suites("livecodebench")
    every = load_suite(ref, data_dir)
    window = parse_window("2023-09-01", "2023-09-30")
    inside = load_suite(ref, data_dir, window=window)
    days = [str(i.meta["contest_date"])[:10] for i in every]
    assert len(inside) == sum("2023-09-01" <= d <= "2023-09-30" for d in days) > 0
    assert all("2023-09-01" <= str(i.meta["contest_date"])[:10] <= "2023-09-30" for i in inside)
    assert [i.id for i in load_suite(ref, data_dir, limit=2, window=window)] == [i.id for i in inside[:2]]
    last = max(days)
    assert {str(i.meta["contest_date"])[:10] for i in load_suite(ref, data_dir, window=parse_window(last, None))} \
        == {last}
    for bad in (("2023-13-01", None), ("Sept 1", None), ("2023-09-30", "2023-09-01")):
        with pytest.raises(CotserveError):
            parse_window(*bad)


def test_aime25_reads_its_file_and_says_what_is_missing(tmp_path):
    (ref,) = parse_suites("aime25")
    with pytest.raises(CotserveError, match="aime2025.jsonl not found in the data directory.*id.*problem.*answer"):
        load_suite(ref, tmp_path)
    rows = [{"id": "2025-I-1", "problem": "A made-up problem: what is 6 times 7?", "answer": "042"},
            {"id": "2025-I-2", "problem": "Another made-up one: 10 + 5?", "answer": "15"}]
    (tmp_path / "aime2025.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_suite(ref, tmp_path)
    assert [(i.id, i.kind, i.answer) for i in items] == [("2025-I-1", "math", "42"), ("2025-I-2", "math", "15")]
    assert parse_suites("aime2025")[0].name == "aime25"


def test_cli_aime25_missing_is_one_error_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", "aime25", "--data-dir", str(tmp_path),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: suite aime25: aime2025.jsonl not found")
    assert "Traceback" not in r.stderr


def test_cli_date_window_needs_a_code_suite(tmp_path, data_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", "gsm8k", "--date-from", "2023-09-01",
                        "--data-dir", str(data_dir), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no code suite" in r.stderr


def test_unknown_preset_fails_before_loading(tmp_path):
    import subprocess
    import sys

    (tmp_path / "x.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", f"custom:{tmp_path}/x.jsonl",
                        "--preset", "nope", "--out", str(tmp_path), "--model", str(tmp_path / "no-model")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "error: --preset 'nope': expected none, model, r1\n"
