"""`cotserve build-steering`: offline extraction of a SEAL steering vector.

SEAL (Chen et al. 2025, "SEAL: Steerable reasoning calibration of LLMs for free", Sec. 4.1), as
used by SkipKV's adaptive steering (arXiv 2512.07993, Sec. 4.2):

1. generate reasoning (the native engine; greedy by default, or sampled with `temperature` /
   `top_p` and a per-sample seed derived from `seed`, so a sample's text does not depend on
   which run produced it) for N training problems with a prompt that asks the model to reason
   step by step;
2. cut each generated trace into thoughts at blank-line ("\\n\\n"-type) boundaries
   (`thoughts.BlankLineTracker`) and classify each thought as reflection, transition or
   execution (`thoughts.classify_thought`, the rules are recorded in the manifest);
3. take the hidden state entering decoder layer L at the boundary token BEFORE each thought
   (captured during generation by an observer on the steer hook: the engine hands it exactly
   the hidden state entering each layer for the token being forwarded);
4. v = mean(reflection and transition) - mean(execution) (reflection and transition pooled,
   SEAL's H_RT). See `policies/steering.py` for the sign convention at decode time.

Output: `OUT/<model-slug>/layer_<L>.safetensors` (tensor `steering_vector` [hidden_size], with
model, layer, hidden_size and num_layers in its metadata)
and `OUT/<model-slug>/layer_<L>.json` (the manifest). The tensor is identical for identical inputs
(the file's metadata order is not fixed by safetensors, so compare tensors, not bytes).

Resumable: each finished sample is written to `OUT/<model-slug>/layer_<L>.partial/` (one small
safetensors file per sample: its boundary hidden states, their classes and the generated token
ids) together with the settings that produced it; a rerun with the same settings skips those
samples, so a run with a larger --samples reuses a smaller one's work. Samples are taken from a
seeded permutation of the data file (its first N), so a larger N extends the same selection.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cotserve
from cotserve.errors import CotserveError
from cotserve.jsonl import numbered_jsonl
from cotserve.policies.steering import ThoughtFollower, save_vector, vector_path
from cotserve.policies.thoughts import (  # noqa: F401 (load_rules: this module's public name too)
    DEFAULT_RULES,
    EXECUTION,
    REFLECTION,
    TRANSITION,
    ThoughtRules,
    blank_line_thoughts,
    load_rules,
)

DEFAULT_PROMPT = (
    "Solve the following math problem. Reason step by step, with a blank line between steps. After each "
    "step, check your work; if something looks wrong, say so and try another approach. Put your final "
    "answer within \\boxed{{}}.\n\n{problem}"
)
SIGN_CONVENTION = (
    "v = mean(reflection+transition) - mean(execution) at the hidden state entering layer L at the "
    "blank-line boundary token before each thought; the steering policy subtracts alpha_t * v "
    "(= SEAL's h + alpha * S with S = -v)"
)
_CLASS_IDS = {EXECUTION: 0, REFLECTION: 1, TRANSITION: 2}
_CLASS_NAMES = {v: k for k, v in _CLASS_IDS.items()}


@dataclass
class BuildConfig:
    model: str
    data: str
    layer: int
    samples: int
    out: str
    max_tokens: int = 384
    batch: int = 8
    seed: int = 0
    prompt: str = DEFAULT_PROMPT
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    device: str = "auto"
    dtype: str = "auto"
    rules: ThoughtRules = field(default_factory=lambda: DEFAULT_RULES)


class BoundaryRecorder(ThoughtFollower):
    """Observer on the steer hook: keeps the hidden state entering `layer` at every blank-line
    boundary token of each slot's generated tokens (it never changes the hidden state)."""

    name = "steering-recorder"

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.records: dict[Any, list[tuple[int, torch.Tensor]]] = {}  # request key -> (generated index, h)
        self.keys: list[Any] = []
        self.prompt_lens: list[int] = []

    def begin(self, batch) -> None:
        super().begin(batch)
        self.keys = [batch.extras.get(i, {}).get("sample", i) for i in range(batch.batch_size)]
        self.records.update({k: [] for k in self.keys})
        self.prompt_lens = [len(t) for t in batch.tokens]

    def steer(self, layer: int, hidden: torch.Tensor, batch) -> torch.Tensor:
        if layer == self.layer and batch.mode == "decode":
            for i in self.boundaries(batch):
                index = len(batch.tokens[i]) - self.prompt_lens[i] - 1
                self.records[self.keys[i]].append((index, hidden[i, -1].detach().float().cpu().clone()))
        return hidden


def sample_params(cfg: BuildConfig, index: int):
    """Decoding settings of one problem: greedy, or sampled with a seed of its own (derived from
    --seed and the problem's index in the data file)."""
    from cotserve.engine.sampling import SamplingParams

    if cfg.temperature == 0.0:
        return SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)
    return SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          seed=cfg.seed * 1_000_003 + index)


def decoding_label(cfg: BuildConfig) -> str:
    if cfg.temperature == 0.0:
        return "greedy"
    return f"sampled (temperature {cfg.temperature}, top_p {cfg.top_p}, seed {cfg.seed} * 1000003 + problem index)"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_problems(path: Path) -> list[str]:
    if not path.is_file():
        raise CotserveError(f"data file {path} does not exist")
    problems = []
    for n, row in numbered_jsonl(path):
        if not isinstance(row.get("problem"), str):
            raise CotserveError(f"{path}:{n}: each line needs a string field 'problem'")
        problems.append(row["problem"])
    if not problems:
        raise CotserveError(f"data file {path} holds no problems")
    return problems


def select(n_total: int, samples: int, seed: int) -> list[int]:
    """The first `samples` indices of a seeded permutation (a larger N extends a smaller one)."""
    order = list(range(n_total))
    random.Random(seed).shuffle(order)
    return order[:samples]


def _settings(cfg: BuildConfig, data_sha: str, model_path: str) -> dict[str, Any]:
    """Everything a sample's record depends on; a partial folder is reused only when equal."""
    return {"model": cfg.model, "model_path": Path(model_path).name, "layer": cfg.layer,
            "max_tokens": cfg.max_tokens, "batch": cfg.batch, "seed": cfg.seed, "prompt": cfg.prompt,
            "temperature": cfg.temperature, "top_p": cfg.top_p,
            "data_sha256": data_sha, "rules": cfg.rules.as_dict(), "device": cfg.device, "dtype": cfg.dtype}


def _save_sample(folder: Path, index: int, hidden: torch.Tensor, classes: list[str], token_ids: list[int],
                 finish: str) -> None:
    from safetensors.torch import save_file

    tensors = {"hidden": hidden.contiguous(), "classes": torch.tensor([_CLASS_IDS[c] for c in classes], dtype=torch.long),
               "token_ids": torch.tensor(token_ids, dtype=torch.long)}
    tmp = folder / f".sample_{index}.tmp"
    save_file(tensors, str(tmp), metadata={"finish": finish})
    os.replace(tmp, folder / f"sample_{index}.safetensors")


def _load_sample(path: Path) -> tuple[torch.Tensor, list[str]]:
    from safetensors.torch import load_file

    t = load_file(str(path))
    return t["hidden"], [_CLASS_NAMES[int(c)] for c in t["classes"]]


def build_steering(cfg: BuildConfig, command: str = "", progress: bool = True, loaded=None) -> dict[str, Any]:
    """Run the whole build; returns the manifest. Raises CotserveError for anything a user can fix.

    `loaded`: an already loaded model (`models.load_model`) to use instead of loading cfg.model."""
    from tqdm import tqdm

    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.models import load_model, model_slug
    from cotserve.policies.base import PolicyStack

    if cfg.samples < 1:
        raise CotserveError(f"--samples must be at least 1, got {cfg.samples}")
    if cfg.max_tokens < 1:
        raise CotserveError(f"--max-tokens must be at least 1, got {cfg.max_tokens}")
    if cfg.batch < 1:
        raise CotserveError(f"--batch must be at least 1, got {cfg.batch}")
    if cfg.temperature < 0:
        raise CotserveError(f"--temperature must be >= 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise CotserveError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if "{problem}" not in cfg.prompt:
        raise CotserveError("--prompt must contain {problem}")
    data = Path(cfg.data).expanduser()
    problems = read_problems(data)
    if cfg.samples > len(problems):
        raise CotserveError(f"--samples {cfg.samples} is more than the {len(problems)} problems in {data}")
    data_sha = sha256_file(data)
    chosen = select(len(problems), cfg.samples, cfg.seed)

    if loaded is None:
        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    engine = NativeEngine(loaded, max_batch=cfg.batch)
    info = engine.info
    if not 0 <= cfg.layer < info.num_layers:
        raise CotserveError(f"--layer {cfg.layer} is out of range: the model has {info.num_layers} layers (0..{info.num_layers - 1})")
    slug = model_slug(cfg.model)
    target = vector_path(cfg.out, slug, cfg.layer)
    partial = target.with_suffix(".partial")
    partial.mkdir(parents=True, exist_ok=True)
    settings = _settings(cfg, data_sha, str(loaded.path))
    settings_file = partial / "settings.json"
    if settings_file.is_file():
        old = json.loads(settings_file.read_text())
        if old != settings:
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            raise CotserveError(
                f"{partial} holds samples built with other settings ({', '.join(diff)}); "
                "remove that folder or choose another --out"
            )
    else:
        settings_file.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")

    todo = [i for i in chosen if not (partial / f"sample_{i}.safetensors").is_file()]
    bar = tqdm(total=len(chosen), initial=len(chosen) - len(todo), desc=f"build-steering layer {cfg.layer}",
               unit="sample", disable=not progress, mininterval=2.0)
    delims = None
    seen = {EXECUTION: 0, REFLECTION: 0, TRANSITION: 0}  # classes of the samples generated in this run
    for start in range(0, len(todo), cfg.batch):
        group = todo[start : start + cfg.batch]
        reqs = [GenRequest(engine.encode_prompt(cfg.prompt.format(problem=problems[i])), sample_params(cfg, i),
                           extras={"sample": i})
                for i in group]
        recorder = BoundaryRecorder(cfg.layer)
        results = engine.generate(reqs, PolicyStack([recorder]))
        if delims is None:
            from cotserve.policies.boundaries import thought_delimiter_ids

            delims = thought_delimiter_ids(engine.tokenizer)
        for i, res in zip(group, results, strict=True):
            rec = dict(recorder.records[i])
            pairs = blank_line_thoughts(res.token_ids, engine.tokenizer, delims, cfg.rules)
            missing = [b for b, _ in pairs if b not in rec]
            if missing:  # cannot happen unless the engine's hook contract changes
                raise CotserveError(f"internal: no hidden state recorded at boundaries {missing[:5]} of sample {i}")
            hidden = (torch.stack([rec[b] for b, _ in pairs]) if pairs
                      else torch.zeros(0, info.hidden_size, dtype=torch.float32))
            _save_sample(partial, i, hidden, [c for _, c in pairs], res.token_ids, res.finish_reason)
            for _, c in pairs:
                seen[c] += 1
            bar.update(1)
        bar.set_postfix(seen, refresh=True)
    bar.close()

    per_class: dict[str, list[torch.Tensor]] = {EXECUTION: [], REFLECTION: [], TRANSITION: []}
    for i in chosen:
        hidden, classes = _load_sample(partial / f"sample_{i}.safetensors")
        for h, c in zip(hidden, classes, strict=True):
            per_class[c].append(h)
    counts = {c: len(v) for c, v in per_class.items()}
    non_exec = per_class[REFLECTION] + per_class[TRANSITION]
    if not non_exec or not per_class[EXECUTION]:
        empty = "reflection/transition" if not non_exec else "execution"
        raise CotserveError(
            f"no {empty} thoughts in {cfg.samples} samples (counts: {counts}); "
            "use more --samples or --max-tokens, or another --prompt"
        )
    mean_rt = torch.stack(non_exec).double().mean(0)
    mean_e = torch.stack(per_class[EXECUTION]).double().mean(0)
    vector = (mean_rt - mean_e).float().contiguous()
    save_vector(target, vector, cfg.layer, info.hidden_size, info.num_layers, model=cfg.model, model_slug=slug,
                samples=str(cfg.samples), sign="rt_minus_execution")

    manifest = {
        "model": cfg.model,
        "model_slug": slug,
        "layer": cfg.layer,
        "hidden_size": info.hidden_size,
        "num_layers": info.num_layers,
        "vector_file": target.name,
        "vector_norm": round(float(vector.norm()), 6),
        "vector_sha256": hashlib.sha256(vector.numpy().tobytes()).hexdigest(),  # of the float32 data
        "sign_convention": SIGN_CONVENTION,
        "counts": {**counts, "non_execution": len(non_exec)},
        "samples": cfg.samples,
        "sample_indices": chosen,
        "seed": cfg.seed,
        "max_tokens": cfg.max_tokens,
        "batch": cfg.batch,
        "decoding": decoding_label(cfg),
        "prompt": cfg.prompt,
        "data_file": data.name,
        "data_sha256": data_sha,
        "segmentation": "blank-line boundaries on token ids (cotserve.policies.thoughts.BlankLineTracker)",
        "rules": cfg.rules.as_dict(),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "cotserve_version": cotserve.__version__,
        "torch_version": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
    }
    target.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
