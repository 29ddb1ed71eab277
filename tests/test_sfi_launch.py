"""The fast-step kernel's launch table (kernels/sfi_launch.py): which launch a batch size gets, how a
table is read and refused, and that every launch computes what the torch reference computes (on the
CPU through TRITON_INTERPRET=1; the timing side is `python -m cotserve.bench.tune_sfi_fast`, on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from cotserve.bench import tune_sfi_fast
from cotserve.kernels import sfi_launch as sl
from cotserve.kernels import sfi_paged as sp


def _table(**rows):
    return {"launches": {str(r): {"splits": s, "block_n": b, "num_warps": w, "num_stages": st, "us": 1.0}
                         for r, (s, b, w, st) in rows.items()}}


def test_pick_takes_the_largest_tuned_size_not_above_the_batch():
    table = sl.parse_table({"launches": {"4": {"splits": 9, "block_n": 64, "num_warps": 4, "num_stages": 3},
                                         "16": {"splits": 3, "block_n": 128, "num_warps": 8, "num_stages": 2}}}, "t")
    assert table.pick(1) == sl.FastLaunch(9, 64, 4, 3)  # below every tuned size: the smallest
    assert table.pick(15) == sl.FastLaunch(9, 64, 4, 3)
    assert table.pick(16) == sl.FastLaunch(3, 128, 8, 2)
    assert table.pick(512) == sl.FastLaunch(3, 128, 8, 2)


def test_heuristic_splits_fills_a_small_batch_and_leaves_a_large_one_whole():
    assert sl.heuristic_splits(16, 8, 132) == 3  # 128 programs on 132 multiprocessors: three splits each
    assert sl.heuristic_splits(1, 8, 132) == 16  # capped
    assert sl.heuristic_splits(64, 8, 132) == 1  # 512 programs already fill the GPU


@pytest.mark.parametrize("bad", [{}, {"launches": {"x": {}}}, {"launches": {"4": {"splits": 0, "block_n": 64,
                                                                                   "num_warps": 4, "num_stages": 3}}},
                                 {"launches": {"4": {"splits": 2, "block_n": 48, "num_warps": 4, "num_stages": 3}}},
                                 {"launches": {}}, {"launches": {"0": {"splits": 2, "block_n": 64, "num_warps": 4,
                                                                       "num_stages": 3}}}])
def test_a_malformed_table_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="^tbl.json: "):
        sl.parse_table(bad, "tbl.json")


def test_the_environment_table_is_read_once_and_an_unreadable_one_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(_table(**{"8": (5, 32, 4, 4)})))
    monkeypatch.setenv(sl.ENV_TABLE, str(path))
    monkeypatch.setattr(sl, "_TABLES", {})
    cpu = torch.device("cpu")
    assert sl.launch_table(cpu).launches == {8: sl.FastLaunch(5, 32, 4, 4)}
    path.write_text("not json")  # read once: later changes to the file do not move a running engine
    assert sl.launch_table(cpu).launches == {8: sl.FastLaunch(5, 32, 4, 4)}
    monkeypatch.setattr(sl, "_TABLES", {})
    with pytest.raises(ValueError, match=r"cannot read a launch table from h.json") as err:
        sl.launch_table(cpu)
    assert str(tmp_path) not in str(err.value)  # the file's name, not its path
    monkeypatch.setenv(sl.ENV_TABLE, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json"):
        sl.launch_table(cpu)


def test_without_a_table_or_a_gpu_the_kernel_runs_single_pass(monkeypatch):
    monkeypatch.delenv(sl.ENV_TABLE, raising=False)
    assert sl.launch_table(torch.device("cpu")) is None
    assert sl.fast_launch(16, 8, torch.device("cpu")) == sl.FastLaunch()


def test_shipped_tables_parse_and_are_named_after_their_device():
    for path in sl.CONFIG_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        assert sl.device_file(data["device"]) == path
        assert sl.parse_table(data, path.name)


def test_the_tuner_refuses_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert tune_sfi_fast.main(["--out", str(tmp_path / "t.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.skipif(not sp.HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("launch", [sl.FastLaunch(1, 16, 8, 2), sl.FastLaunch(3, 32, 4, 4), sl.FastLaunch(5, 16, 2, 1)])
def test_every_launch_matches_the_reference(launch):
    from tests.test_sfi_paged_kernel import _case

    q, ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens = _case(3)
    ref = sp.sfi_paged_fast_reference(q, torch.zeros_like(q), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3)
    out = sp.sfi_paged_fast(q, torch.zeros_like(q), ck, cv, cpos, kc, vc, bt, mode, slot, tok, ws, lens, 0.3,
                            launch=launch)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_a_table_measured_on_another_shape_does_not_apply():
    table = sl.parse_table({"shape": {"kv_heads": 8, "head_dim": 128}, **_table(**{"8": (5, 32, 4, 4)})}, "t")
    anyshape = sl.parse_table(_table(**{"8": (5, 32, 4, 4)}), "t")
    assert table.fits(8, 128) and table.fits(8, None) and anyshape.fits(2, 256)
    assert not table.fits(2, 128) and not table.fits(8, 256)
