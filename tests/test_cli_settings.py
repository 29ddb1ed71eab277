"""Every serve/worker option from the environment (COTSERVE_<COMMAND>_<OPTION>) or from a YAML
file (`cotserve --config FILE`), checked through refusals the CLI makes before anything loads:
`serve` binding publicly without a key, `worker` given a metrics port out of range."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REFUSAL = "refusing to serve on 0.0.0.0 without an API key"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("COTSERVE_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "cotserve.cli", *args], capture_output=True, text=True,
                          timeout=120, env=e)


def test_an_option_from_the_environment():
    proc = _cli("serve", env={"COTSERVE_SERVE_HOST": "0.0.0.0"})
    assert proc.returncode == 2 and REFUSAL in proc.stderr


@pytest.mark.parametrize("text", ["serve:\n  host: 0.0.0.0\n  max-batch: 4\n", "host: 0.0.0.0\nmax_batch: 4\n"])
def test_options_from_a_config_file(tmp_path, text):
    cfg = tmp_path / "cotserve.yaml"
    cfg.write_text(text)
    proc = _cli("--config", str(cfg), "serve")
    assert proc.returncode == 2 and REFUSAL in proc.stderr


def test_a_bad_config_file_is_one_clear_error(tmp_path):
    missing = _cli("--config", str(tmp_path / "nope.yaml"), "serve")
    assert missing.returncode == 2 and "cannot read --config" in missing.stderr and "Traceback" not in missing.stderr
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    proc = _cli("--config", str(listed), "serve")
    assert proc.returncode == 2 and "expected a mapping" in proc.stderr


def test_worker_metrics_port_from_the_environment_or_a_config_file(tmp_path):
    refusal = "--metrics-port must be a port number"
    args = ("worker", "--redis-url", "redis://127.0.0.1:1/0")  # refused before Redis is reached
    proc = _cli(*args, env={"COTSERVE_WORKER_METRICS_PORT": "70000"})
    assert proc.returncode == 2 and refusal in proc.stderr and "Traceback" not in proc.stderr
    cfg = tmp_path / "cotserve.yaml"
    cfg.write_text("worker:\n  metrics-port: -1\n")
    proc = _cli("--config", str(cfg), *args)
    assert proc.returncode == 2 and refusal in proc.stderr
    proc = _cli(*args, "--stats-interval", "-1")
    assert proc.returncode == 2 and "--stats-interval must be at least 0" in proc.stderr


@pytest.mark.parametrize("text, message", [
    ("serve: {prot: 8001}\n", "serve has no option 'prot' (did you mean port?)"),
    ("prot: 8001\n", "serve has no option 'prot' (did you mean port?)"),
    ("serve: {port: 8001}\nwroker: {heartbeat: 2}\n", "has no command 'wroker' (did you mean worker?)"),
    ("bench: {decode: {contextz: 5}}\n", "bench decode has no option 'contextz' (did you mean context, contexts?)"),
])
def test_a_config_key_no_option_has_is_refused_with_the_closest_names(tmp_path, text, message):
    cfg = tmp_path / "cotserve.yaml"
    cfg.write_text(text)
    proc = _cli("--config", str(cfg), "serve")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
