"""SFI's decode attention as C++ CPU kernels (`cpu_decode.cpp`): the fast step
(`two_source_decode`) and the fallback heads' page reads (`page_bound_decode`); also dense
decode over many one-slot caches in one call (`ragged_decode`, the continuous engine's batched
dense step). Built on first use
(`make install` builds it) with torch's extension builder (g++ and ninja on PATH; about 30 s on
the development machine), then cached under `$COTSERVE_CACHE_DIR/torch_extensions` (default
`~/.cache/cotserve/torch_extensions`) in a folder named after the torch version, a fingerprint
of the CPU (its model and feature flags: an x86 build uses `-march=native`, so a cache shared
with another CPU must not load it) and a hash of the source (text, path, flags), so checkouts
of different code do not rebuild one shared module. A build lock older than 15 minutes (left by
a killed build) is removed instead of waited on.

The torch form of the same computation is `policies.sfi.attention.fast_attention` (several ops,
each a pass over memory, and an intermediate logits tensor); the plain reference both are tested
against is `fast_attention_reference`. The kernel's own gain is reading each K/V row once; its
larger one is a bfloat16 compact buffer, widened to float32 on load, so that every product,
the softmax and the value sums stay float32 while the compact bytes halve (torch on a CPU has no
bf16 x bf16 -> float32 matmul: the torch form would round the logits to bf16).
`available()` is False where the build fails (no compiler): callers fall back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
_module: ModuleType | None = None
_failed = False


def _build() -> ModuleType | None:
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load

        cache = Path(os.environ.get("COTSERVE_CACHE_DIR", Path.home() / ".cache" / "cotserve"))
        source = Path(__file__).with_suffix(".cpp")
        # -fno-trapping-math: lets the compiler if-convert (so vectorize) the exp and log polynomials;
        # it assumes no floating-point traps and changes no result
        flags = ["-O3", "-fopenmp", "-fno-trapping-math"]
        if platform.machine() in ("x86_64", "AMD64"):
            flags += ["-march=native", "-mprefer-vector-width=512"]
        # one folder per source text and source path: checkouts of different code (or the same
        # code at another path, which ninja sees as a new build) do not rebuild each other's module
        src = hashlib.sha256(source.read_bytes() + str(source).encode() + " ".join(flags).encode()).hexdigest()[:12]
        tag = f"torch{torch.__version__.replace('+', '_')}_{_cpu_fingerprint()}_{src}"
        build = cache / "torch_extensions" / f"cpu_decode_{tag}"
        build.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(build / "lock")
        _module = load(name="cotserve_cpu_decode", sources=[str(source)],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as exc:  # no compiler, no headers: the torch path serves instead
        _failed = True
        log.warning("cotserve: the CPU decode kernel did not build (%s); using the torch path", exc)
    return _module


STALE_LOCK_S = 900.0  # a build takes about 30 s; a lock this old was left by a killed build


def _clear_stale_lock(lock: Path) -> None:
    """torch's extension builder waits, without limit, for its lock file to go; a build killed
    mid-way (out of memory, a signal) leaves it behind, and every later process would hang."""
    import time

    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("cotserve: removing the stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def _cpu_fingerprint() -> str:
    """A short hash of the machine type and, where /proc/cpuinfo exists, the CPU model and flags."""
    text = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        keys = ("model name", "flags", "Features", "CPU part")
        text += "".join(sorted({ln for ln in info.splitlines() if ln.split(":")[0].strip() in keys}))
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return _build() is not None


def two_source_decode(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, cmask: torch.Tensor, wk: torch.Tensor,
                      wv: torch.Tensor, wstart: torch.Tensor, wend: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of q [B, Hkv, G, D] (float32; the G query heads of each KV head) over the
    compact entries, keys ck in blocks of 16 [B, Hkv, C / 16, D, 16] and values cv
    [B, Hkv, C, D] (float32 or bfloat16; entries with cmask [B, Hkv, C] False are skipped), and
    the window rows wstart[b] .. wend[b] - 1 of wk / wv [B, Hkv, S, D] (float32, e.g. one layer
    of the cache), through one softmax. Returns [B, Hkv, G, D] float32."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.two_source_decode(q, ck, cv, cmask, wk, wv, wstart, wend, float(scaling))


def ragged_decode(q: torch.Tensor, knew: torch.Tensor, vnew: torch.Tensor, kcaches: list[torch.Tensor],
                  vcaches: list[torch.Tensor], layer: int, lens: torch.Tensor, scaling: float) -> torch.Tensor:
    """Dense decode for B sequences with caches of their own (the continuous engine's batched
    dense step): kcaches[b] / vcaches[b] [L, 1, Hkv, S_b, D] float32 (one-slot `KVCache` tensors,
    any capacity). Writes knew / vnew [B, Hkv, D] at row lens[b] of layer `layer` (in place), then
    attends q [B, Hkv, G, D] over rows 0 .. lens[b]. Equals `two_source_decode` with no compact
    entries and the window 0 .. lens[b] + 1, bit for bit. Returns [B, Hkv, G, D] float32. The
    caller advances its own length bookkeeping."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.ragged_decode(q, knew, vnew, kcaches, vcaches, int(layer), lens, float(scaling))


def pack_compact(k: torch.Tensor, v: torch.Tensor, slot: int, keys: torch.Tensor, layers: torch.Tensor,
                 ckt: torch.Tensor, cv: torch.Tensor) -> None:
    """SFI's re-pack of one slot, in place: for layer `layers[i]` and KV head h, the cache rows
    `keys[i, h, :m]` of k / v [L, B, H, S, D] (float32) into the compact keys ckt
    [L, B, H, C / 16, D, 16] (blocks of 16 entries; entries m .. C-1 repeat row keys[i, h, 0], to be
    masked) and values cv[..., :m, :] [L, B, H, C, D] (float32 or bfloat16, rounded as torch's `.to`
    rounds). Equals the gather-and-copy of `SFIPolicy._pack`'s torch path, in one pass."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    mod.pack_compact(k, v, int(slot), keys, layers, ckt, cv)


def page_bound_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
                      lens: torch.Tensor, bounds: list[torch.Tensor], budget: int, page: int, sinks: int,
                      scaling: float) -> torch.Tensor:
    """SFI's fallback read (`policies.sfi.fallback.page_bound_attention`) for N heads in one call:
    q [N, G, D] float32; head i's entries are rows 0 .. lens[i] - 1 of k / v [slots[i], heads[i]]
    (one float32 cache layer [B, H, S, D]); bounds[i] [2D, P_i] its page bounds. The pages are
    ranked by the same Quest bound, the chosen rows read in place. Returns [N, G, D] float32."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.page_bound_decode(q, k, v, slots, heads, lens, bounds, int(budget), int(page), int(sinks),
                                 float(scaling))


def _selector_args(cfg) -> tuple:
    """The SFI options `selector_scores` / `selector_select` take, in their order (after now, k)."""
    return (int(cfg.sinks), float(cfg.decay), int(cfg.tail_len), float(cfg.brake), float(cfg.norm_power),
            float(cfg.lam), float(cfg.lam_clip), int(cfg.nms_window), float(cfg.nms_strength),
            float(cfg.excl_strength), float(cfg.excl_temperature))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x itself where its rows are contiguous (views of the cache's [.., capacity] rows are), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def selector_supported(cfg) -> bool:
    """Whether the C++ selector serves these SFI options: the paper's geometric fusion, soft-NMS
    half-windows up to 64 (the linear fusion option takes the torch form)."""
    return cfg.fusion == "geometric" and 0 <= cfg.nms_window <= 64 and available()


def selector_scores(cfg, f: torch.Tensor, positions: torch.Tensor, key_norms: torch.Tensor, now: int) -> torch.Tensor:
    """SFI's selector steps 2-4 in C++ (`policies.sfi.selection.selector_scores_from_evidence`, its
    reference): prior, geometric fusion, soft-NMS, cross-head exclusivity on the evidence
    f [P, H, n] of P independent problems (float32), true positions [P, H, n] (int64) and key
    norms [P, H, n] (any outer strides: views of the cache). Returns the final log scores [P, H, n] float32 (-inf
    outside the candidates), equal to the torch form's up to float rounding. One pass per step
    over each row while it sits in cache, layers in parallel."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.selector_scores(_rows(f.float()), _rows(positions), _rows(key_norms.float()), int(now),
                               *_selector_args(cfg))


def selector_select(cfg, f: torch.Tensor, positions: torch.Tensor, key_norms: torch.Tensor, now: int,
                    k: int) -> torch.Tensor:
    """`selector_scores`, then the top k of each (problem, KV head) row: int64 [P, H, k] ascending
    (of equal scores the lower index; `selector.topk_per_head` on the same scores picks the same
    set up to exact ties)."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.selector_select(_rows(f.float()), _rows(positions), _rows(key_norms.float()), int(now), int(k),
                               *_selector_args(cfg))


def topk_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top k per row of scores [..., n] (float32), indices ascending (of equal scores the lower
    index): the last step of `selector_select` alone."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.topk_ascending(scores.float().contiguous(), int(k))


def two_source_decode_evidence(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, cmask: torch.Tensor,
                               wk: torch.Tensor, wv: torch.Tensor, wstart: torch.Tensor, wend: torch.Tensor,
                               scaling: float, slow: torch.Tensor, f: torch.Tensor, sinks: int,
                               alpha: float) -> torch.Tensor:
    """`two_source_decode` with SFI's slow step fused in: the slots with slow[b] (bool [B]) read
    no compact entries and rows 0 .. wend[b] - 1 of wk / wv (dense attention, the same arithmetic
    as the dense policy's kernel step), and write, from the same logits, the selector's evidence
    into f[b, h, :wend[b]] (f float32 [B, Hkv, S], rows contiguous): per KV head, the softmax over
    the entries from `sinks` on of each query row of its group, combined by the power mean
    M_alpha (alpha > 0), normalized (`selector.evidence_and_instability` on the current query,
    obs_window = 1, its reference). Returns [B, Hkv, G, D] float32."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    return mod.two_source_decode_evidence(q, ck, cv, cmask, wk, wv, wstart, wend, float(scaling), slow, f,
                                          int(sinks), float(alpha))


def pack_compact_update(k: torch.Tensor, v: torch.Tensor, slot: int, keys: torch.Tensor, layers: torch.Tensor,
                        ckt: torch.Tensor, cv: torch.Tensor, cidx: torch.Tensor) -> None:
    """`pack_compact`, incremental, in place: cidx [L, B, H, C] (int64) names the cache row each
    compact entry holds (-1: none). Rows of `keys[i, h]` already held stay where they are; only
    the new ones are read and converted, into the entries of the rows no longer chosen; cidx is
    updated (-1 where an entry now holds nothing chosen: the caller masks it). The buffers then
    hold the same rows as after `pack_compact`, in another order."""
    mod = _build()
    if mod is None:
        raise RuntimeError("the CPU decode kernel is not available (see the warning logged at build)")
    mod.pack_compact_update(k, v, int(slot), keys, layers, ckt, cv, cidx)
