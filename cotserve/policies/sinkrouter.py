"""`sinkrouter`: sink-aware KV-group routing at decode time (read axis).

SinkRouter: Sink-Aware Routing for Efficient Long-Context Decoding in Large Language and Multimodal
Models (Liu et al., arXiv:2604.16883, 2026). The paper's observation: attention heads that put almost
all their mass on the first token (the attention *sink*) sit at a fixed point whose output is
near zero, so the whole history read of such a head can be skipped. Routing happens *before* the
long KV scan, from a signal that costs one dot product per query head: the alignment of the
current query with the cached key of token 0 (the *anchor*).

What this module does, per decode step, layer l >= first_layers and KV group g (= one KV head and
the Hq/Hkv query heads that share it, because a GQA group shares one KV read, decisions are per
group, never per query head):

    z_{b,h}   = (q_{b,h} . k0_{b,g}) * scaling        h in group g   (RoPE already applied; the
                or cos(q_{b,h}, k0_{b,g})                             anchor at position 0 has the
                                                                       identity rotation)
    s_{b,g}   = agg_{h in g} z_{b,h}                   agg in {min, mean, max} (see SCORES)
    p_{b,g}   = sigmoid(a_{l,g} s_{b,g} + b_{l,g})     per-(layer, group) Platt scaling, when the
                                                       calibration file has it (else p = s)
    sink(b,g) = p_{b,g} >= tau(L_b),  L_b = entries the slot's cache holds at this layer
    o_{b,h}   = 0 for h in a sink group (the paper's zero surrogate; its history is not read)
              = softmax(q K^T * scaling) V over the cache, otherwise (normal attention).

Which alignment and aggregation: the logit `q.k0 * scaling` is exactly the attention logit the
model gives token 0 (the signal the paper routes on: query against the position-0 key); the cosine
removes the query norm. `min` over the group's heads matches a regime in which *every* head must
be a sink head, `mean`/`max` are looser. `cotserve calibrate sinkrouter` measures the AUPRC of
every candidate against the true regime and keeps the best (`--score auto`); the runtime uses the
file's choice. On the bundled SmolLM2-135M the best raw score is `cos_mean`, but every raw score is
barely above chance (AUPRC 0.08-0.10 at a sink rate of 0.087): raw anchor logits have very
different scales per layer (mean z from -8.6 to +7.5 at 1024 tokens, unrelated to the layer's sink
mass), so one global threshold ranks groups of different layers badly. The calibration therefore
also fits, per (layer, group), a logistic map of `s` to P(sink | s) (Platt scaling), which lifts the
AUPRC to 0.68 (0.66 held out), and the threshold is applied to that probability (`--no-platt` in
calibration keeps the raw score under one global threshold, the paper's plain thresholding).
Without a file (`tau=` given), the raw `score` option (default `logit_min`) is thresholded.

True regime (what the score predicts, measured under dense decoding in calibration): a group is
sink-dominant when the attention mass on token 0 is >= gamma (default 0.65) for *all* of its query
heads (`regime=all`; `regime=mean` uses the mean mass of the group's heads instead).

tau(L) is a cubic in normalised context length x = L / norm_length (norm_length = the model's
context window), fitted by calibration so that the skip ratio on the calibration data meets a
target; x is clamped to the calibrated range (a cubic must not be extrapolated).

Surrogate: the paper's form is the zero output (the fixed point's output is near zero). The public
reference implementation (github.com/streamer-AP/SinkRouter) returns token 0's value vector for
sink groups instead; that is `surrogate=anchor_value` here (the anchor value is kept from prefill,
so still no history read).

Composition with eviction: the anchor key/value are copied per (layer, slot, KV head) at prefill,
so routing stays correct after any compaction of the cache; non-sink groups read whatever the
cache holds (`lens`, `pos`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cotserve.errors import PolicyError
from cotserve.kernels import cpu_decode
from cotserve.policies.base import Axis, Policy, PolicyConfig, grouped_attention
from cotserve.policies.options import SinkRouterOptions, check_config, options_config
from cotserve.policies.registry import register
from cotserve.policies.served import shipped_calibration

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState
    from cotserve.kv.cache import KVCache

CALIBRATE_CMD = "cotserve calibrate sinkrouter --model {model} --out FILE.json"


# -- routing scores ---------------------------------------------------------------------------
def anchor_logits(q: torch.Tensor, anchor_k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled dot product of every query head with its group's anchor key.

    q [B, Hq, 1, D] (RoPE applied), anchor_k [B, Hkv, D]. Returns [B, Hkv, G] (G = Hq / Hkv)."""
    b, hq, _, d = q.shape
    hkv = anchor_k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).float()
    return torch.einsum("bgnd,bgd->bgn", qg, anchor_k.float()) * scaling


def anchor_cosines(q: torch.Tensor, anchor_k: torch.Tensor) -> torch.Tensor:
    """Cosine between every query head and its group's anchor key: [B, Hkv, G]."""
    b, hq, _, d = q.shape
    hkv = anchor_k.shape[1]
    qg = torch.nn.functional.normalize(q.reshape(b, hkv, hq // hkv, d).float(), dim=-1)
    kn = torch.nn.functional.normalize(anchor_k.float(), dim=-1)
    return torch.einsum("bgnd,bgd->bgn", qg, kn)


SCORES = {
    # name: (per-head alignment, aggregation over the group's query heads)
    "logit_min": ("logit", "min"),
    "logit_mean": ("logit", "mean"),
    "logit_max": ("logit", "max"),
    "cos_min": ("cos", "min"),
    "cos_mean": ("cos", "mean"),
}


def routing_score(kind: str, q: torch.Tensor, anchor_k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Routing score per (slot, KV group) [B, Hkv], computed before any history is read."""
    base, agg = SCORES[kind]
    per_head = anchor_logits(q, anchor_k, scaling) if base == "logit" else anchor_cosines(q, anchor_k)
    if agg == "min":
        return per_head.amin(-1)
    if agg == "max":
        return per_head.amax(-1)
    return per_head.mean(-1)


def platt(score: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-(layer, group) Platt scaling of a raw score: sigmoid(a * s + b), a, b [Hkv] for one
    layer. Raw anchor logits live on very different scales per layer; calibrating them per group
    into P(sink | score) makes one threshold meaningful across layers."""
    return torch.sigmoid(score * a.to(score.device) + b.to(score.device))


def all_scores(q: torch.Tensor, anchor_k: torch.Tensor, scaling: float) -> dict[str, torch.Tensor]:
    """Every candidate score at once (calibration)."""
    return {k: routing_score(k, q, anchor_k, scaling) for k in SCORES}


# -- tau(L) ------------------------------------------------------------------------------------
@dataclass
class TauFit:
    """tau(x) = sum_i coeffs[i] * x**(deg - i) (numpy.polyfit order), x = L / norm_length clamped
    to [x_lo, x_hi]."""

    coeffs: list[float]
    norm_length: int
    x_lo: float
    x_hi: float

    def __call__(self, lengths: torch.Tensor) -> torch.Tensor:
        x = (lengths.double() / self.norm_length).clamp(self.x_lo, self.x_hi)
        out = torch.zeros_like(x)
        for c in self.coeffs:  # Horner
            out = out * x + c
        return out.float()


@dataclass
class Calibration:
    path: str
    model: str
    score: str
    first_layers: int
    default_target: float
    fits: dict[float, TauFit]
    num_layers: int
    num_kv_heads: int
    raw: dict[str, Any]
    platt_a: torch.Tensor | None = None  # [layers, Hkv]
    platt_b: torch.Tensor | None = None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise PolicyError(f"sinkrouter calibration file {p} does not exist")
        try:
            data = json.loads(p.read_text())
            fits = {round(float(t), 4): TauFit(coeffs=[float(c) for c in f["coeffs"]],
                                                norm_length=int(data["norm_length"]),
                                                x_lo=float(f["x_range"][0]), x_hi=float(f["x_range"][1]))
                    for t, f in data["fits"].items()}
            score = data["score"]
            if score not in SCORES:
                raise ValueError(f"unknown score {score!r}")
            pl = data.get("platt")
            cal = cls(path=str(p), model=data["model"], score=score, first_layers=int(data["first_layers"]),
                      default_target=float(data["default_target"]), fits=fits,
                      num_layers=int(data["num_layers"]), num_kv_heads=int(data["num_kv_heads"]), raw=data)
            if pl:
                cal.platt_a = torch.tensor(pl["a"], dtype=torch.float32)
                cal.platt_b = torch.tensor(pl["b"], dtype=torch.float32)
                if cal.platt_a.shape != (cal.num_layers, cal.num_kv_heads) or cal.platt_b.shape != cal.platt_a.shape:
                    raise ValueError("platt a/b must be [num_layers, num_kv_heads]")
            return cal
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise PolicyError(f"sinkrouter calibration file {p} is not valid: {type(exc).__name__}: {exc}") from exc

    def tau(self, target: float | None) -> TauFit:
        t = self.default_target if target is None else round(float(target), 4)
        if t not in self.fits:
            have = ", ".join(str(k) for k in sorted(self.fits))
            raise PolicyError(
                f"sinkrouter calibration {self.path} has no fit for target_skip={t} (has: {have}); "
                f"run `cotserve calibrate sinkrouter --model {self.model} --target-skip {t} --out FILE.json`"
            )
        return self.fits[t]


def check_calibration(cal: Calibration, model_name: str, num_layers: int, num_kv_heads: int,
                      first_layers: int) -> None:
    """Refuse a calibration made for another policy setting: another model (by slug), other
    layer / KV-group counts, or other never-routed first layers (the file's Platt maps and tau
    were fitted on layers >= its `first_layers`; elsewhere they are undefined)."""
    from cotserve.model_names import model_slug

    fix = f"run `{CALIBRATE_CMD.format(model=model_name)}`"
    if cal.num_layers != num_layers or cal.num_kv_heads != num_kv_heads:
        raise PolicyError(
            f"sinkrouter calibration {cal.path} is for a model with {cal.num_layers} layers / "
            f"{cal.num_kv_heads} KV heads, this one has {num_layers} / {num_kv_heads}; {fix}")
    if model_slug(cal.model) != model_slug(model_name):
        raise PolicyError(f"sinkrouter calibration {cal.path} was made for model {cal.model!r}, not {model_name!r}; {fix}")
    if cal.first_layers != first_layers:
        raise PolicyError(
            f"sinkrouter calibration {cal.path} was fitted with first_layers={cal.first_layers}, the policy has "
            f"first_layers={first_layers}; set --policy-opt first_layers={cal.first_layers} or {fix} "
            f"--first-layers {first_layers}")


# -- decode attention: reference and fast path --------------------------------------------------
def sinkrouter_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                                skip: torch.Tensor, scaling: float,
                                surrogate: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch reference: dense attention for every group, then sink groups replaced.

    q [B, Hq, 1, D], k/v [B, Hkv, S, D], valid [B, S], skip bool [B, Hkv], surrogate [B, Hkv, D]
    (None: zeros). Returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    out = grouped_attention(q, k, v, valid.unsqueeze(1), scaling).view(b, hkv, hq // hkv, d)
    sur = torch.zeros(b, hkv, d, dtype=out.dtype, device=out.device) if surrogate is None else surrogate
    out = torch.where(skip[:, :, None, None], sur[:, :, None, :].to(out.dtype), out)
    return out.reshape(b, hq, 1, d)


GATHER_MIN_ROWS = 16  # from this many rows to read, one gathered matmul beats a loop of views
# On a CPU with the C++ kernel: below this fraction of skipped groups in a layer, the step runs the
# dense kernel over every group and overwrites the sink groups (so a routed step never costs more
# than `dense`'s); from it on, only the other groups are read (`sinkrouter_decode`).
KERNEL_SKIP_CUTOFF = 0.5


def sinkrouter_decode(q: torch.Tensor, cache: KVCache, layer: int, skip: torch.Tensor, scaling: float,
                      surrogate: torch.Tensor | None = None, gather_min_rows: int = GATHER_MIN_ROWS) -> torch.Tensor:
    """Fast path: only the (slot, group) rows with skip=False are read from the cache and attended;
    sink rows never touch the cache. Few rows: one attention per row on views of the cache
    (`cache.read_row`, no copy); many rows: one batched attention over the rows gathered by
    `cache.read_rows`. Same result as `sinkrouter_decode_reference` on the cache's view."""
    b, hq, _, d = q.shape
    hkv = skip.shape[1]
    g = hq // hkv
    if surrogate is None:
        out = torch.zeros(b, hkv, g, d, dtype=q.dtype, device=q.device)
    else:
        out = surrogate[:, :, None, :].to(q.dtype).expand(b, hkv, g, d).clone()
    rows = (~skip).nonzero(as_tuple=False)
    n = rows.shape[0]
    if n == 0:
        return out.view(b, hq, 1, d)
    qg = q.reshape(b, hkv, g, d)
    if n < gather_min_rows:
        lens = cache.lens[layer].tolist()
        for bi, gi in rows.tolist():
            kr, vr = cache.read_row(layer, bi, gi, lens[bi])  # [S_b, D]
            probs = torch.softmax((torch.matmul(qg[bi, gi], kr.transpose(0, 1)) * scaling).float(), dim=-1)
            out[bi, gi] = torch.matmul(probs.to(vr.dtype), vr)
        return out.view(b, hq, 1, d)
    bi, gi = rows[:, 0], rows[:, 1]
    lens = cache.lens[layer, bi]
    s = int(lens.max())
    kr, vr = cache.read_rows(layer, bi, gi, s)  # [N, S, D]
    scores = torch.matmul(qg[bi, gi], kr.transpose(-1, -2)) * scaling  # [N, G, S]
    valid = torch.arange(s, device=q.device).unsqueeze(0) < lens.unsqueeze(1)  # [N, S]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(vr.dtype)
    out[bi, gi] = torch.matmul(probs, vr)
    return out.view(b, hq, 1, d)


# -- the policy ---------------------------------------------------------------------------------
@options_config(SinkRouterOptions)
class SinkRouterConfig(PolicyConfig):
    """`SinkRouterOptions` (docs/policies/sinkrouter.md). `kernel=auto` sends unrouted layers and
    layers with few sink groups to `dense`'s C++ kernel (KERNEL_SKIP_CUTOFF); with `kernel=torch`
    the first layers take the engine's default step."""

    def validate(self) -> None:
        check_config(self)
        if self.calibration and not Path(self.calibration).expanduser().is_file():
            raise ValueError(f"calibration file {self.calibration} does not exist; build one with "
                             f"`{CALIBRATE_CMD.format(model='MODEL')}`")


@register
class SinkRouterPolicy(Policy):
    """Sink-aware KV-group routing (SinkRouter, arXiv:2604.16883); see the module docstring."""

    name = "sinkrouter"
    axis = Axis.READ
    config_cls = SinkRouterConfig

    def __init__(self, config: SinkRouterConfig | None = None):
        super().__init__(config)
        self.cfg: SinkRouterConfig = self.config  # type: ignore[assignment]
        self.calibration: Calibration | None = None
        self.tau_fn: TauFit | None = None
        self.score_kind = self.cfg.score
        self.anchor_k: torch.Tensor | None = None  # [layers, B, Hkv, D]
        self.anchor_v: torch.Tensor | None = None
        self.skipped: torch.Tensor | None = None  # [B] groups skipped over decode steps
        self.eligible: torch.Tensor | None = None  # [B] groups that could be routed

    # -- setup ---------------------------------------------------------------------------------
    def resolve_calibration(self, model_name: str) -> None:
        if not math.isnan(self.cfg.tau):
            return
        from cotserve.model_names import model_slug

        slug = model_slug(model_name)
        path = Path(self.cfg.calibration).expanduser() if self.cfg.calibration else shipped_calibration(slug)
        if not path.is_file():
            raise PolicyError(
                f"sinkrouter needs a calibration for model {model_name!r} and none was found "
                f"(looked for {path}); build one with `{CALIBRATE_CMD.format(model=model_name)}` "
                "and pass it with --policy-opt calibration=FILE.json"
            )
        self.calibration = Calibration.load(path)
        self.tau_fn = self.calibration.tau(self.cfg.target_skip or None)
        self.score_kind = self.calibration.score

    def begin(self, batch: BatchState) -> None:
        info = batch.info
        self.resolve_calibration(info.model_name)
        if self.calibration is not None:
            check_calibration(self.calibration, info.model_name, info.num_layers, info.num_kv_heads,
                              self.cfg.first_layers)
        self.kernel = (self.cfg.kernel == "auto" and batch.cache.device.type == "cpu"
                       and batch.cache.k.dtype == torch.float32 and cpu_decode.available())
        bsz, dev = batch.batch_size, batch.cache.device
        shape = (info.num_layers, bsz, info.num_kv_heads, info.head_dim)
        self.anchor_k = torch.zeros(shape, dtype=batch.cache.k.dtype, device=dev)
        self.anchor_v = torch.zeros(shape, dtype=batch.cache.v.dtype, device=dev)
        self.skipped = torch.zeros(bsz, dtype=torch.long, device=dev)
        self.eligible = torch.zeros(bsz, dtype=torch.long, device=dev)

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState):
        """Keep our own copy of the anchor (the entry at position 0) of every (slot, KV head)."""
        cache = batch.cache
        self.anchor_k[layer] = cache.k[layer, :, :, 0]
        self.anchor_v[layer] = cache.v[layer, :, :, 0]
        return None

    # -- decode --------------------------------------------------------------------------------
    def tau(self, lengths: torch.Tensor) -> torch.Tensor:
        if self.tau_fn is None:
            return torch.full(lengths.shape, self.cfg.tau, dtype=torch.float32, device=lengths.device)
        return self.tau_fn(lengths)

    def route(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        """Sink mask [B, Hkv] from the anchor alone (no history read)."""
        score = routing_score(self.score_kind, q, self.anchor_k[layer], batch.scaling)
        cal = self.calibration
        if cal is not None and cal.platt_a is not None:
            score = platt(score, cal.platt_a[layer], cal.platt_b[layer])
        tau = self.tau(batch.cache.lens[layer]).to(score.device)
        return score >= tau.unsqueeze(1)

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor | None:
        if layer < self.cfg.first_layers:  # never routed: `dense`'s step
            if self.kernel:
                from cotserve.policies.dense import kernel_dense_decode

                return kernel_dense_decode(q, batch, layer)
            return None
        skip = self.route(layer, q, batch)
        active = batch.active if batch.active is not None else torch.ones_like(skip[:, 0])
        self.skipped += (skip & active.unsqueeze(1)).sum(1)
        self.eligible += active.long() * skip.shape[1]
        n_skip = int(skip.sum())
        if n_skip == 0 and not self.kernel:
            return None  # the engine's dense step
        sur = self.anchor_v[layer] if self.cfg.surrogate == "anchor_value" else None
        if self.kernel and n_skip < KERNEL_SKIP_CUTOFF * skip.numel():
            # few groups skipped: the dense C++ kernel for all (what `dense` costs), sink groups
            # overwritten; reading only the other rows in torch would cost more than that
            from cotserve.policies.dense import kernel_dense_decode

            out = kernel_dense_decode(q, batch, layer)
            if n_skip:
                b, hq, _, d = q.shape
                hkv = skip.shape[1]
                grp = out.view(b, hkv, hq // hkv, d)
                fill = (torch.zeros(b, hkv, d, dtype=out.dtype) if sur is None else sur.to(out.dtype))
                grp.copy_(torch.where(skip[:, :, None, None], fill[:, :, None, :], grp))
            return out
        return sinkrouter_decode(q, batch.cache, layer, skip, batch.scaling, sur, GATHER_MIN_ROWS)

    def telemetry(self, slot: int) -> dict[str, Any]:
        if self.eligible is None:
            return {}
        skipped, eligible = int(self.skipped[slot]), int(self.eligible[slot])
        return {"sinkrouter_skip_ratio": round(skipped / eligible, 4) if eligible else 0.0,
                "sinkrouter_skipped_groups": skipped, "sinkrouter_eligible_groups": eligible}
