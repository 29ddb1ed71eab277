"""Weight-only narrowing: linear layers whose weights are stored narrower than the activations."""

from __future__ import annotations

import torch

from cotserve.models.devices import pick_weight_dtype


class WeightOnlyLinear(torch.nn.Module):
    """A linear layer whose weight is stored in a narrower dtype than the activations (bf16 under
    float32): the input is cast to the weight's dtype for the matmul (bf16 products, float32
    accumulation in oneDNN's GEMM) and the output back. The GEMM's output is bf16 (torch 2.13 has
    no bf16 x bf16 -> float32 matmul on CPU), so every linear output is rounded to bf16 before the
    cast: q/k/v, the updates added to the residual stream and the logits (whose step is 1/8 for
    magnitudes 16-32); the rest (norms, residual sums, RoPE, attention, the KV cache) is float32.
    A decode step is dominated by streaming the weights; this halves those bytes."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def narrow_weights(model: torch.nn.Module, dtype: str, device: torch.device, compute: torch.dtype
                   ) -> torch.dtype | None:
    """Apply `pick_weight_dtype` to a loaded model; returns the weights' dtype, or None when they
    stay in the compute dtype."""
    wdt = pick_weight_dtype(dtype, device)
    if wdt is None or wdt == compute:
        return None
    store_linear_weights(model, wdt)
    return wdt


def store_linear_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` of `model` by a `WeightOnlyLinear` in `dtype` (a tied LM head gets
    its own copy; the embedding stays). Returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, torch.nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, WeightOnlyLinear(child, dtype))
    return len(targets)
