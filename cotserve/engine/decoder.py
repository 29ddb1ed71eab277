"""A lean decoder stack for Llama-family models (Llama, Mistral, Qwen2, Qwen3): the same
computation as transformers' modules, written as a short loop of tensor ops (gpt-fast /
nano-vllm style) over the same weights.

Why: at decode a step's tensors are tiny ([batch, 1, hidden]), so on a CPU the per-op and per-
module overhead of the transformers forward (hooks, kwargs plumbing, the attention interface,
separate q/k/v and gate/up projections) is a large share of a step. Here q/k/v are one
projection and gate/up another (their weights concatenated once; the original modules' weights
become views of the fused ones, so the fusion itself copies nothing and the transformers path
keeps working), RMSNorm is one `rms_norm` op, and attention goes straight to cotserve's cache and
policy stack (`route_attention`). On a CPU with oneDNN each projection also gets a pre-packed copy
in oneDNN's layout: that copy doubles the memory of the linear weights (the plain ones stay for
the reference path), and it is taken once, so the weights are frozen for the engine's lifetime
(an in-place update or a swapped module needs a new `NativeEngine`). `NativeEngine` uses the lean
stack whenever `LeanDecoder.supports(model)` and no forward hook is registered; the transformers
forward (`NativeEngine.forward_reference`) stays as the reference the tests compare it with.
Norms are computed by `rms_norm` in the input dtype with one rounding, so for float32 and bf16w
models (the ones tested) the results match transformers' to float rounding; a bf16 model's norms
may differ from transformers' two-rounding form in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def route_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchState) -> torch.Tensor:
    """Write this forward's K/V into the cache and ask the policy stack for the attention output.
    q [B, Hq, T, D], k/v [B, Hkv, T, D] (RoPE applied). Returns [B, Hq, T, D]. A batch with a
    `route` method (the continuous engine's rows, each with its own cache and policy stack)
    takes the whole call itself."""
    route = getattr(batch, "route", None)
    if route is not None:
        return route(layer, q, k, v)
    if batch.mode == "prefill":
        batch.cache.write_prefill(layer, k, v, batch.prompt_lens)
        return batch.policy.prefill_attention(layer, q, k, v, batch)
    batch.cache.write_decode(layer, k, v, batch.positions)
    return batch.policy.decode_attention(layer, q, batch)


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor the row blocks `parts` already are, back to back in one storage (the case
    after an earlier fusion of the same modules), or None where they are not."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _fuse(modules: list[torch.nn.Module]) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """Concatenate the weights (and biases) of linear-like modules along the output dim; the
    modules' own weights become views of the fused tensor. Weights fused before (a second engine
    on the same loaded model) are taken as they are: no copy, and every engine on the model reads
    the memory its modules read."""
    weights = [m.weight.detach() for m in modules]
    base = _adjacent(weights)
    weight = torch.nn.Parameter(base if base is not None else torch.cat(weights), requires_grad=False)
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None
    if any(b is not None for b in biases):
        parts = [b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype,
                 device=weight.device) for m, b in zip(modules, biases, strict=True)]
        base = _adjacent(parts) if all(b is not None for b in biases) else None
        bias = torch.nn.Parameter(base if base is not None else torch.cat(parts), requires_grad=False)
    row = 0
    for m, b in zip(modules, biases, strict=True):
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight.detach()[row : row + n], requires_grad=False)
        if bias is not None and b is not None:
            m.bias = torch.nn.Parameter(bias.detach()[row : row + n], requires_grad=False)
        row += n
    return weight, bias


@dataclass
class _Weight:
    """One projection's weight: the plain tensor, and on a CPU with oneDNN a copy pre-packed in
    oneDNN's blocked layout (`packed`; the plain matmul re-lays the weight out on every call,
    which at decode's few rows costs about as much as the product itself)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None


def _prepack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """oneDNN's pre-packed layout of a CPU weight (for about `rows` input rows), or None where
    oneDNN is not available or does not take the weight."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        # oneDNN may take the reorder yet not run the product for this dtype on this CPU: try one
        x = torch.randn(2, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if not torch.allclose(got.float(), torch.nn.functional.linear(x, weight).float(), rtol=1e-2, atol=1e-2):
            return None
        return packed
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _linear(x: torch.Tensor, w: _Weight) -> torch.Tensor:
    """x @ W^T (+ b), with the weight-only cast of `models.WeightOnlyLinear` when W is narrower
    than x (the product, rounded to W's dtype, is cast back; the bias is added after)."""
    xin = x.to(w.weight.dtype)
    if w.packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(xin, w.packed, None, "none", [], "")
    else:
        y = torch.nn.functional.linear(xin, w.weight)
    y = y.to(x.dtype)
    return y if w.bias is None else y + w.bias


def _plain_linear(module: torch.nn.Module | None) -> bool:
    """A projection the lean stack can fuse: `nn.Linear` or cotserve's `WeightOnlyLinear` (not a
    quantized or adapter-wrapped layer, whose forward is more than x @ W^T + b)."""
    from cotserve.models import WeightOnlyLinear

    return isinstance(module, (torch.nn.Linear, WeightOnlyLinear))


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    qkv: _Weight
    o: _Weight
    gate_up: _Weight
    down: _Weight
    q_norm: torch.nn.Module | None  # Qwen3's per-head RMSNorm of q and k, before RoPE
    k_norm: torch.nn.Module | None


class LeanDecoder:
    """The decoder stack of a supported model as plain tensor ops (see the module docstring)."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Llama-family layout: RMSNorms, q/k/v/o projections, a SiLU-gated MLP, RoPE from the
        model's own rotary module."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
            return False
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "rotary_emb"):
            return False
        need = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
        return all(_plain_linear(getattr(getattr(layer, part, None), name, None)) for layer in layers
                   for part, names in need.items() for name in names)

    def __init__(self, model: torch.nn.Module, prepack: bool = True, rows: int = 8):
        cfg = model.config
        self.inner = model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.layers: list[_Layer] = []

        def weight(w: torch.Tensor, b: torch.Tensor | None) -> _Weight:
            return _Weight(w, b, _prepack(w, rows) if prepack else None)

        for layer in self.inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            qkv = weight(*_fuse([att.q_proj, att.k_proj, att.v_proj]))
            gate_up = weight(*_fuse([mlp.gate_proj, mlp.up_proj]))
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                eps1=_eps(layer.input_layernorm), eps2=_eps(layer.post_attention_layernorm),
                qkv=qkv, o=weight(att.o_proj.weight, getattr(att.o_proj, "bias", None)),
                gate_up=gate_up, down=weight(mlp.down_proj.weight, getattr(mlp.down_proj, "bias", None)),
                q_norm=getattr(att, "q_norm", None), k_norm=getattr(att, "k_norm", None)))
        self.final_norm = self.inner.norm
        head = getattr(model, "lm_head", None)
        self.head = weight(head.weight, getattr(head, "bias", None)) if _plain_linear(head) else None
        self.split = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim)
        self.inter = self.layers[0].gate_up.weight.shape[0] // 2 if self.layers else 0

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: BatchState) -> torch.Tensor:
        """The decoder stack: [B, T] ids -> final-norm hidden states [B, T, hidden]."""
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]: broadcast over heads
        b, t, width = hidden.shape
        d = self.head_dim
        rms_norm = torch.nn.functional.rms_norm
        for i, w in enumerate(self.layers):
            hidden = batch.policy.steer(i, hidden, batch)
            x = rms_norm(hidden, (width,), w.ln1, w.eps1)
            q, k, v = _linear(x, w.qkv).split(self.split, dim=-1)
            q = q.view(b, t, -1, d)
            k = k.view(b, t, -1, d)
            if w.q_norm is not None:
                q, k = w.q_norm(q), w.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(b, t, -1, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            att = route_attention(i, q, k, v, batch)  # [B, Hq, T, D]
            hidden = hidden + _linear(att.transpose(1, 2).reshape(b, t, -1), w.o)
            x = rms_norm(hidden, (width,), w.ln2, w.eps2)
            if b * t <= MLP_CHUNK:
                gate, up = _linear(x, w.gate_up).split(self.inter, dim=-1)
                hidden = hidden + _linear(torch.nn.functional.silu(gate) * up, w.down)
            else:  # a prefill of many long prompts: the MLP (per token) in slices, its intermediates bounded
                flat, mlp = x.view(b * t, width), torch.empty_like(x).view(b * t, width)
                for s in range(0, b * t, MLP_CHUNK):
                    gate, up = _linear(flat[s : s + MLP_CHUNK], w.gate_up).split(self.inter, dim=-1)
                    mlp[s : s + MLP_CHUNK] = _linear(torch.nn.functional.silu(gate) * up, w.down)
                hidden = hidden + mlp.view(b, t, width)
        return self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """LM-head logits (float32) of hidden states [..., hidden], or None when the model's head
        is not a plain linear layer (the caller then uses the module)."""
        return None if self.head is None else _linear(hidden, self.head).float()


MLP_CHUNK = 65536  # tokens per MLP slice in a forward over more tokens than this (long batched prefills)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
