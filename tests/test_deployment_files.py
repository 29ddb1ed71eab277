"""The deployment files a user runs as they are: docker-compose.yml (no `docker compose` here, so
its structure is checked against what compose and cotserve need) and both Dockerfiles."""

from __future__ import annotations

import re
from pathlib import Path

import typer
import yaml

from cotserve.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", str(text))
    assert m, text
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def test_every_service_has_a_healthcheck_limits_and_a_drain_window():
    from cotserve.gateway.server import ServeArgs

    for name, svc in SERVICES.items():
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL"), name
        if name == "redis":
            continue
        assert _seconds(svc["stop_grace_period"]) > ServeArgs().drain_s, name
        if "gpu" not in svc.get("profiles", []):
            assert svc["deploy"]["resources"]["limits"]["memory"], name


def test_gpu_workers_request_nvidia_devices_under_the_gpu_profile():
    gpu = {n: s for n, s in SERVICES.items() if "gpu" in s.get("profiles", [])}
    assert len(gpu) >= 2
    ids = set()
    for name, svc in gpu.items():
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"], name
        ids.update(dev["device_ids"])
        assert svc["build"]["dockerfile"] == "Dockerfile.gpu"
        assert svc["command"][:4] == ["cotserve", "worker", "--engine", "vllm"]
    assert len(ids) == len(gpu)  # one GPU each


def test_the_commands_use_options_the_cli_has():
    cmd = typer.main.get_command(app)
    for name, svc in SERVICES.items():
        argv = svc.get("command", [])
        if not argv or argv[0] != "cotserve":
            continue
        sub = cmd.commands[argv[1]]
        known = {o for p in sub.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg in known, f"{name}: {arg} is not an option of cotserve {argv[1]}"


def test_the_images_run_as_a_user_without_privileges():
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        lines = [ln.strip() for ln in (ROOT / dockerfile).read_text().splitlines()]
        users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), dockerfile
        assert any(ln.startswith("ENV") and "COTSERVE_CACHE_DIR=" in ln for ln in lines), dockerfile
