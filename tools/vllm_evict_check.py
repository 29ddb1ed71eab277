"""Functional check of physical eviction on vLLM with CUDA (Qwen3-4B shapes, dummy weights): the same
requests with CUDA graphs and eagerly (greedy tokens must agree), and two dense requests alone and
beside two skipkv requests (their tokens must not change). Prints one JSON line per mode and one
with the graphs-vs-eager agreement.

    python tools/vllm_evict_check.py
"""
import json
import os
import time

os.environ.setdefault("COTSERVE_VLLM_TELEMETRY", "/tmp/evict_tele.jsonl")


def run(eager: bool, prompts, n_new):
    from vllm import LLM
    from vllm import SamplingParams as SP

    from cotserve.bench.vllm_decode import _model_folder
    folder, _ = _model_folder("random:qwen3-4b")
    llm = LLM(model=folder, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=4096, max_num_seqs=8, kv_cache_memory_bytes=2 << 30,
              attention_backend="CUSTOM", scheduler_cls="cotserve.vllm.scheduler.EvictingScheduler",
              async_scheduling=False, seed=0, enforce_eager=eager, max_num_batched_tokens=8192)
    dense = SP(max_tokens=n_new, temperature=0.0, ignore_eos=True, detokenize=False)
    sk = SP(max_tokens=n_new, temperature=0.0, ignore_eos=True, detokenize=False,
            extra_args={"cotserve": {"policy": "skipkv", "options": {"budget": 256, "interval": 64}}})
    t = time.time()
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], [dense, dense], use_tqdm=False)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [dense, dense, sk, sk], use_tqdm=False)
    out = {"alone": [list(o.outputs[0].token_ids) for o in alone],
           "mixed": [list(o.outputs[0].token_ids) for o in mixed],
           "tele": [o.kv_transfer_params for o in mixed], "s": round(time.time() - t, 1)}
    del llm
    return out


def agree(a, b):
    return round(sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), 1), 4)


def main():
    import torch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (1024,), generator=g).tolist() for _ in range(4)]
    res = {}
    for eager in (False, True):
        r = run(eager, prompts, 400)
        res["eager" if eager else "graphs"] = r
        print(json.dumps({"mode": "eager" if eager else "graphs", "s": r["s"],
                          "dense_alone_vs_mixed": [agree(r["alone"][i], r["mixed"][i]) for i in (0, 1)],
                          "skipkv_distinct": [len(set(r["mixed"][i])) for i in (2, 3)],
                          "tele": r["tele"][2:]}), flush=True)
    g_, e_ = res["graphs"], res["eager"]
    print(json.dumps({"graphs_vs_eager": [agree(g_["mixed"][i], e_["mixed"][i]) for i in range(4)]}), flush=True)


if __name__ == "__main__":
    main()
