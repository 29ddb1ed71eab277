"""SFI's knobs. Every field is a `--policy-opt sfi.NAME=VALUE` (or a YAML/JSON key, or a
per-request option). docs/policies-paper-fidelity.md lists each default and where it comes from."""

from __future__ import annotations

from dataclasses import dataclass

from cotserve.policies.base import PolicyConfig

TRIGGERS = ("boundary", "fixed_periodic", "disabled")
FUSIONS = ("geometric", "linear")
KERNELS = ("auto", "torch", "paged")
COMPACT_DTYPES = ("auto", "cache", "bfloat16")


@dataclass
class SFIConfig(PolicyConfig):
    # Defaults are the paper's ("Default SFI configuration", Sec. 5.1 of arXiv:2603.12038; the
    # refinement values also Sec. 5.4, Tables 6-7). Fields the paper leaves unstated keep the
    # reconstruction documented in docs/policies-paper-fidelity.md; additions of ours are off.
    # memory layout (paper Sec. 5.1: 4 sinks, a 256-token recent window, K = 2048 per KV head)
    sinks: int = 4  # first entries always read (attention sinks)
    recent: int = 256  # most recent entries, read in place from the main cache
    k: int = 2048  # selected entries per KV head (capped by what exists)
    obs_window: int = 1  # decode query rows per refresh (paper Sec. 5.1: W = 1 for decode)
    prefill_window: int = 16  # prompt query rows at the bootstrap (paper Sec. 5.1: tail window W = 16)
    # trigger (paper Sec. 5.1: a boundary-token set and a refresh budget T_max = 64)
    trigger: str = "boundary"  # boundary | fixed_periodic | disabled
    min_gap: int = 1  # ours (1 = off): a boundary refresh waits until this many steps since the last refresh
    max_interval: int = 64  # refresh budget T_max: a refresh is forced after this many steps
    cooldown: int = 0  # ours (0 = off): boundaries seen this soon after a refresh are dropped
    period: int = 32  # fixed_periodic: refresh every `period` steps
    # selector: evidence
    alpha: float = 0.5  # power-mean exponent over query rows (0 = log-mean; with W = 1 it has no effect)
    # selector: prior (paper Sec. 3.2: key-norm factor, global decay + tail brake)
    norm_power: float = 1.0  # key-norm factor exponent (0 = off)
    decay: float = 1.0  # global position decay (log-factor -decay * distance / context)
    tail: int = -1  # tail-brake length; -1 = the recent window
    brake: float = 0.05  # tail-brake factor at the newest position
    # selector: fusion (paper Sec. 3.2: reverse-KL, i.e. geometric, fusion; lambda* clipped)
    fusion: str = "geometric"  # geometric (paper, reverse KL) | linear
    lam: float = -1.0  # fusion weight; negative = per-head stability rule lambda*
    lam_clip: float = 0.02  # lambda* is clipped to [0, lam_clip] (paper Sec. 5.1 / Table 6: 0.02)
    # selector: diversity (paper Sec. 3.3; strengths Sec. 5.1 / Table 7)
    nms_window: int = 2  # soft-NMS half-window (positions)
    nms_strength: float = 0.5  # soft-NMS penalty at full overlap (nats; paper alpha_soft = 0.5)
    excl_strength: float = 0.35  # cross-head exclusivity penalty (nats, at most; paper alpha_cross = 0.35)
    excl_temperature: float = 1.0  # ownership softmax temperature
    # unstable-head fallback (ours, not in the paper; dense_heads=0, the default, is the paper's SFI)
    dense_heads: float = 0.0  # at most this fraction of a sequence's KV heads (all layers) take the fallback read
    dense_min: float = 0.01  # ... and only heads whose support_instability exceeds this
    dense_budget: int = 1024  # entries a fallback head reads per step by Quest page bounds (0 = all)
    dense_page: int = 4  # page size of those bounds (Quest uses 16)
    # fast-step implementation (ours; results equal up to float rounding)
    # auto: the C++ CPU kernel (kernels/cpu_decode.cpp) on a CPU with a float32 cache, where it builds; the paged
    # Triton runtime under the native engine's CUDA graphs | torch | paged: that runtime (policies/sfi/graph.py)
    kernel: str = "auto"
    compact_dtype: str = "auto"  # auto: bfloat16 under the kernel with bf16 weights (bf16w), else cache | cache | bfloat16

    def validate(self) -> None:
        for name in ("sinks", "recent", "nms_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.dense_budget < 0:
            raise ValueError(f"dense_budget must be >= 0 (got {self.dense_budget})")
        for name in ("k", "obs_window", "prefill_window", "min_gap", "max_interval", "period", "dense_page"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 (got {self.cooldown})")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {', '.join(TRIGGERS)} (got {self.trigger!r})")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)} (got {self.kernel!r})")
        if self.compact_dtype not in COMPACT_DTYPES:
            raise ValueError(f"compact_dtype must be one of {', '.join(COMPACT_DTYPES)} (got {self.compact_dtype!r})")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)} (got {self.fusion!r})")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0 (got {self.alpha})")
        if not 0.0 < self.brake <= 1.0:
            raise ValueError(f"brake must be in (0, 1] (got {self.brake})")
        if not 0.0 <= self.dense_heads <= 1.0:
            raise ValueError(f"dense_heads must be a fraction in [0, 1] (got {self.dense_heads})")
        if not 0.0 <= self.dense_min <= 1.0:
            raise ValueError(f"dense_min must be in [0, 1] (got {self.dense_min})")
        if self.lam_clip < 0 or self.excl_temperature <= 0:
            raise ValueError("lam_clip must be >= 0 and excl_temperature > 0")
        if self.fusion == "linear" and self.lam > 1.0:
            raise ValueError(f"linear fusion needs lam <= 1 (got {self.lam})")

    @property
    def tail_len(self) -> int:
        return self.recent if self.tail < 0 else self.tail
