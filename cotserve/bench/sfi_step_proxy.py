"""Decode-step proxy for SFI vs dense that skips prefill (for machines too loaded to prefill
4 x 7936 tokens): every slot's cache holds 7936 entries of random K/V; the real model does
everything else.

    python -m cotserve.bench.sfi_step_proxy [threads=1] [steps=6] [slow_ratio=0.0625]

Prints dense s/step, SFI fast s/step (k=1024, with the default fraction of dense-fallback
heads marked by hand), the cost of a step in which one slot takes a slow
step, and the SFI/dense ratio estimated for the given per-slot slow-step ratio. Only a proxy for
`cotserve bench decode` (random keys, no real prompt)."""

from __future__ import annotations

import json
import sys
import time

import torch

from cotserve.bench.prompts import long_prompts
from cotserve.engine.batch import BatchState
from cotserve.engine.cache import CacheShape, KVCache
from cotserve.engine.native import NativeEngine
from cotserve.models import load_model
from cotserve.policies.registry import build_policy

CTX, B = 7936, 4


def main(argv: list[str]) -> None:
    torch.set_num_threads(int(argv[0]) if argv else 1)
    nstep = int(argv[1]) if len(argv) > 1 else 6
    slow_ratio = float(argv[2]) if len(argv) > 2 else 1 / 16
    eng = NativeEngine(load_model("smollm2-135m-instruct", device="cpu", dtype="float32"), max_batch=B)
    info = eng.info
    prompts = long_prompts(eng.tokenizer, CTX, B, None)

    def make(policy: str, opts: dict):
        stack = build_policy(policy, opts)
        cache = KVCache(CacheShape(info.num_layers, B, info.num_kv_heads, CTX + 80, info.head_dim), eng.dtype,
                        eng.device)
        batch = BatchState(info=info, cache=cache, policy=stack, scaling=eng.scaling,
                           prompt_lens=torch.full((B,), CTX), tokens=[list(p) for p in prompts],
                           active=torch.ones(B, dtype=torch.bool))
        g = torch.Generator().manual_seed(0)
        cache.k[:, :, :, :CTX] = torch.randn(cache.k[:, :, :, :CTX].shape, generator=g) * 1.5
        cache.v[:, :, :, :CTX] = torch.randn(cache.v[:, :, :, :CTX].shape, generator=g)
        cache.pos[:, :, :, :CTX] = torch.arange(CTX)
        cache.lens[:] = CTX
        stack.begin(batch)
        batch.mode = "decode"
        return stack, batch

    @torch.inference_mode()
    def step(stack, batch, t: int) -> float:
        t0 = time.perf_counter()
        batch.positions = torch.full((B,), CTX + t)
        batch.step = t
        ids = torch.tensor([p[-1] for p in batch.tokens]).view(-1, 1)
        eng.forward(ids, batch.positions.view(-1, 1), batch)
        stack.after_forward(batch)
        for p in batch.tokens:
            p.append(13)
        return time.perf_counter() - t0

    def set_mode(trigs, mode: str) -> None:
        for tr in trigs:
            tr.mode, tr.period = mode, 1

    res: dict = {}
    stack, batch = make("dense", {})
    step(stack, batch, 0)
    res["dense_step_s"] = sum(step(stack, batch, t) for t in range(1, nstep + 1)) / nstep
    # dense_min=0: random keys have no retrieval heads, so let the fallback take its full share
    stack, batch = make("sfi", {"k": 1024, "trigger": "disabled", "dense_min": 0.0})
    sfi = stack.parts[0]
    trigs = sfi.triggers
    set_mode(trigs, "fixed_periodic")
    res["sfi_all_slow_first_step_s"] = step(stack, batch, 0)  # selection over the full cache
    set_mode(trigs, "disabled")
    # that first selection had one query row, too few to rank heads: mark as many dense-fallback
    # heads per slot as the default `dense_heads` fraction gives, at random over the layers
    dense = torch.zeros(B, sfi.dense.shape[0] * sfi.dense.shape[2], dtype=torch.bool)
    for b in range(B):
        dense[b, torch.randperm(dense.shape[1], generator=torch.Generator().manual_seed(b))[: sfi.n_dense]] = True
    sfi.set_dense_heads(dense.view(B, sfi.dense.shape[0], sfi.dense.shape[2]).permute(1, 0, 2).contiguous())
    for b in range(B):  # their page bounds, as a refresh takes them
        sfi._take_page_bounds(b, batch)
    res["dense_heads_per_slot"] = sfi.n_dense
    res["sfi_fast_step_s"] = sum(step(stack, batch, t) for t in range(1, nstep + 1)) / nstep
    set_mode(trigs[:1], "fixed_periodic")
    res["sfi_one_slot_slow_step_s"] = step(stack, batch, nstep + 1)
    extra = res["sfi_one_slot_slow_step_s"] - res["sfi_fast_step_s"]
    res["assumed_slow_ratio"] = slow_ratio
    res["sfi_est_step_s"] = res["sfi_fast_step_s"] + B * slow_ratio * extra
    res["est_ratio_to_dense"] = res["dense_step_s"] / res["sfi_est_step_s"]
    res["fast_ratio_to_dense"] = res["dense_step_s"] / res["sfi_fast_step_s"]
    print(json.dumps({k: round(v, 4) for k, v in res.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
