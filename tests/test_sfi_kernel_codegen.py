"""SFI's kernels as the GPU gets them: compiled here ahead of time for an H100/H200 (sm_90,
Triton's CUDA backend needs no GPU to compile) with the specializations a launch on vLLM's cache
gives (pointers and strides divisible by 16). The refresh kernels' key and value reads must stay
128-bit vector loads, and so must the fast step's copies of the query rows into the rings. Reading a layer at an offset from the first layer's pointer hides the alignment from the
compiler unless the kernel states it: without that, the same kernels read the cache 2 bytes at a time."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cotserve.kernels import sfi_paged as sp
from cotserve.kernels import sfi_refresh as sr

pytestmark = pytest.mark.skipif(not sr.HAVE_TRITON, reason="triton not installed")


def _jit(kernel):
    """The compilable kernel, also where the tests run Triton's interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, do_not_specialize=kernel.kwargs.get("do_not_specialize"))


def _ptx_loads(kernel_name: str, types: dict[str, str], constexprs: dict[str, int]) -> dict[str, int]:
    """Compile in this process (run where Triton's interpreter is off: it is chosen when Triton is imported)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _jit(getattr(sp if kernel_name.startswith("_sfi_fast") else sr, kernel_name))
    sig, attrs = {}, {}
    skip = {kernel.arg_names[n] if isinstance(n, int) else n for n in kernel.do_not_specialize}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if name not in skip and sig[name] != "fp32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32))
    return dict(collections.Counter(re.findall(r"ld\.global[\.\w]*", compiled.asm["ptx"])))


def _loads(kernel_name: str, types: dict[str, str], constexprs: dict[str, int]) -> collections.Counter:
    """The kernel's global loads in its sm_90 PTX, compiled in a fresh process where Triton's
    interpreter is off (the tests' conftest turns it on for this one)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = ("import json, sys; from tests.test_sfi_kernel_codegen import _ptx_loads; "
            "print(json.dumps(_ptx_loads(*json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([kernel_name, types, constexprs])], env=env,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        if "FileNotFoundError" in out.stderr:  # a Triton install without its CUDA tools (ptxas)
            pytest.skip(f"Triton cannot compile for CUDA here: {out.stderr.strip().splitlines()[-1]}")
        raise AssertionError(out.stderr[-3000:])
    return collections.Counter(json.loads(out.stdout.strip().splitlines()[-1]))


def test_ring_logits_read_keys_in_vector_loads():
    loads = _loads("_ring_logits_kernel",
                   {"RING": "*bf16", "SLOTS": "*i32", "RIDX": "*i32", "RPOS": "*i32", "KC": "*bf16", "KOFF": "*i64",
                    "BT": "*i32", "OUT": "*fp32", "NORM": "*fp32", "scale": "fp32"},
                   {"G": 4, "R": 1, "RP": 16, "D": 128, "BS": 16, "BLOCK_N": 64})
    assert loads["ld.global.v4.b32"] >= 8 and loads["ld.global.b16"] == 0, loads


def test_pack_reads_keys_and_values_in_vector_loads():
    loads = _loads("_pack_kernel",
                   {"KEEP": "*i64", "TPOS": "*i64", "BT": "*i32", "KC": "*bf16", "VC": "*bf16", "KOFF": "*i64",
                    "VOFF": "*i64", "CK": "*bf16", "CV": "*bf16", "CPOS": "*i32", "SLOTS": "*i32", "CCOUNT": "*i32"},
                   {"C": 2112, "D": 128, "BS": 16, "BLOCK": 64, "HAS_COUNT": True})
    assert loads["ld.global.v4.b32"] >= 16 and loads["ld.global.b16"] == 0, loads


@pytest.mark.parametrize("kernel", ["_sfi_fast_kernel", "_sfi_fast_split_kernel"])
def test_fast_step_with_its_ring_writes_compiles_for_sm90(kernel):
    """The fast step as served (its compact reads bounded by the slot's count of entries in use) that
    also does the step's ring writes (a loop over writes with runtime bounds) compiles for the GPU and copies each query row (32 heads x 128 = 4,096 elements, four blocks of
    1,024) in 16-byte loads: four more than the same kernel without the writes."""
    types = {"Q": "*bf16", "Out": "*bf16", "CK": "*bf16", "CV": "*bf16", "CPOS": "*i32", "KC": "*bf16", "VC": "*bf16",
             "BT": "*i32", "ROW_MODE": "*i32", "ROW_SLOT": "*i32", "ROW_TOK": "*i32", "ROW_WS": "*i32",
             "ROW_LEN": "*i32", "CWS": "*i32", "PM": "*fp32", "PL": "*fp32", "PACC": "*fp32", "scale": "fp32",
             "RING": "*bf16", "W_TOK": "*i64", "W_SLOT": "*i64", "W_IDX": "*i64", "CCOUNT": "*i32"}
    consts = {"C": 2112, "G": 4, "GP": 16, "D": 128, "BS": 16, "BLOCK_N": 64, "HD": 4096, "WBLOCK": 1024,
              "HAS_COUNT": True}
    if kernel == "_sfi_fast_split_kernel":
        consts.update(CHUNK=1088, NS=3)
    with_writes = _loads(kernel, types, {**consts, "RING_WRITES": True})
    without = _loads(kernel, types, {**consts, "RING_WRITES": False})
    assert with_writes["ld.global.v4.b32"] - without["ld.global.v4.b32"] >= 4, (with_writes, without)
    assert with_writes["ld.global.b16"] == 0, with_writes
