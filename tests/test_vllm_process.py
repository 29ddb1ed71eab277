"""The worker process's runtimes live in one object (`cotserve.vllm.process`), not in module globals."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from cotserve.vllm import process
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.hidden import HiddenBuffer

VLLM = Path(__file__).resolve().parent.parent / "cotserve" / "vllm"


def test_one_instance_and_reset_empties_it_in_place():
    proc = process.runtimes()
    assert process.runtimes() is proc
    assert isinstance(proc.rows, BatchRows) and isinstance(proc.hidden, HiddenBuffer)
    proc.rows.add(0, RowRequest([1, 2], []))
    proc.hidden.capture(torch.ones(3, 4))
    proc.scratch = torch.empty(8, dtype=torch.uint8)
    proc.reserved["scratch"] = 8
    rows = proc.rows
    try:
        assert process.reset() is proc and process.runtimes() is proc
        assert proc.rows is not rows and not proc.rows.rows and proc.hidden.buf is None
        assert proc.scratch is None and proc.reserved == {}
        assert all(getattr(proc, name) is None for name in ("sfi_access", "graph_sfi", "evict", "steer",
                                                            "steer_buffers"))
    finally:
        process.reset()


def test_the_release_of_the_scratch_goes_through_the_process():
    from cotserve.vllm import gpu_memory

    proc = process.runtimes()
    proc.scratch = torch.empty(8, dtype=torch.uint8)
    try:
        gpu_memory.release_scratch()
        assert proc.scratch is None
    finally:
        process.reset()


def test_no_module_of_the_plugin_keeps_a_runtime_in_a_global():
    """Only the plugin's registration flags (`cotserve/vllm/__init__.py`) use a `global` statement."""
    found = []
    for path in sorted(VLLM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found.append(f"{path.name}: {', '.join(node.names)}")
    assert found == ["__init__.py: _registered, _declined"], found
