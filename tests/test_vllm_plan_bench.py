"""`python -m cotserve.bench.vllm_plan`: the SFI step plan's host time, on the CPU here (one JSON line
per batch size, every row planned as a fast step), and its refusals of bad sizes."""

from __future__ import annotations

import json

from cotserve.bench import vllm_plan


def test_each_size_is_one_line_with_every_row_fast(capsys):
    assert vllm_plan.main(["--rows", "2,5", "--steps", "4", "--device", "cpu"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["rows"], x["fast_rows"], x["steps"]) for x in lines] == [(2, 2, 4), (5, 5, 4)]
    assert all(x["host_ms_per_step"] > 0 for x in lines)


def test_bad_sizes_are_refused_in_one_line(capsys):
    assert vllm_plan.main(["--rows", "two", "--device", "cpu"]) == 2
    assert "separated by commas" in capsys.readouterr().err
    assert vllm_plan.main(["--rows", "0", "--device", "cpu"]) == 2
    assert vllm_plan.main(["--rows", "200", "--device", "cpu"]) == 2
