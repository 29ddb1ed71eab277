"""Functional check of physical eviction on vLLM with CUDA (Qwen3-4B shapes, dummy weights): the same
requests with CUDA graphs and eagerly (greedy tokens must agree), two dense requests alone and
beside the evicting ones (their tokens must not change), and eviction combined with SFI: `skipkv+sfi`
reading sparsely (k below the kept entries) and `skipkv+sfi` with k above them beside `skipkv` alone
on the same prompt (SFI then reads every kept entry: the tokens should follow skipkv's, except
where a compaction leaves the selection's copies of evicted entries to be read until the next
refresh, as in the native engine). Prints one JSON line per mode and one with the agreements.

    python tools/vllm_evict_check.py [MODEL_DIR]

Dummy weights (the default) decode the same few tokens over and over, so token agreement says
little there; MODEL_DIR (a checkpoint folder, e.g. a randomly initialised Qwen3 saved by
transformers) gives varied tokens.
"""
import json
import os
import time

os.environ.setdefault("COTSERVE_VLLM_TELEMETRY", "/tmp/evict_tele.jsonl")

SKIPKV = {"budget": 256, "interval": 64}
SPARSE = {"skipkv.budget": 256, "skipkv.interval": 64, "sfi.k": 64, "sfi.recent": 64}
WIDE = {"skipkv.budget": 256, "skipkv.interval": 64, "sfi.k": 512, "sfi.recent": 64, "sfi.max_interval": 8}
# (policy, options, prompt index) of the mixed batch's rows
ROWS = [("dense", {}, 0), ("dense", {}, 1), ("skipkv", SKIPKV, 2), ("skipkv", SKIPKV, 3),
        ("skipkv+sfi", SPARSE, 3), ("skipkv+sfi", WIDE, 2)]


def run(eager: bool, prompts, n_new, model_dir=None):
    from vllm import LLM
    from vllm import SamplingParams as SP

    from cotserve.bench.vllm_decode import _model_folder
    folder = model_dir or _model_folder("random:qwen3-4b")[0]
    llm = LLM(model=folder, dtype="bfloat16", load_format="auto" if model_dir else "dummy", skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=4096, max_num_seqs=8, kv_cache_memory_bytes=2 << 30,
              attention_backend="CUSTOM", scheduler_cls="cotserve.vllm.scheduler.EvictingScheduler",
              async_scheduling=False, seed=0, enforce_eager=eager, max_num_batched_tokens=8192)

    def params(policy, options):
        extra = {"extra_args": {"cotserve": {"policy": policy, "options": options}}} if policy != "dense" else {}
        return SP(max_tokens=n_new, temperature=0.0, ignore_eos=True, detokenize=False, **extra)

    t = time.time()
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], [params("dense", {})] * 2, use_tqdm=False)
    mixed = llm.generate([{"prompt_token_ids": prompts[i]} for _, _, i in ROWS], [params(p, o) for p, o, _ in ROWS],
                         use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], [SP(max_tokens=2, detokenize=False)], use_tqdm=False)
    out = {"alone": [list(o.outputs[0].token_ids) for o in alone],
           "mixed": [list(o.outputs[0].token_ids) for o in mixed],
           "tele": [o.kv_transfer_params for o in mixed], "s": round(time.time() - t, 1)}
    del llm
    return out


def agree(a, b):
    return round(sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), 1), 4)


def main():
    import sys

    import torch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (1024,), generator=g).tolist() for _ in range(4)]
    res = {}
    for eager in (False, True):
        r = run(eager, prompts, 400, sys.argv[1] if len(sys.argv) > 1 else None)
        res["eager" if eager else "graphs"] = r
        m = r["mixed"]
        print(json.dumps({"mode": "eager" if eager else "graphs", "s": r["s"],
                          "dense_alone_vs_mixed": [agree(r["alone"][i], m[i]) for i in (0, 1)],
                          "distinct_tokens": [len(set(m[i])) for i in range(2, len(ROWS))],
                          "skipkv_sfi_wide_vs_skipkv": agree(m[5], m[2]),
                          "skipkv_sfi_sparse_vs_skipkv": agree(m[4], m[3]),
                          "tele": r["tele"][2:]}), flush=True)
    g_, e_ = res["graphs"], res["eager"]
    print(json.dumps({"graphs_vs_eager": [agree(g_["mixed"][i], e_["mixed"][i]) for i in range(len(ROWS))]}),
          flush=True)
    if os.path.exists(os.environ["COTSERVE_VLLM_TELEMETRY"]):
        with open(os.environ["COTSERVE_VLLM_TELEMETRY"]) as f:
            sfi = [json.loads(line) for line in f if "sfi_steps" in line]
        print(json.dumps({"sfi_telemetry": sfi}), flush=True)


if __name__ == "__main__":
    main()
