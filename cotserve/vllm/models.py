"""vLLM's own model classes with two additions, registered in its model registry under cotserve's
own architecture names (`register_models`; `architectures.py`: an engine selects them with
`hf_overrides`, a plain vLLM engine keeps vLLM's classes), so vLLM's model code is used as it is:

* the last layer's final-norm hidden states of every step are copied into a persistent buffer
  (`process.runtimes().hidden`, a `hidden.HiddenBuffer`), where SkipKV's sentence tracking reads
  them at the next step; only once the worker has an eviction runtime (on CUDA before the graphs
  are captured, on a CPU from the first evicting request on). The copy is a tensor op, so it is
  part of a captured CUDA graph;
* when the engine has a steering vector, a hook on its layer steers the tokens `steer_runtime`
  marks (`steer_runtime.install`; the process keeps the hook's inputs);
* on CUDA, cotserve's runtimes are made while the model loads, so vLLM counts their memory
  (`gpu_memory.at_model_load`).
"""

from __future__ import annotations

import torch

from cotserve.vllm import compat
from cotserve.vllm.architectures import PREFIX, own_name
from cotserve.vllm.process import runtimes


def _wrapped(base: type) -> type:
    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        from cotserve.vllm.steer_runtime import install

        buffers = install(self, vllm_config)  # the steering hook, when the engine has a vector
        if buffers is not None:
            runtimes().steer_buffers = buffers
        if torch.cuda.is_available():
            from cotserve.vllm.gpu_memory import at_model_load

            at_model_load(vllm_config)  # cotserve's buffers counted as model memory

    def forward(self, *args, **kwargs):
        out = base.forward(self, *args, **kwargs)
        proc = runtimes()
        if isinstance(out, torch.Tensor) and proc.evict is not None:  # only an eviction runtime reads them
            proc.hidden.capture(out)
        return out

    return type(own_name(base.__name__), (base,), {"__init__": __init__, "forward": forward, "__module__": __name__,
                                                      "__doc__": f"vLLM's {base.__name__} + final hidden states."})


def __getattr__(name: str) -> type:
    """`CotserveLlamaForCausalLM` etc., built on first use (the vLLM modules load lazily)."""
    base = name.removeprefix(PREFIX)
    if name.startswith(PREFIX) and base in compat.MODEL_CLASSES:
        cls = _wrapped(compat.model_class(base))
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register_models() -> None:
    """cotserve's classes under cotserve's names only (`CotserveLlamaForCausalLM`, ...)."""
    for base in compat.MODEL_CLASSES:
        compat.register_model(own_name(base), f"{__name__}:{own_name(base)}")
