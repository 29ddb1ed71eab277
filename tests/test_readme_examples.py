"""The README's quick-start requests (the curl line and the openai SDK call with the `cotserve`
extension) run as written against a real embedded server."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import ServerThread

from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.queue import InProcessQueue
from cotserve.worker import Worker

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
DEFAULT_URL = "http://127.0.0.1:8000"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def url(engine):
    queue = InProcessQueue()
    app = create_app(GatewaySettings(model_name="smollm2-135m-instruct"), queue,
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = Worker(engine, queue, worker_id="w-readme", max_batch=4)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    server = ServerThread(app)
    base = server.start()
    deadline = time.time() + 120
    while httpx.get(base + "/ready").status_code != 200:
        assert time.time() < deadline, "server not ready"
        time.sleep(0.05)
    yield base
    server.stop()
    worker.stop()
    thread.join(timeout=60)


def test_openai_sdk_example_with_the_cotserve_extension(url):
    (code,) = [b for b in _blocks("python") if "OpenAI(" in b]
    assert DEFAULT_URL + "/v1" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(DEFAULT_URL, url), "README.md", "exec"), {})  # noqa: S102
    reply, telemetry = out.getvalue().rstrip("\n").rsplit("\n", 1)
    assert reply.strip()
    tele = eval(telemetry, {})  # the printed dict  # noqa: S307
    assert tele["policy"] == "skipkv+sfi" and tele["decode_tok_s"] > 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_example(url):
    (block,) = [b for b in _blocks("bash") if b.lstrip().startswith("curl")]
    command = block.replace("\\\n", " ").replace(DEFAULT_URL, url)
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
