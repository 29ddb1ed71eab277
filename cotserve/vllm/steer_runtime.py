"""Adaptive steering (SkipKV Sec. 4.2, SEAL's vector) per request inside vLLM's model.

The engine holds one steering vector (a `cotserve build-steering` file: `$COTSERVE_VLLM_STEERING_VECTOR`,
which `cotserve serve --engine vllm` sets to the vector shipped for the served model when there is
one) at its layer L. `install(model, vllm_config)` (called by cotserve's model classes, `models.py`)
puts a forward pre-hook on decoder layer L that subtracts `coef[j] * v` from the hidden state of
token `idx[j]` entering the layer; `idx` and `coef` are persistent tensors of `max_num_seqs`
entries (unused ones add zero to token 0), so the hook is the same launch at every step and is
captured in CUDA graphs like the rest of the forward.

Per step, before the forward (`SteerRuntime.plan`, from the attention metadata builder), each
decode row of a request with the `steering` policy feeds its tokens to the native policy's thought
follower (`policies.steering.SlotThoughts`: blank-line boundaries, `<think>` region, thought rules);
at a boundary the row's token gets alpha_t = alpha0 + gamma * N_o, N_o its non-execution thoughts
so far, exactly as the native `SteeringPolicy.steer` does. The prompt is never steered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.settings import settings, variable
from cotserve.vllm.telemetry import write_telemetry

log = logging.getLogger(__name__)

VECTOR_ENV = variable("steering_vector")
LAYER_ENV = variable("steering_layer")


@dataclass
class SteerBuffers:
    """The hook's persistent inputs (on the model's device)."""

    layer: int
    vector: torch.Tensor  # [H], model dtype
    idx: torch.Tensor  # [S] long: token index in the step's flat batch
    coef: torch.Tensor  # [S] model dtype: alpha_t, 0 for unused entries


def engine_vector():
    """The engine's steering vector (`policies.steering.SteeringVector`) and layer, or None."""
    given = settings()
    path = given.steering_vector
    if not path:
        return None
    from cotserve.policies.steering import load_vector

    sv = load_vector(path)
    layer = given.steering_layer if given.steering_layer is not None else sv.layer
    if layer < 0:
        raise ValueError(f"steering vector {path} does not record its layer; set {LAYER_ENV}")
    return sv, layer


def _decoder_layers(model) -> list:
    from cotserve.vllm.compat import decoder_layers

    return decoder_layers(model)


def install(model, vllm_config) -> SteerBuffers | None:
    """Put the steering hook on the model's layer L when the engine has a vector (else nothing);
    returns the hook's inputs (the process keeps them: `process.runtimes().steer_buffers`)."""
    got = engine_vector()
    if got is None:
        return None
    sv, layer = got
    layers = _decoder_layers(model)
    hidden = vllm_config.model_config.get_hidden_size()
    if sv.vector.numel() != hidden or not 0 <= layer < len(layers):
        raise ValueError(f"steering vector {sv.path} (size {sv.vector.numel()}, layer {layer}) does not fit this "
                         f"model (hidden size {hidden}, {len(layers)} layers)")
    s = vllm_config.scheduler_config.max_num_seqs
    dtype = vllm_config.model_config.dtype
    dev = next(model.parameters()).device
    target = layers[layer]
    target.register_buffer("cotserve_steer_vector", sv.vector.to(device=dev, dtype=dtype), persistent=False)
    target.register_buffer("cotserve_steer_idx", torch.zeros(s, dtype=torch.long, device=dev), persistent=False)
    target.register_buffer("cotserve_steer_coef", torch.zeros(s, dtype=dtype, device=dev), persistent=False)

    def pre_hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            h = kwargs["hidden_states"]
        else:
            h = args[1]
        delta = module.cotserve_steer_coef.unsqueeze(1) * module.cotserve_steer_vector.unsqueeze(0)
        h = h.index_add(0, module.cotserve_steer_idx.clamp(max=h.shape[0] - 1), -delta.to(h.dtype))
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": h}
        else:
            args = (args[0], h, *args[2:])
        return args, kwargs

    target.register_forward_pre_hook(pre_hook, with_kwargs=True)
    log.info("steering: vector %s at layer %d", sv.path, layer)
    return SteerBuffers(layer, target.cotserve_steer_vector, target.cotserve_steer_idx, target.cotserve_steer_coef)


@dataclass
class SteerState:
    thoughts: Any  # policies.steering.SlotThoughts
    knobs: Any  # policies.steering._Knobs
    fed: int = 0  # tokens of prompt + output fed so far
    applications: int = 0
    alpha_sum: float = 0.0


class SteerRuntime:
    def __init__(self, tokenizer):
        from cotserve.policies.boundaries import thought_delimiter_ids
        from cotserve.policies.steering import think_ids

        self.tok = tokenizer
        self.delims = thought_delimiter_ids(tokenizer) if tokenizer is not None else frozenset()
        self.think = think_ids(tokenizer) if tokenizer is not None else (None, None)
        self.states: dict[int, tuple[list, SteerState]] = {}  # id(output list) -> (the list, state)
        self.active = False

    def plan(self, rows: BatchRows, cm, buf: SteerBuffers | None) -> None:
        """Fill the hook's entries `buf` for this step (see the module docstring)."""
        reqs = [(i, r) for i, r in rows.rows.items() if r.steer is not None and i < cm.num_reqs]
        self._release(buf)
        if buf is None or (not reqs and not self.active):
            return
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        s = buf.idx.shape[0]
        idx = torch.zeros(s, dtype=torch.long)
        coef = torch.zeros(s, dtype=torch.float32)
        n = 0
        for i, req in reqs:
            st = self._state(req)
            tok, ntok = qsl[i], qsl[i + 1] - qsl[i]
            total = len(req.prompt_ids) + len(req.output_ids)
            if ntok != 1 or total <= len(req.prompt_ids):  # prefill: the prompt is not steered
                continue
            new = req.output_ids[st.fed - len(req.prompt_ids):] if st.fed >= len(req.prompt_ids) else \
                (req.prompt_ids + list(req.output_ids))[st.fed:]
            at = False
            for t in new:
                st.thoughts._think(t)
                st.thoughts.tracker.push(t)
                at = st.thoughts.tracker.at_boundary and st.thoughts.region != "after"
            st.fed = total
            st.thoughts.consumed = total
            if at and st.knobs.enabled and n < s:
                a = st.knobs.alpha0 + st.knobs.gamma * st.thoughts.tracker.non_execution
                idx[n], coef[n] = tok, a
                st.applications += 1
                st.alpha_sum += a
                n += 1
                self._report(req, st)
        self.active = bool(reqs)
        buf.idx.copy_(idx, non_blocking=True)
        buf.coef.copy_(coef.to(buf.coef.dtype), non_blocking=True)

    def _state(self, req: RowRequest) -> SteerState:
        # keyed by the request's output list: vLLM keeps it when a request leaves the batch for a
        # step and comes back, so the thought state survives that
        key = id(req.output_ids)
        got = self.states.get(key)
        if got is not None and got[0] is req.output_ids:
            self.states[key] = self.states.pop(key)  # most recently used last (`_release` drops the first)
            return got[1]
        from cotserve.policies.steering import SlotThoughts, request_knobs
        from cotserve.policies.thoughts import load_rules

        cfg = req.steer.config
        prompt = req.prompt_ids
        th = SlotThoughts(self.tok, self.delims, prompt, self.think, load_rules(cfg.thought_rules))
        st = SteerState(th, request_knobs(cfg, None), fed=len(prompt))
        self.states[key] = (req.output_ids, st)
        return st

    def _release(self, buf: SteerBuffers | None) -> None:
        """Keep the states of requests that left (they may come back), the most recent 4 x max_num_seqs."""
        limit = 4 * (buf.idx.shape[0] if buf is not None else 64)
        while len(self.states) > limit:
            self.states.pop(next(iter(self.states)))

    @staticmethod
    def _report(req: RowRequest, st: SteerState) -> None:
        """The request's counts so far, one JSON line per steered token (the last line of a request
        is its total): a request may leave the batch without another step to report it."""
        n = st.applications
        write_telemetry({"steering": {"request": id(req), "steering_applications": n,
                                      "steering_alpha_mean": round(st.alpha_sum / n, 6),
                                      "steering_non_execution": st.thoughts.tracker.non_execution}})
