"""Device and dtype picking: the compute dtype (activations, KV cache) and the dtype the linear
layers' weights are stored in."""

from __future__ import annotations

from pathlib import Path

import torch

from cotserve.errors import ModelError


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but torch sees no CUDA device")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
WEIGHT_ONLY = ("bf16w",)  # bf16 linear weights; activations and the KV cache stay float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX-BF16, from
    /proc/cpuinfo): only then do bf16 weights halve the bytes a decode step streams without a
    slow emulated matmul."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype (activations, KV cache): `auto` is bf16 on CUDA and float32 on CPU;
    `bf16w` computes in float32 (its weights are bf16, `pick_weight_dtype`)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype in WEIGHT_ONLY:
        return torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, float32, bf16w, bfloat16 or float16")
    return DTYPES[dtype]


def pick_weight_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype the linear layers' weights are stored in when it differs from the compute dtype
    (None: the same). `bf16w` stores them in bf16; `auto` does so on a CPU with native bf16 dot
    products (`cpu_has_native_bf16`), where it makes a float32 model's decode steps stream half
    the weight bytes."""
    if dtype in WEIGHT_ONLY or (dtype == "auto" and device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return None
