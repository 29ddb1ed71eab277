"""Client input never gives a 5xx and no message names a server path: here, a data directory
named but missing is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cotserve.errors import CotserveError


# -- the data directory -----------------------------------------------------------------------------
def test_a_data_dir_named_but_missing_is_an_error(tmp_path, monkeypatch):
    from cotserve.data import data_dir

    missing = str(tmp_path / "nope")
    monkeypatch.delenv("COTSERVE_DATA_DIR", raising=False)
    with pytest.raises(CotserveError, match=r"^--data-dir .*nope does not exist$"):
        data_dir(missing)
    with pytest.raises(CotserveError, match="does not exist"):
        data_dir(missing, required=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CotserveError, match="is not a directory"):
        data_dir(str(tmp_path / "file"))
    monkeypatch.setenv("COTSERVE_DATA_DIR", missing)
    with pytest.raises(CotserveError, match=r"^\$COTSERVE_DATA_DIR .*nope does not exist$"):
        data_dir(required=False)
    assert data_dir(str(tmp_path)) == tmp_path  # the option wins over the variable
    monkeypatch.setenv("COTSERVE_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path


def test_the_cli_names_a_missing_data_dir_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTSERVE_")}
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", "math500", "--data-dir",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: --data-dir {tmp_path / 'nope'} does not exist"]
