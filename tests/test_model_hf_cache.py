"""`--model` with a Hugging Face id: resolved from the local Hugging Face cache, offline; an id
that is not cached is a clear error (cotserve never downloads)."""

from __future__ import annotations

import os
import subprocess
import sys

from cotserve.models import resolve_model

SNIPPET = """
import sys
from cotserve.errors import ModelError
from cotserve.models import resolve_model
for spec in sys.argv[1:]:
    try:
        print(resolve_model(spec))
    except ModelError as exc:
        print("error:", exc)
"""


def _resolve(specs: list[str], cache) -> list[str]:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", SNIPPET, *specs], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_hugging_face_ids_resolve_from_the_local_cache_only(tmp_path):
    bundled = resolve_model("smollm2-135m-instruct")
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in bundled.iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    cached, missing, plain = _resolve(["acme/tiny-chat", "acme/not-here", "no-slash-name"], tmp_path / "hub")
    assert cached == str(snap)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(cached).max_position_embeddings == 8192
    assert missing.startswith("error:") and "not in the local Hugging Face cache" in missing and "hf download" in missing
    assert plain.startswith("error: unknown model")
