"""Where a refresh's host time goes on CUDA: host vs GPU time, whether it waits for queued GPU work,
and which CUDA runtime calls it makes (torch.profiler)."""
import json, os, time
from types import SimpleNamespace
import torch
from cotserve.vllm.graph_sfi import GraphSFI
from cotserve.policies.sfi.paged import SlotState
from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger
from cotserve.vllm.requests import BatchRows

dev = torch.device("cuda")
L, HQ, HKV, D, BS = 36, 32, 8, 128, 16
NB = 2 * 32768 // BS + 64
layers = [SimpleNamespace(kv_cache=torch.randn(NB, HKV, BS, 2 * D, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
g = GraphSFI(layers, HQ, HKV, D, D ** -0.5, torch.bfloat16, dev, slots=16, max_rows=64, rows=BatchRows())
cfg = SFIConfig()
g._warm(cfg)
res = {}
clock = torch.cuda.get_device_properties(dev).clock_rate if hasattr(torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e6

def one(n, rows, sleep_ms=0.0):
    blocks = torch.randperm(NB, device=dev)[: -(-n // BS)].view(1, -1).to(torch.int32)
    w = max(cfg.obs_window, cfg.prefill_window)
    ring_pos = [-1] * w
    for p in range(n - rows, n):
        ring_pos[p % w] = p
    st = SlotState(cfg, RefreshTrigger(), n, 0, ring_pos=ring_pos, refresh_n=n, refresh_lo=n - rows, refresh_hi=n)
    torch.cuda.synchronize()
    if sleep_ms:
        torch.cuda._sleep(int(sleep_ms * 1e-3 * 1.98e9))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    g.refresh_all([(st, blocks[0])], BS)
    host = time.perf_counter() - t0
    e1.record()
    torch.cuda.synchronize()
    return host * 1e3, e0.elapsed_time(e1)

for n in (16000, 32000):
    for rows in (1, 16):
        for _ in range(3):
            one(n, rows)
        idle = [one(n, rows) for _ in range(10)]
        busy = [one(n, rows, 50.0) for _ in range(5)]
        key = f"n{n}_rows{rows}"
        res[key] = {"host_ms_idle": sorted(h for h, _ in idle)[5], "gpu_ms_idle": sorted(x for _, x in idle)[5],
                    "host_ms_behind_50ms_sleep": sorted(h for h, _ in busy)[2],
                    "gpu_span_ms_behind_sleep": sorted(x for _, x in busy)[2]}
        print(key, res[key], flush=True)

from torch.profiler import profile, ProfilerActivity
for n in (16000,):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            one(n, 1, 20.0)
    ka = prof.key_averages()
    rows = sorted(((e.key, e.count, round(e.cpu_time_total / 1e3 / 5, 3)) for e in ka), key=lambda x: -x[2])
    res["profile_n16000_per_refresh"] = rows[:45]
    for r in rows[:45]:
        print(r)
print("alloc", {k: v for k, v in torch.cuda.memory_stats(dev).items() if k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")})
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/refresh_prof.json", "w"), indent=1)
