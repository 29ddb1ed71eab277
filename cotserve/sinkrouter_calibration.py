"""`cotserve calibrate sinkrouter`: measure the sink regime under dense decoding, fit tau(L).

For each calibration length L, `prompts` texts of exactly L tokens (MATH training problems and
solutions, concatenated: `cotserve.bench.prompts.long_prompts`) are decoded densely (greedy) for
`steps` steps. At every decode step, layer and (slot, KV group) the probe records

* every candidate routing score of `SCORES` (computed from the query and the anchor key only, as
  the runtime does), and
* the true regime: attention mass on token 0 >= gamma for all of the group's query heads
  (`regime=all`) or for their mean (`regime=mean`).

Report: the AUPRC of each score for the regime (routable layers only, i.e. layer >= first_layers),
the positive (sink) rate, and for each target skip ratio a cubic tau(x), x = L / norm_length
(SinkRouter, arXiv:2604.16883: the threshold depends on context length): per calibration length,
tau_i is the (1 - target) quantile of the chosen score over that length's records (so a fraction
`target` of them passes), then a least-squares polynomial of degree min(3, #lengths - 1) through the
points (x_i, tau_i). The realised skip ratio of the fitted curve on the calibration records is
reported per length, with the precision of its skips (skipped groups that are truly sink groups).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cotserve.errors import CotserveError
from cotserve.policies.base import Axis, Policy
from cotserve.policies.sinkrouter import SCORES, TauFit, all_scores

SCORE_NAMES = list(SCORES)


class SinkProbe(Policy):
    """Dense decoding that records routing scores and the true regime (calibration only)."""

    name = "sinkprobe"
    axis = Axis.READ

    def __init__(self, steps: int, gamma: float):
        super().__init__()
        self.steps = steps
        self.gamma = gamma

    def begin(self, batch) -> None:
        info = batch.info
        b, layers, hkv = batch.batch_size, info.num_layers, info.num_kv_heads
        g = info.num_heads // hkv
        self.anchor_k = torch.zeros(layers, b, hkv, info.head_dim, dtype=batch.cache.k.dtype, device=batch.cache.device)
        self.scores = torch.full((self.steps, layers, b, hkv, len(SCORE_NAMES)), float("nan"))
        self.mass = torch.full((self.steps, layers, b, hkv, g), float("nan"))
        self.ctx = torch.zeros(self.steps, b, dtype=torch.long)

    def prefill_attention(self, layer, q, k, v, batch):
        self.anchor_k[layer] = batch.cache.k[layer, :, :, 0]
        return None

    def decode_attention(self, layer, q, batch):
        step = batch.step
        cache = batch.cache
        k, v, valid = cache.view(layer)
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        logits = torch.matmul(q.reshape(b, hkv, g, d), k.transpose(-1, -2)) * batch.scaling  # [B,Hkv,G,S]
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        if step < self.steps:
            is_anchor = (cache.pos[layer, :, :, : k.shape[2]] == 0).unsqueeze(2)  # [B,Hkv,1,S]
            self.mass[step, layer] = (probs * is_anchor).sum(-1).cpu()
            sc = all_scores(q, self.anchor_k[layer], batch.scaling)
            self.scores[step, layer] = torch.stack([sc[n] for n in SCORE_NAMES], -1).cpu()
            self.ctx[step] = cache.lens[layer].cpu()
        out = torch.matmul(probs.to(v.dtype), v)  # [B,Hkv,G,D]
        return out.reshape(b, hq, 1, d)


@dataclass
class Records:
    """Flat calibration records of routable layers: one row per (length run, step, layer, slot, group)."""

    run: np.ndarray  # index into lengths
    step: np.ndarray
    ctx: np.ndarray  # cache entries at that step
    layer: np.ndarray
    group: np.ndarray
    scores: np.ndarray  # [N, len(SCORE_NAMES)]
    mass: np.ndarray  # [N, G]
    lengths: list[int] = field(default_factory=list)

    def labels(self, gamma: float, regime: str) -> np.ndarray:
        if regime == "all":
            return (self.mass >= gamma).all(-1)
        return self.mass.mean(-1) >= gamma

    def score(self, name: str) -> np.ndarray:
        return self.scores[:, SCORE_NAMES.index(name)]


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the precision-recall curve (average precision: mean over the positives of the
    precision at their rank, by descending score). Tied scores form one block: each positive in
    it gets the precision at the block's end (so a constant score gets exactly the base rate,
    and no tie order flatters a score)."""
    n_pos = int(labels.sum())
    if n_pos == 0:
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    s, hit = scores[order], labels[order].astype(np.float64)
    last = np.r_[s[1:] != s[:-1], True]  # the last record of each block of equal scores
    ends = np.flatnonzero(last)
    tp = np.cumsum(hit)[ends]
    pos_in_block = np.diff(np.r_[0.0, tp])
    precision = tp / (ends + 1)
    return float((precision * pos_in_block).sum() / n_pos)


def group_base_rate(labels: np.ndarray, layer: np.ndarray, group: np.ndarray, num_layers: int,
                    num_groups: int) -> np.ndarray:
    """The constant per-(layer, group) baseline: each group's fraction of sink records [L, G]
    (no query information at all; NaN-free: 0 for groups without records)."""
    rate = np.zeros((num_layers, num_groups))
    for li in range(num_layers):
        for gi in range(num_groups):
            m = (layer == li) & (group == gi)
            if m.any():
                rate[li, gi] = labels[m].mean()
    return rate


def heldout_comparison(train: Records, test: Records, chosen: str, gamma: float, regime: str, num_layers: int,
                       num_groups: int) -> dict[str, float]:
    """AUPRC on held-out records (other text) of: the raw score, the constant per-group base rate
    fitted on `train`, and the score after per-(layer, group) Platt scaling fitted on `train`."""
    y_tr, y_te = train.labels(gamma, regime), test.labels(gamma, regime)
    raw_tr, raw_te = train.score(chosen), test.score(chosen)
    rate = group_base_rate(y_tr, train.layer, train.group, num_layers, num_groups)
    a, b = fit_platt(raw_tr, y_tr, train.layer, train.group, num_layers, num_groups)
    return {
        "records": int(len(y_te)),
        "sink_rate": round(float(y_te.mean()), 4),
        chosen: round(average_precision(raw_te, y_te), 4),
        "group_base_rate": round(average_precision(rate[test.layer, test.group], y_te), 4),
        f"{chosen}+platt": round(average_precision(apply_platt(raw_te, test.layer, test.group, a, b), y_te), 4),
    }


def per_layer_signal(records: Records, chosen: str, gamma: float, regime: str) -> dict[str, dict[str, float]]:
    """Per routable layer: mean attention mass on token 0 (over records and query heads), the
    sink rate, and the raw score's AUPRC within the layer (why the signal is weak or strong)."""
    y = records.labels(gamma, regime)
    raw = records.score(chosen)
    out = {}
    for layer in sorted(set(records.layer.tolist())):
        m = records.layer == layer
        out[str(layer)] = {"mass_token0": round(float(records.mass[m].mean()), 4),
                           "sink_rate": round(float(y[m].mean()), 4),
                           "score_mean": round(float(raw[m].mean()), 4),
                           "score_sd": round(float(raw[m].std()), 4),
                           "auprc": round(average_precision(raw[m], y[m]), 4) if y[m].any() else None}
    return out


def collect(engine, lengths: list[int], steps: int, prompts: int, gamma: float, first_layers: int,
            data_dir: str | None, log=None, random_tokens: bool = False, offset: int = 0) -> Records:
    """Dense decoding with the probe on every length; returns the routable layers' records.
    `offset`: text tokens skipped first (held-out records come from text after the fit's)."""
    from cotserve.bench.prompts import long_prompts
    from cotserve.engine.native import GenRequest
    from cotserve.engine.sampling import SamplingParams
    from cotserve.policies.base import PolicyStack

    limit = engine.info.max_positions
    for n in lengths:
        if n + steps + 1 > limit:
            raise CotserveError(f"calibration length {n} + {steps} steps exceeds the model's context of {limit} "
                                "tokens; use smaller --lengths or fewer --steps")
    cols: dict[str, list[np.ndarray]] = {"run": [], "step": [], "ctx": [], "layer": [], "group": [], "scores": [], "mass": []}
    for i, n in enumerate(lengths):
        t0 = time.perf_counter()
        texts = long_prompts(engine.tokenizer, n, prompts, data_dir, random_tokens=random_tokens, offset=offset)
        probe = SinkProbe(steps, gamma)
        reqs = [GenRequest(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True)) for p in texts]
        for _ in engine.stream(reqs, PolicyStack([probe])):
            pass
        sc = probe.scores[:, first_layers:]  # [T, L', B, Hkv, K]
        ms = probe.mass[:, first_layers:]
        t, nl, b, hkv, k = sc.shape
        layer = torch.arange(first_layers, first_layers + nl).view(1, nl, 1, 1).expand(t, nl, b, hkv)
        ctx = probe.ctx.view(t, 1, b, 1).expand(t, nl, b, hkv)
        cols["run"].append(np.full(t * nl * b * hkv, i))
        cols["step"].append(torch.arange(t).view(t, 1, 1, 1).expand(t, nl, b, hkv).reshape(-1).numpy())
        cols["ctx"].append(ctx.reshape(-1).numpy())
        cols["layer"].append(layer.reshape(-1).numpy())
        cols["group"].append(torch.arange(hkv).view(1, 1, 1, hkv).expand(t, nl, b, hkv).reshape(-1).numpy())
        cols["scores"].append(sc.reshape(-1, k).numpy())
        cols["mass"].append(ms.reshape(t * nl * b * hkv, -1).numpy())
        if log:
            log(f"length {n}: {prompts} prompt(s) x {steps} steps in {time.perf_counter() - t0:.1f}s")
    return Records(run=np.concatenate(cols["run"]), step=np.concatenate(cols["step"]), ctx=np.concatenate(cols["ctx"]),
                   layer=np.concatenate(cols["layer"]), group=np.concatenate(cols["group"]), scores=np.concatenate(cols["scores"]),
                   mass=np.concatenate(cols["mass"]), lengths=list(lengths))


def fit_platt(z: np.ndarray, y: np.ndarray, layer: np.ndarray, group: np.ndarray, num_layers: int,
              num_groups: int, ridge: float = 1.0, iters: int = 50,
              min_slope: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Per-(layer, group) logistic regression P(sink | z) = sigmoid(a z + b) (Platt scaling), by
    Newton's method on the standardised score with an L2 penalty `ridge` on both weights (keeps
    groups with no positive or no negative record finite). The slope is clamped to >= `min_slope`
    per standard deviation of z: P(sink) does not decrease with the anchor alignment, and a strictly
    positive slope keeps the calibrated scores of different records distinct (a group without
    positives would otherwise map every record to one value, and a quantile threshold could not
    realise its target through such ties). Unfitted groups get a = b = 0."""
    a = np.zeros((num_layers, num_groups))
    b = np.zeros((num_layers, num_groups))
    for li in range(num_layers):
        for gi in range(num_groups):
            m = (layer == li) & (group == gi)
            if not m.any():
                continue
            zz, yy = z[m].astype(np.float64), y[m].astype(np.float64)
            mu, sd = zz.mean(), zz.std() + 1e-6
            x = np.stack([(zz - mu) / sd, np.ones_like(zz)], 1)
            w = np.zeros(2)
            for _ in range(iters):
                p = 1.0 / (1.0 + np.exp(-(x @ w)))
                grad = x.T @ (p - yy) + ridge * w
                hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(2)
                step = np.linalg.solve(hess, grad)
                w -= step
                if np.abs(step).max() < 1e-8:
                    break
            w[0] = max(w[0], min_slope)
            a[li, gi] = w[0] / sd
            b[li, gi] = w[1] - w[0] * mu / sd
    return a, b


def apply_platt(z: np.ndarray, layer: np.ndarray, group: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(a[layer, group] * z + b[layer, group])))


def fit_tau(records: Records, s: np.ndarray, target: float, norm_length: int) -> dict[str, Any]:
    """tau_i = (1 - target) quantile of the score at each length; polynomial of degree
    min(3, #lengths - 1) in x = ctx / norm_length through (mean x_i, tau_i), least squares."""
    xs, taus = [], []
    for i in range(len(records.lengths)):
        m = records.run == i
        xs.append(float(records.ctx[m].mean()) / norm_length)
        taus.append(float(np.quantile(s[m], 1.0 - target)))
    deg = min(3, len(xs) - 1)
    coeffs = np.polyfit(np.array(xs), np.array(taus), deg).tolist() if deg > 0 else [taus[0]]
    return {"coeffs": coeffs, "degree": deg, "x_range": [min(xs), max(xs)],
            "points": [{"length": n, "x": round(x, 6), "tau": t} for n, x, t in zip(records.lengths, xs, taus, strict=True)]}


def evaluate_fit(records: Records, s: np.ndarray, fit: TauFit, labels: np.ndarray) -> dict[str, Any]:
    """Realised skip ratio (and precision/recall of the skips) of tau(L) on the records' scores s."""
    tau = fit(torch.from_numpy(records.ctx)).double().numpy()
    skip = s >= tau
    out: dict[str, Any] = {"realised_skip": round(float(skip.mean()), 4), "per_length": {}}
    tp = float((skip & labels).sum())
    out["precision"] = round(tp / max(int(skip.sum()), 1), 4)
    out["recall"] = round(tp / max(int(labels.sum()), 1), 4)
    for i, n in enumerate(records.lengths):
        m = records.run == i
        out["per_length"][str(n)] = round(float(skip[m].mean()), 4)
    return out


def check_args(targets: list[float], lengths: list[int], regime: str, score: str, steps: int) -> None:
    """Reject bad calibration arguments before anything is loaded."""
    if regime not in ("all", "mean"):
        raise CotserveError("--regime must be 'all' or 'mean'")
    if score != "auto" and score not in SCORES:
        raise CotserveError(f"--score must be auto or one of {', '.join(SCORES)}")
    if not targets or any(not 0.0 < t < 1.0 for t in targets):
        raise CotserveError("--target-skip must be one or more ratios in (0, 1), e.g. 0.6 or 0.4,0.6")
    if not lengths or any(n < 2 for n in lengths):
        raise CotserveError("--lengths must be one or more prompt lengths >= 2, e.g. 1024,2048,4096")
    if steps < 1:
        raise CotserveError("--steps must be >= 1")


def calibrate(engine, lengths: list[int], steps: int, prompts: int, targets: list[float], gamma: float = 0.65,
              regime: str = "all", first_layers: int = 2, score: str = "auto", use_platt: bool = True,
              data_dir: str | None = None, log=None, random_tokens: bool = False,
              holdout: bool = True) -> tuple[dict[str, Any], Records]:
    """Run the probe, score the candidates, fit tau(L) for every target. Returns (report, records).
    `holdout`: also decode the same lengths on text after the fit's and report there the AUPRC of
    the raw score, the constant per-group base rate and the Platt-scaled score, each fitted on the
    fit's records only (`heldout_comparison`)."""
    check_args(targets, lengths, regime, score, steps)
    info = engine.info
    if not 0 <= first_layers < info.num_layers:
        raise CotserveError(f"--first-layers must be in [0, {info.num_layers - 1}]")
    lengths = sorted(set(lengths))
    records = collect(engine, lengths, steps, prompts, gamma, first_layers, data_dir, log, random_tokens)
    labels = records.labels(gamma, regime)
    auprc = {n: round(average_precision(records.score(n), labels), 4) for n in SCORE_NAMES}
    chosen = score if score != "auto" else max(SCORE_NAMES, key=lambda n: np.nan_to_num(auprc[n], nan=-1.0))
    norm = int(info.max_positions)
    raw = records.score(chosen)
    s = raw
    platt_out = None
    auprc_heldout: dict[str, float] = {}
    if use_platt:
        nl, ng = info.num_layers, info.num_kv_heads
        # held-out estimate: fit on the first half of the decode steps, score the second half
        first = records.step < max(1, steps // 2)
        if first.any() and (~first).any():
            a_h, b_h = fit_platt(raw[first], labels[first], records.layer[first], records.group[first], nl, ng)
            p_h = apply_platt(raw[~first], records.layer[~first], records.group[~first], a_h, b_h)
            auprc_heldout = {chosen: round(average_precision(raw[~first], labels[~first]), 4),
                             f"{chosen}+platt": round(average_precision(p_h, labels[~first]), 4)}
        a, b = fit_platt(raw, labels, records.layer, records.group, nl, ng)
        s = apply_platt(raw, records.layer, records.group, a, b)
        auprc[f"{chosen}+platt"] = round(average_precision(s, labels), 4)
        platt_out = {"a": a.round(6).tolist(), "b": b.round(6).tolist()}
    heldout_text: dict[str, Any] = {}
    if holdout:
        offset = max(lengths) * prompts + 16  # past every prompt the fit read
        test = collect(engine, lengths, steps, prompts, gamma, first_layers, data_dir, log, random_tokens, offset)
        heldout_text = {"text_offset_tokens": offset,
                        **heldout_comparison(records, test, chosen, gamma, regime, info.num_layers,
                                             info.num_kv_heads)}
    rate = group_base_rate(labels, records.layer, records.group, info.num_layers, info.num_kv_heads)
    auprc["group_base_rate"] = round(average_precision(rate[records.layer, records.group], labels), 4)
    fits: dict[str, Any] = {}
    for t in targets:
        f = fit_tau(records, s, t, norm)
        tf = TauFit(coeffs=f["coeffs"], norm_length=norm, x_lo=f["x_range"][0], x_hi=f["x_range"][1])
        f.update(evaluate_fit(records, s, tf, labels))
        fits[str(round(t, 4))] = f
    per_layer = {str(layer): round(float(labels[records.layer == layer].mean()), 4)
                 for layer in sorted(set(records.layer.tolist()))}
    report = {
        "method": "sinkrouter",
        "model": info.model_name,
        "num_layers": info.num_layers,
        "num_kv_heads": info.num_kv_heads,
        "num_heads": info.num_heads,
        "score": chosen,
        "score_formula": (f"{chosen}: {SCORES[chosen][1]} over the group's query heads of "
                          + ("q.k0 * scaling" if SCORES[chosen][0] == "logit" else "cos(q, k0)")
                          + (", then per-(layer, group) Platt scaling sigmoid(a*s+b)" if use_platt else "")),
        "auprc": auprc,
        "auprc_heldout": auprc_heldout,  # later decode steps of the same texts
        "auprc_heldout_text": heldout_text,  # other text: raw score vs per-group base rate vs Platt
        "per_layer": per_layer_signal(records, chosen, gamma, regime),
        "text": "random_tokens" if random_tokens else "text",
        "platt": platt_out,
        "gamma": gamma,
        "regime": regime,
        "first_layers": first_layers,
        "norm_length": norm,
        "lengths": lengths,
        "steps": steps,
        "prompts_per_length": prompts,
        "records": int(len(labels)),
        "sink_rate": round(float(labels.mean()), 4),
        "sink_rate_per_layer": per_layer,
        "default_target": round(targets[0], 4),
        "fits": fits,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }
    return report, records


def write_calibration(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")
