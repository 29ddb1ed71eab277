"""`cotserve build-steering`: deterministic extraction, resumability, manifest, clear errors.

Kept small: 2 MATH training problems (the first two of the seed-0 permutation), 40 greedy tokens,
batch 1. In 40 tokens this model writes no reflection thought, so these tests classify with their
own rule (a thought saying "will" counts as reflection): with it, the first problem's only thought
after a blank line is reflection and the second one's is execution. The rule is a test device; the
classification rules themselves are tested on hand-written thoughts in test_steering.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cotserve.build_steering import BuildConfig, build_steering, load_rules, select
from cotserve.errors import CotserveError
from cotserve.policies.steering import VECTOR_KEY, load_vector
from cotserve.policies.thoughts import ThoughtRules

RULES = ThoughtRules(reflection=(r"\bwill\b",), transition=())
MODEL = "smollm2-135m-instruct"


def cfg(data_dir, out, samples=2, rules=RULES) -> BuildConfig:
    return BuildConfig(model=MODEL, data=str(data_dir / "math_train.jsonl"), layer=7, samples=samples,
                       out=str(out), max_tokens=40, batch=1, seed=0, device="cpu", dtype="float32", rules=rules)


@pytest.fixture(scope="module")
def first_build(loaded, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("build_a")
    manifest = build_steering(cfg(data_dir, out), command="test", progress=False, loaded=loaded)
    return out, manifest


def test_build_writes_vector_and_manifest(first_build, loaded, data_dir):
    out, manifest = first_build
    path = out / MODEL / "layer_7.safetensors"
    sv = load_vector(path)
    assert sv.vector.shape == (loaded.config.hidden_size,) and sv.layer == 7
    assert sv.meta["num_layers"] == str(loaded.config.num_hidden_layers)
    on_disk = json.loads((out / MODEL / "layer_7.json").read_text())
    assert on_disk == manifest
    assert manifest["counts"] == {"execution": 1, "reflection": 1, "transition": 0, "non_execution": 1}
    assert manifest["rules"] == {"reflection": [r"\bwill\b"], "transition": []}
    assert manifest["sample_indices"] == select(sum(1 for _ in open(data_dir / "math_train.jsonl")), 2, 0)
    import hashlib

    assert manifest["data_sha256"] == hashlib.sha256((data_dir / "math_train.jsonl").read_bytes()).hexdigest()
    for key in ("model", "layer", "cotserve_version", "date", "command", "prompt", "sign_convention"):
        assert manifest[key]


def test_vector_is_the_class_mean_difference(first_build):
    """v = mean(reflection+transition) - mean(execution), from the per-sample records."""
    out, _ = first_build
    part = out / MODEL / "layer_7.partial"
    rows = {0: [], 1: [], 2: []}
    for f in sorted(part.glob("sample_*.safetensors")):
        t = load_file(str(f))
        for h, c in zip(t["hidden"], t["classes"], strict=True):
            rows[int(c)].append(h)
    expect = (torch.stack(rows[1] + rows[2]).double().mean(0) - torch.stack(rows[0]).double().mean(0)).float()
    got = load_file(str(out / MODEL / "layer_7.safetensors"))[VECTOR_KEY]
    assert torch.equal(got, expect)


def test_hidden_states_are_those_entering_layer_L(first_build, loaded, reference_model, data_dir):
    """A plain forward of prompt + generated tokens (transformers, SDPA) gives the same hidden
    state entering layer L at each recorded boundary, up to float rounding."""
    from cotserve.build_steering import DEFAULT_PROMPT, read_problems
    from cotserve.engine.native import NativeEngine
    from cotserve.policies.boundaries import thought_delimiter_ids
    from cotserve.policies.thoughts import blank_line_thoughts

    out, manifest = first_build
    ref = reference_model
    engine = NativeEngine(loaded)
    problems = read_problems(data_dir / "math_train.jsonl")
    for i in manifest["sample_indices"]:
        t = load_file(str(out / MODEL / "layer_7.partial" / f"sample_{i}.safetensors"))
        prompt = engine.encode_prompt(DEFAULT_PROMPT.format(problem=problems[i]))
        gen = t["token_ids"].tolist()
        pairs = blank_line_thoughts(gen, loaded.tokenizer, thought_delimiter_ids(loaded.tokenizer), RULES)
        with torch.inference_mode():
            hs = ref(torch.tensor([prompt + gen]), output_hidden_states=True).hidden_states[7][0]
        want = torch.stack([hs[len(prompt) + b] for b, _ in pairs])
        torch.testing.assert_close(t["hidden"], want, atol=2e-4, rtol=1e-4)


def test_build_is_deterministic(first_build, loaded, data_dir, tmp_path):
    out_a, _ = first_build
    build_steering(cfg(data_dir, tmp_path), progress=False, loaded=loaded)
    a, b = load_vector(out_a / MODEL / "layer_7.safetensors"), load_vector(tmp_path / MODEL / "layer_7.safetensors")
    assert torch.equal(a.vector, b.vector) and a.meta == b.meta
    for f in (out_a / MODEL / "layer_7.partial").glob("sample_*.safetensors"):
        ta, tb = load_file(str(f)), load_file(str(tmp_path / MODEL / "layer_7.partial" / f.name))
        assert all(torch.equal(ta[k], tb[k]) for k in ("hidden", "classes", "token_ids"))


def test_resume_reuses_finished_samples(first_build, loaded, data_dir, tmp_path):
    # a run over the first sample only: its one thought is reflection, so the build stops with a
    # clear error, but the sample's work is kept
    with pytest.raises(CotserveError, match="no execution thoughts in 1 samples"):
        build_steering(cfg(data_dir, tmp_path, samples=1), progress=False, loaded=loaded)
    part = tmp_path / MODEL / "layer_7.partial"
    (kept,) = list(part.glob("sample_*.safetensors"))
    stamp = kept.stat().st_mtime_ns
    build_steering(cfg(data_dir, tmp_path, samples=2), progress=False, loaded=loaded)
    assert kept.stat().st_mtime_ns == stamp  # not generated again
    assert len(list(part.glob("sample_*.safetensors"))) == 2
    out_a, _ = first_build
    assert torch.equal(load_vector(tmp_path / MODEL / "layer_7.safetensors").vector,
                       load_vector(out_a / MODEL / "layer_7.safetensors").vector)
    # other settings must not mix with the kept samples
    other = cfg(data_dir, tmp_path)
    other.max_tokens = 41
    with pytest.raises(CotserveError, match="other settings \\(max_tokens\\)"):
        build_steering(other, progress=False, loaded=loaded)


@pytest.mark.slow
def test_sampled_build_is_seeded_and_recorded(first_build, loaded, data_dir, tmp_path):
    """--temperature > 0: each problem is sampled with a seed of its own, so the same settings
    give the same traces; sampling is on (not the greedy traces); the settings and manifest say how."""

    def sampled(out, seed):
        c = cfg(data_dir, out)
        c.temperature, c.top_p, c.seed = 0.9, 0.95, seed
        c.rules = ThoughtRules(reflection=(r"\b(?:will|is)\b",), transition=())
        try:
            build_steering(c, progress=False, loaded=loaded)
        except CotserveError as exc:  # a class may be empty in 40 sampled tokens: samples are kept
            assert "thoughts in 2 samples" in str(exc)
        part = out / MODEL / "layer_7.partial"
        return {f.name: load_file(str(f))["token_ids"].tolist() for f in sorted(part.glob("sample_*.safetensors"))}

    a, b = sampled(tmp_path / "a", 0), sampled(tmp_path / "b", 0)
    assert a == b and len(a) == 2
    greedy = {f.name: load_file(str(f))["token_ids"].tolist()
              for f in (first_build[0] / MODEL / "layer_7.partial").glob("sample_*.safetensors")}
    assert a != greedy  # sampling is on
    settings = json.loads((tmp_path / "a" / MODEL / "layer_7.partial" / "settings.json").read_text())
    assert settings["temperature"] == 0.9 and settings["top_p"] == 0.95
    manifest_file = tmp_path / "a" / MODEL / "layer_7.json"
    if manifest_file.exists():
        assert json.loads(manifest_file.read_text())["decoding"].startswith("sampled (temperature 0.9")
    c = cfg(data_dir, tmp_path / "c")
    c.temperature = -1.0
    with pytest.raises(CotserveError, match="--temperature must be >= 0"):
        build_steering(c, progress=False, loaded=loaded)


def test_bad_inputs(loaded, data_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    c = cfg(data_dir, tmp_path)
    c.data = str(bad)
    with pytest.raises(CotserveError, match="needs a string field 'problem'"):
        build_steering(c, progress=False, loaded=loaded)
    c = cfg(data_dir, tmp_path)
    c.layer = 30
    with pytest.raises(CotserveError, match="--layer 30 is out of range"):
        build_steering(c, progress=False, loaded=loaded)
    (tmp_path / "r.yaml").write_text("reflection: ['(']\n")
    with pytest.raises(CotserveError, match="bad regular expression"):
        load_rules(str(tmp_path / "r.yaml"))


@pytest.mark.slow
def test_cli_empty_class_is_one_line_exit_2(data_dir, tmp_path):
    """With the built-in rules, 40 tokens of one problem hold no reflection/transition thought."""
    proc = subprocess.run(
        [sys.executable, "-m", "cotserve.cli", "build-steering", "--data", str(data_dir / "math_train.jsonl"),
         "--layer", "7", "--samples", "1", "--max-tokens", "40", "--batch", "1", "--out", str(tmp_path),
         "--no-progress", "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no reflection/transition thoughts in 1 samples" in lines[0]
    assert "Traceback" not in proc.stderr
