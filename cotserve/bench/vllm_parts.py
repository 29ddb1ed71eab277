"""`python -m cotserve.bench.vllm_parts`: the CUDA SFI path's parts timed alone (JSON lines).

* the paged fast-step kernel (`kernels.sfi_paged`) against FlashAttention-sized reads: rows x
  KV heads x (compact + window) entries, with the bytes it must move and the bandwidth reached;
  with each slot's count of compact entries in use, as served (`auto_count`: the padding past sinks + k
  unread), and also with the step's ring writes in its launch (`auto_with_ring_writes`; against
  `auto_count`, their cost);
* a batched refresh (`GraphSFI.refresh`: evidence, selector, re-pack) of J requests of n entries
  over every layer, on random caches in vLLM's FlashAttention layout: its GPU time (`ms`, CUDA events)
  and the host's time to issue it (`host_ms`; where it exceeds `ms`, the host is what a refresh waits on).
`--refresh J N [J N ...]` times refreshes alone; `--refresh-parts J N` each of a refresh's launches alone
(the logits at several block sizes, the selector, the top-K, the re-pack at two block sizes), each
against the time the device's own copy bandwidth needs for the bytes it must move; `--launches` the
host's time per launch; `--profile [J N]` prints a refresh's operators by device time and by host time.
Needs a CUDA GPU; shapes default to Qwen3-4B's attention (36 layers, 32/8 heads, head dim 128).
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import torch

# the ring-write entries a served step's fast-step launch walks: 4 a row of the 128 rows vLLM's runtime
# keeps at --max-num-seqs 64 (its largest captured batch); one per decode row is a real write
RING_WRITES = 512


def time_kernel(rows: int = 16, hkv: int = 8, g: int = 4, d: int = 128, c: int = 2112, window: int = 256,
                context: int = 8192, bs: int = 16) -> dict:
    from cotserve.kernels.sfi_paged import sfi_paged_fast

    dev = torch.device("cuda")
    nb = rows * (context // bs + 1)
    q = torch.randn(rows, hkv * g, d, device=dev, dtype=torch.bfloat16)
    ck = torch.randn(rows, hkv, c, d, device=dev, dtype=torch.bfloat16)
    cv = torch.randn_like(ck)
    cpos = torch.randint(0, context - window, (rows, hkv, c), device=dev, dtype=torch.int32)
    kv = torch.randn(nb, hkv, bs, 2 * d, device=dev, dtype=torch.bfloat16)
    kc, vc = kv.transpose(1, 2).split(d, dim=-1)
    bt = torch.randperm(nb, device=dev)[: rows * (context // bs)].view(rows, -1).to(torch.int32)
    mode = torch.ones(rows, dtype=torch.int32, device=dev)
    slot = torch.arange(rows, dtype=torch.int32, device=dev)
    lens = torch.full((rows,), context, dtype=torch.int32, device=dev)
    ws = lens - window
    out = torch.empty_like(q)
    res = {}
    for name, splits in (("single", 1), ("auto", None), ("split2", 2), ("split4", 4), ("split8", 8)):
        ms = graph_ms(lambda s=splits: sfi_paged_fast(q, out, ck, cv, cpos, kc, vc, bt, mode, slot, slot, ws, lens,
                                                      0.088, splits=s))
        moved = rows * hkv * (c + window) * d * 2 * 2
        res[name] = {"ms": round(ms, 4), "GB/s": round(moved / ms / 1e6, 1)}
    # as served: each slot's compact entries in use (SFI's 4 sinks + k = 2,048), the padding to C unread
    count = torch.full((rows,), min(c, 4 + 2048), dtype=torch.int32, device=dev)
    ms = graph_ms(lambda: sfi_paged_fast(q, out, ck, cv, cpos, kc, vc, bt, mode, slot, slot, ws, lens, 0.088,
                                         ccount=count))
    res["auto_count"] = {"ms": round(ms, 4), "GB/s": round(rows * hkv * (int(count[0]) + window) * d * 4 / ms / 1e6, 1)}
    ring = torch.zeros(rows + 1, 32, hkv * g, d, device=dev, dtype=torch.bfloat16)
    w_tok = torch.arange(RING_WRITES, device=dev) % rows
    w_slot = torch.where(torch.arange(RING_WRITES, device=dev) < rows, w_tok, rows)
    w_idx = torch.zeros_like(w_tok)
    # as vLLM's backend launches it: the count and the step's ring writes in the same launch (against
    # "auto_count": the writes' cost)
    res["auto_with_ring_writes"] = {"ms": round(graph_ms(lambda: sfi_paged_fast(
        q, out, ck, cv, cpos, kc, vc, bt, mode, slot, slot, ws, lens, 0.088, ring=(ring, w_tok, w_slot, w_idx),
        ccount=count)), 4)}
    return {"part": "fast_kernel", "timing": "cuda graph", "rows": rows, "entries": c + window, **res}


def graph_ms(fn, reps: int = 20) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph (no Python launch overhead, as
    inside vLLM's captured decode step)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def time_refresh(j: int, n: int, layers: int = 36, hq: int = 32, hkv: int = 8, d: int = 128, bs: int = 16) -> dict:
    from cotserve.policies.sfi.config import SFIConfig
    from cotserve.policies.sfi.trigger import RefreshTrigger
    from cotserve.vllm.batch_rows import BatchRows
    from cotserve.vllm.graph_sfi import GraphSFI, SlotState, ring_size

    dev = torch.device("cuda")
    nb = j * (n // bs + 1)
    caches = [SimpleNamespace(kv_cache=torch.randn(nb, hkv, bs, 2 * d, device=dev, dtype=torch.bfloat16))
              for _ in range(layers)]
    rt = GraphSFI(caches, hq, hkv, d, 0.088, torch.bfloat16, dev, slots=j, max_rows=j, rows=BatchRows())
    rt.ring.normal_()
    cfg = SFIConfig()  # SFI's defaults
    blocks = torch.randperm(nb, device=dev)[: j * (n // bs)].view(j, -1).to(torch.int32)
    w = ring_size(cfg)

    def states():  # a slow step's refresh: the ring holds the last w positions, obs_window rows are due
        return [SlotState(cfg, RefreshTrigger(), n, slot=s, ring_pos=[n - w + ((i - n) % w) for i in range(w)],
                          refresh_n=n, refresh_lo=n - cfg.obs_window) for s in range(j)]

    rt.refresh(states(), blocks, bs)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 3
    todo = [states() for _ in range(reps)]
    start.record()
    t0 = time.perf_counter()
    for sts in todo:
        rt.refresh(sts, blocks, bs)
    host = time.perf_counter() - t0  # the host's time to issue them (it does not wait for the GPU)
    end.record()
    torch.cuda.synchronize()
    return {"part": "refresh", "requests": j, "entries": n, "layers": layers,
            "ms": round(start.elapsed_time(end) / reps, 2), "host_ms": round(1e3 * host / reps, 3)}


def copy_gbs(mib: int = 1024) -> float:
    """The device's copy bandwidth (GB/s of bytes read plus written) on one large bf16 copy, in a graph."""
    src = torch.empty(mib << 19, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * 2 / ms / 1e6


def refresh_parts(j: int = 1, n: int = 16384, layers: int = 36, hq: int = 32, hkv: int = 8, d: int = 128,
                  bs: int = 16, device: str = "cuda") -> list[dict]:
    """Each launch of a refresh of J requests over n entries (SFI's defaults, all layers in one chunk as
    `PagedSFI.refresh` makes it when they fit) timed alone from a CUDA graph: `ms`, the bytes it must move
    (`MB`) and the time those take at the device's copy bandwidth (`floor_ms`). The logits at block sizes
    32-256 entries (64 is served), the re-pack at 64 and 128 (64 served)."""
    from cotserve.kernels.sfi_refresh import pack_selection_layers, ring_logits_layers
    from cotserve.kernels.sfi_select import selector_scores, topk_sorted
    from cotserve.policies.sfi.config import SFIConfig
    from cotserve.vllm.batch_rows import BatchRows
    from cotserve.vllm.graph_sfi import GraphSFI

    dev = torch.device(device)
    cfg = SFIConfig()
    nb = j * (n // bs + 1)
    caches = [SimpleNamespace(kv_cache=torch.randn(nb, hkv, bs, 2 * d, device=dev, dtype=torch.bfloat16))
              for _ in range(layers)]
    rt = GraphSFI(caches, hq, hkv, d, 0.088, torch.bfloat16, dev, slots=j, max_rows=j, rows=BatchRows())
    rt.ring.normal_()
    views = rt.paged_layers()
    blocks = torch.randperm(nb, device=dev)[: j * (n // bs)].view(j, -1).to(torch.int32)
    r = cfg.obs_window
    slots = torch.arange(j, dtype=torch.int32, device=dev)
    ridx = torch.arange(r, dtype=torch.int32, device=dev)
    row_pos = torch.full((r,), n - 1, dtype=torch.int32, device=dev)
    g = hq // hkv
    logits = torch.empty(j, layers, hkv, g * r, n, dtype=torch.float32, device=dev)
    norms = torch.empty(j, layers, hkv, n, dtype=torch.float32, device=dev)
    gbs = copy_gbs()
    key_mb = j * layers * hkv * n * d * 2 / 1e6
    out_mb = (logits.numel() + norms.numel()) * 4 / 1e6
    k = min(cfg.k, n - cfg.sinks)
    rows: list[dict] = []

    def row(name: str, ms: float, mb: float, **extra) -> None:
        rows.append({"part": "refresh_part", "requests": j, "entries": n, "launch": name, **extra,
                     "ms": round(ms, 4), "MB": round(mb, 1), "floor_ms": round(mb / gbs, 4), "copy_GB/s": round(gbs)})

    for block_n in (32, 64, 128, 256):
        ms = graph_ms(lambda b=block_n: ring_logits_layers(rt.ring, slots, ridx, row_pos, rt.scale, views, 0, layers,
                                                           blocks, n, logits, norms, causal=False, block_n=b), reps=5)
        row("logits", ms, key_mb + out_mb, block_n=block_n)
    flat = logits.view(j * layers, hkv, g * r, n)
    ms = graph_ms(lambda: selector_scores(cfg, flat, norms.view(j * layers, hkv, n), n - 1), reps=5)
    row("selector", ms, out_mb + 4 * j * layers * hkv * n * 4 / 1e6)  # its reads, the scratch and the scores
    scores = selector_scores(cfg, flat, norms.view(j * layers, hkv, n), n - 1)
    ms = graph_ms(lambda: topk_sorted(scores, k), reps=5)
    row("topk_sorted", ms, scores.numel() * 4 / 1e6, k=k)
    keep = topk_sorted(scores, k).view(j, layers, hkv, k)
    for block in (64, 128):
        ms = graph_ms(lambda b=block: pack_selection_layers(keep, cfg.sinks, None, blocks, views, rt.ck, rt.cv,
                                                            rt.cpos, slots, block=b, ccount=rt.ccount), reps=5)
        row("pack", ms, 2 * 2 * j * layers * hkv * (cfg.sinks + k) * d * 2 / 1e6, block=block)
    return rows


def time_launches(reps: int = 2000) -> dict:
    """The host's time per launch on this machine (microseconds, the GPU not waited for): a small torch
    op, the fast step's Triton launch (~45 arguments; one row, nothing to read), and the refresh's top-K
    of 2,048 over 288 rows of 16,384 entries (`topk_sorted`). One request's refresh makes a host-to-device
    copy, four Triton launches and the top-K with its sort (per chunk of layers: the logits, the selector
    and the top-K)."""
    from cotserve.kernels.sfi_paged import sfi_paged_fast
    from cotserve.kernels.sfi_select import topk_sorted

    dev = torch.device("cuda")
    x = torch.zeros(16, device=dev)
    q = torch.zeros(1, 32, 128, device=dev, dtype=torch.bfloat16)
    ck = torch.zeros(1, 8, 64, 128, device=dev, dtype=torch.bfloat16)
    cpos = torch.full((1, 8, 64), -1, dtype=torch.int32, device=dev)
    kc = torch.zeros(2, 16, 8, 128, device=dev, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    ring = torch.zeros(2, 32, 32, 128, device=dev, dtype=torch.bfloat16)
    w = torch.zeros(RING_WRITES, dtype=torch.long, device=dev)

    def fast() -> None:  # row mode 0: every program leaves at once
        sfi_paged_fast(q, q, ck, ck, cpos, kc, kc, bt, one, one, one, one, one, 0.088, ring=(ring, w, w + 1, w), ccount=one)

    scores = torch.randn(288, 16384, device=dev)
    cases = {"torch_add_us": (lambda: x.add_(1.0), reps), "triton_fast_step_us": (fast, reps),
             "topk_sorted_2048_us": (lambda: topk_sorted(scores, 2048), 50)}
    out: dict = {"part": "launch_host_time"}
    for name, (fn, n) in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round(1e6 * (time.perf_counter() - t0) / n, 2)
        torch.cuda.synchronize()
    return out


def profile_refresh(j: int = 4, n: int = 32768) -> None:
    """Where a refresh's time goes: torch.profiler's operators, top 25 by device time, then by host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_refresh(j=j, n=n)
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    if "--profile" in sys.argv:  # --profile [J N]
        i = sys.argv.index("--profile")
        args = [int(a) for a in sys.argv[i + 1 : i + 3]]
        profile_refresh(*args)
        return
    if "--launches" in sys.argv:  # the host's cost of one launch
        print(json.dumps(time_launches()), flush=True)
        return
    if "--refresh-parts" in sys.argv:  # --refresh-parts [J N]: a refresh's launches alone
        i = sys.argv.index("--refresh-parts")
        for row in refresh_parts(*[int(a) for a in sys.argv[i + 1 : i + 3]]):
            print(json.dumps(row), flush=True)
        return
    if "--refresh" in sys.argv:  # --refresh J N [J N ...]: refreshes alone
        nums = [int(a) for a in sys.argv[sys.argv.index("--refresh") + 1 :]]
        for j, n in zip(nums[::2], nums[1::2], strict=False):
            print(json.dumps(time_refresh(j=j, n=n)), flush=True)
        return
    for fn, kw in [(time_kernel, {}), (time_kernel, {"rows": 8}), (time_kernel, {"rows": 4}),
                   (time_refresh, {"j": 1, "n": 8192}),
                   (time_refresh, {"j": 16, "n": 8192}), (time_refresh, {"j": 16, "n": 32768}),
                   (time_refresh, {"j": 8, "n": 65536}), (time_refresh, {"j": 4, "n": 131072})]:
        try:
            print(json.dumps(fn(**kw)), flush=True)
        except Exception as exc:  # one failing part must not hide the others
            print(json.dumps({"part": fn.__name__, **kw, "error": f"{type(exc).__name__}: {exc}"}), file=sys.stdout)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
