"""Which request sits in which row of vLLM's persistent batch, and its cotserve policy.

vLLM gives no attention backend the request behind a batch row. Its logits-processor interface
does: every change of the persistent batch (requests added at an index, removed, moved or
swapped) reaches `update_state` before the step's attention metadata is built, with each added
request's `SamplingParams` (whose `extra_args["cotserve"]` carries the policy the gateway took
from the request body) and live references to its prompt and output token ids.
`RowTracker` (the logits processor, `logitsproc.py`) feeds a `BatchRows`, and the attention
backends read it. One `BatchRows` per worker process (`process.runtimes().rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import PolicyError
from cotserve.vllm.settings import settings

# The most observation queries (`window`) an eviction request may ask for on vLLM (its ring size).
MAX_EVICT_WINDOW = 16


def h2o_max_len() -> int:
    """Entries per layer and KV head that h2o's score buffers hold for a request while it decodes
    (`h2o_scores`): `$COTSERVE_VLLM_H2O_MAX_LEN`, default 2048; 0 leaves h2o out."""
    return settings().h2o_max_len


def _check_h2o(part) -> None:
    limit = h2o_max_len()
    need = part.config.budget + part.config.interval
    if need > limit:
        raise PolicyError(f"h2o budget + interval ({need}) exceeds the vllm engine's {limit} entries "
                          "($COTSERVE_VLLM_H2O_MAX_LEN; 0: h2o is off)")


@dataclass
class RowRequest:
    """One request in the persistent batch."""

    prompt_ids: list[int]
    output_ids: list[int]  # vLLM's live list: grows as tokens are sampled
    sfi: Any = None  # SFIConfig when the request asked for SFI
    evict: Any = None  # the native eviction policy object when the request asked for one
    steer: Any = None  # the native steering policy object when the request asked for it
    prefill_len: int = 0  # tokens its prefill computes (the prompt; after a preemption, also the output so far)
    slot: int = -1  # SFI state slot (`sfi_runtime.SFIRuntime`), assigned by the backend
    sfi_waiting: bool = False  # asked for SFI when every slot was busy: it decodes densely until one frees
    state: Any = None  # the backend's per-request state
    evict_state: Any = None  # the eviction runtime's per-request state


@dataclass
class BatchRows:
    rows: dict[int, RowRequest] = field(default_factory=dict)
    released: list[RowRequest] = field(default_factory=list)  # removed; the backend frees their slots

    def add(self, index: int, req: RowRequest) -> None:
        old = self.rows.get(index)
        if old is not None:
            self.released.append(old)
        self.rows[index] = req

    def remove(self, index: int) -> None:
        old = self.rows.pop(index, None)
        if old is not None:
            self.released.append(old)

    def move(self, src: int, dst: int, swap: bool) -> None:
        a, b = self.rows.pop(src, None), self.rows.pop(dst, None)
        if a is not None:
            self.rows[dst] = a
        if swap and b is not None:
            self.rows[src] = b
        elif b is not None:
            self.released.append(b)

    def take_released(self) -> list[RowRequest]:
        out, self.released = self.released, []
        return out


FLAT_POLICY = "cotserve_policy"
FLAT_PREFIX = "cotserve."


def policy_of(extra_args: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """(policy spec, options) from `SamplingParams.extra_args`; dense when absent.

    Two forms: cotserve's own, `{"cotserve": {"policy": "sfi", "options": {"k": 1024}}}` (what
    `cotserve serve --engine vllm` sends), and a flat one for a plain `vllm serve`, whose
    `vllm_xargs` take only strings, numbers and lists: `{"cotserve_policy": "skipkv+sfi",
    "cotserve.sfi.k": 1024, "cotserve.budget": 2048}` (an option key after `cotserve.`, with a
    policy prefix where a stack has the same option twice)."""
    args = extra_args or {}
    flat = {k: v for k, v in args.items() if isinstance(k, str) and k.startswith(FLAT_PREFIX)}
    if FLAT_POLICY in args or flat:
        if "cotserve" in args:
            raise PolicyError("extra_args has both 'cotserve' and the flat cotserve_policy / cotserve.* keys; "
                              "use one form")
        policy = args.get(FLAT_POLICY) or "dense"
        if not isinstance(policy, str):
            raise PolicyError("cotserve_policy must be a string such as 'sfi' or 'skipkv+sfi'")
        return policy.strip(), {k[len(FLAT_PREFIX):]: v for k, v in flat.items()}
    spec = args.get("cotserve") or {}
    if not isinstance(spec, dict):
        raise PolicyError("extra_args['cotserve'] must be an object {policy, options}")
    policy = spec.get("policy") or "dense"
    options = spec.get("options") or {}
    if not isinstance(policy, str) or not isinstance(options, dict):
        raise PolicyError("extra_args['cotserve'] needs a string 'policy' and an object 'options'")
    return policy.strip(), dict(options)


@dataclass
class RequestPolicy:
    """What the vLLM engine runs for one request: SFI's config and/or an eviction policy."""

    sfi: Any = None
    evict: Any = None
    steer: Any = None


def vllm_platform() -> str:
    """The platform vLLM runs on here: "cuda", "cpu" (also when vLLM is not installed), or another name."""
    from cotserve.vllm.compat import platform_name

    return platform_name()


def request_policy_of(extra_args: dict[str, Any] | None, platform: str | None = None) -> RequestPolicy:
    """The request's policy parts; PolicyError for anything the vLLM engine does not run.
    `platform` ("cpu", "cuda"): where it would run (None: on either backend); the policies a
    platform runs are those that declare it (`Policy.runtimes`), an eviction policy combined with
    SFI included."""
    from cotserve.policies.interface import Axis, Runtime
    from cotserve.policies.registry import build_policy, runs_on

    policy, options = policy_of(extra_args)
    names = [n.strip() for n in policy.split("+") if n.strip()]
    # the policies that declare this platform (`Policy.runtimes`); an eviction one evicts physically
    # into vLLM's block pool (`evict_runtime`)
    runs = runs_on(*([f"vllm-{platform}"] if platform else Runtime.VLLM))
    unknown = [n for n in names if n not in runs]
    if unknown:
        raise PolicyError(f"policy {'+'.join(unknown)!r} is not available on the vllm engine "
                          f"(it runs: {', '.join(runs)}); use --engine native for it")
    if "h2o" in names and "sfi" in names:
        raise PolicyError("h2o+sfi is not available on the vllm engine: h2o scores the attention SFI replaces "
                          "(the native engine refuses the stack too)")
    stack = build_policy(policy, options)
    out = RequestPolicy()
    for part in stack.parts:
        if part.name == "sfi":
            if part.config.dense_heads > 0:
                raise PolicyError("sfi option dense_heads (the unstable-head fallback) is not available on the "
                                  "vllm engine; use dense_heads=0 or --engine native")
            out.sfi = part.config
        elif part.axis == Axis.EVICT:
            window = getattr(part.config, "window", 0) if part.name != "streamingllm" else 0
            if window > MAX_EVICT_WINDOW:
                raise PolicyError(f"{part.name} option window={window} exceeds {MAX_EVICT_WINDOW} on the vllm engine")
            out.evict = part
        elif part.name == "steering":
            if part.config.vector or part.config.layer >= 0:
                raise PolicyError("steering options vector and layer are the engine's on the vllm engine (the vector "
                                  "shipped for the model, or $COTSERVE_VLLM_STEERING_VECTOR); a request sets alpha0, "
                                  "gamma, enabled and thought_rules")
            out.steer = part
    if out.evict is not None and out.evict.name == "h2o":
        _check_h2o(out.evict)
    return out
