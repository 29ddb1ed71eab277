"""Steering policy (SkipKV Sec. 4.2 adaptive steering with a SEAL vector): boundaries, exactness of
the intervention at layer L, alpha 0 == no steering, per-request control, refusals."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.registry import build_policy
from cotserve.policies.steering import (
    SteeringConfig,
    load_vector,
    request_knobs,
    resolve_vector,
    save_vector,
)
from cotserve.policies.thoughts import (
    EXECUTION,
    REFLECTION,
    TRANSITION,
    BlankLineTracker,
    blank_line_thoughts,
    classify_thought,
    split_thoughts,
)

LAYER = 5
TRACE = (
    "First, 3 * 4 = 12.\n\nWait, let me check: 3 * 4 = 12.\nYes.\n\n\nAlternatively, add 4 three times: "
    "4 + 4 + 4 = 12.\n\nSo the answer is 12.\n\nThe final answer is $\\boxed{12}$.\n\nDone."
)  # ends after its last blank line: the last token is sampled, never forwarded, so none is steered


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded.tokenizer


@pytest.fixture(scope="module")
def random_vector(engine, tmp_path_factory):
    g = torch.Generator().manual_seed(1234)
    v = torch.randn(engine.info.hidden_size, generator=g)
    path = tmp_path_factory.mktemp("vec") / "layer_5.safetensors"
    save_vector(path, v, LAYER, engine.info.hidden_size, engine.info.num_layers, model="test")
    return path, v


# --- segmentation on token ids ------------------------------------------------------------


def reference_boundaries(ids: list[int], tok) -> list[tuple[int, int]]:
    """Plain reference: token k is a boundary when the whitespace run the decoded text ends with
    first holds two newlines at k; N_o = non-execution thoughts among the finished ones."""
    out = []
    prev = 0
    for k in range(len(ids)):
        text = tok.decode(ids[: k + 1])
        tail = text[len(text.rstrip()):]
        n = tail.count("\n")
        if prev < 2 <= n:
            n_o = sum(classify_thought(t) != EXECUTION for t in split_thoughts(text))
            out.append((k, n_o))
        prev = n
    return out


def test_blank_line_boundaries_match_reference(tok):
    ids = tok.encode(TRACE)
    tracker = BlankLineTracker(tok, thought_delimiter_ids(tok))
    got = []
    for k, t in enumerate(ids):
        tracker.push(t)
        if tracker.at_boundary:
            got.append((k, tracker.non_execution))
    assert got == reference_boundaries(ids, tok)
    assert len(got) == 5  # one per blank line, whatever its spelling ("\n","\n" / "\n\n","\n")
    assert tracker.counts == {REFLECTION: 1, TRANSITION: 1, EXECUTION: 3}


@pytest.mark.parametrize("pieces", [["a", "\n", "\n", "b"], ["a", "\n\n", "b"], ["a", "\n", "\n\n", "b"],
                                    ["a", "\n\n\n", "b"]])
def test_one_boundary_per_blank_line_whatever_the_spelling(tok, pieces):
    ids = []
    for p in pieces:
        enc = tok.encode(p, add_special_tokens=False)
        assert len(enc) == 1
        ids += enc
    pairs = blank_line_thoughts(ids, tok, thought_delimiter_ids(tok))
    assert pairs == [(2 if pieces[1] == "\n" else 1, EXECUTION)]


def test_single_newlines_do_not_split(tok):
    ids = tok.encode("Wait, x.\nAlternatively y.\nz\n\nNow compute.")
    pairs = blank_line_thoughts(ids, tok, thought_delimiter_ids(tok))
    assert [c for _, c in pairs] == [EXECUTION]  # the thought after the only blank line
    tracker = BlankLineTracker(tok, thought_delimiter_ids(tok))
    for t in ids:
        tracker.push(t)
    assert tracker.counts[REFLECTION] == 1 and tracker.counts[TRANSITION] == 0


@pytest.mark.parametrize("text,cls", [
    ("Let me check the sum again: 4 + 4 = 8.", REFLECTION),
    ("Hold on, the sign is wrong.", REFLECTION),
    ("We can double-check by substitution.", REFLECTION),
    ("Instead, let's try a different approach: induction.", TRANSITION),
    ("Another way is to draw the triangle.", TRANSITION),
    ("Multiply both sides by 2 to get x = 6.", EXECUTION),
    ("The area is 12 square units.", EXECUTION),
])
def test_thought_classes_for_build(text, cls):
    assert classify_thought(text) == cls


# --- per-request knobs ----------------------------------------------------------------------


def test_request_knobs():
    cfg = SteeringConfig(alpha0=1.0, gamma=0.02)
    assert request_knobs(cfg, {}).alpha0 == 1.0
    k = request_knobs(cfg, {"steering": {"alpha0": "0.5", "gamma": 0}})
    assert (k.enabled, k.alpha0, k.gamma) == (True, 0.5, 0.0)
    assert request_knobs(cfg, {"steering": False}).enabled is False
    k = request_knobs(cfg, {"options": {"steering.gamma": "0.1", "enabled": "off", "sfi.k": 3}})
    assert (k.enabled, k.gamma) == (False, 0.1)
    with pytest.raises(PolicyError, match="unknown"):
        request_knobs(cfg, {"steering": {"alpha": 1}})
    with pytest.raises(PolicyError, match="alpha0='x'"):
        request_knobs(cfg, {"steering": {"alpha0": "x"}})


def test_config_validation():
    with pytest.raises(PolicyError, match="does not exist"):
        build_policy("steering", {"vector": "/nonexistent/v.safetensors"})
    with pytest.raises(PolicyError, match="layer"):
        build_policy("steering", {"layer": -3})
    with pytest.raises(PolicyError, match="both decide the steer axis"):
        build_policy("steering+steering")
    stack = build_policy("dense+steering", {"steering.alpha0": "0.25"})
    assert [p.name for p in stack.parts] == ["steering"] and stack.parts[0].config.alpha0 == 0.25


# --- refusals ---------------------------------------------------------------------------------


def test_wrong_size_vector_is_refused(engine, tmp_path):
    path = save_vector(tmp_path / "v.safetensors", torch.ones(100), 3, 100, engine.info.num_layers)
    req = GenRequest(engine.encode_prompt("Hi"), SamplingParams(max_tokens=2))
    with pytest.raises(PolicyError, match=r"has size 100, but model .* has hidden size 576.*cotserve build-steering"):
        engine.generate([req], "steering", {"vector": str(path)})


def test_layer_out_of_range_and_wrong_depth_refused(engine, random_vector, tmp_path):
    path, v = random_vector
    req = GenRequest(engine.encode_prompt("Hi"), SamplingParams(max_tokens=2))
    with pytest.raises(PolicyError, match="out of range"):
        engine.generate([req], "steering", {"vector": str(path), "layer": 99})
    deep = save_vector(tmp_path / "d.safetensors", v, 3, engine.info.hidden_size, 64)
    with pytest.raises(PolicyError, match="built for a model with 64 layers"):
        engine.generate([req], "steering", {"vector": str(deep)})


def test_missing_shipped_vector_names_the_build_command():
    with pytest.raises(PolicyError, match="no steering vector shipped for model 'no-such-model'.*cotserve build-steering"):
        resolve_vector(SteeringConfig(), "no-such-model")


def test_not_a_vector_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"other": torch.zeros(3)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(PolicyError, match="not a cotserve steering vector"):
        load_vector(tmp_path / "x.safetensors")


# --- the intervention ---------------------------------------------------------------------------


class LayerTap:
    """Records, at decode steps, the output of layer L-1 (= the hidden state handed to the steer
    hook for layer L) and the input layer L actually receives."""

    def __init__(self, engine, layer: int):
        layers = engine.model.model.layers
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

        def out_hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            if h.shape[1] == 1:
                self.before.append(h.detach().clone())

        def pre_hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if h.shape[1] == 1:
                self.after.append(h.detach().clone())

        self.handles = [layers[layer - 1].register_forward_hook(out_hook),
                        layers[layer].register_forward_pre_hook(pre_hook, with_kwargs=True)]

    def close(self):
        for h in self.handles:
            h.remove()


def forced(engine, ids, **extras):
    return GenRequest(engine.encode_prompt("Compute 3 * 4."), SamplingParams(max_tokens=len(ids)),
                      forced_ids=ids, extras=extras)


def test_steering_adds_exactly_alpha_v_at_boundaries_only(engine, tok, random_vector):
    path, v = random_vector
    ids = tok.encode(TRACE)
    alpha0, gamma = 0.7, 0.5
    expected = {k: alpha0 + gamma * n_o for k, n_o in reference_boundaries(ids, tok)}
    assert len(expected) == 5 and len(set(expected.values())) == 3  # N_o really changes alpha

    tap = LayerTap(engine, LAYER)
    try:
        # slot 0 steered, slot 1 the same sequence with steering switched off for that request
        res = engine.generate([forced(engine, ids), forced(engine, ids, steering=False)], "steering",
                              {"vector": str(path), "alpha0": alpha0, "gamma": gamma})
    finally:
        tap.close()
    assert res[0].token_ids == ids and res[1].token_ids == ids
    steps = len(ids) - 1  # the last token is sampled but never forwarded
    assert len(tap.before) == len(tap.after) == steps
    changed = []
    for k in range(steps):
        pre, post = tap.before[k], tap.after[k]
        assert torch.equal(post[1], pre[1])  # the request that switched steering off
        if k in expected:
            assert torch.equal(post[0, 0], pre[0, 0] - torch.tensor(expected[k]) * v)
            changed.append(k)
        else:
            assert torch.equal(post[0], pre[0])
    assert changed == sorted(expected) and all(k < steps for k in expected)
    t = res[0].telemetry
    assert t["steering_applications"] == 5
    assert t["steering_alpha_mean"] == pytest.approx(sum(expected.values()) / 5, abs=1e-6)
    assert t["steering_non_execution"] == 2
    assert res[1].telemetry["steering_applications"] == 0
    assert res[1].telemetry["steering_non_execution"] == 2  # still counted while off


@pytest.mark.slow
def test_alpha_zero_gives_the_same_tokens_as_no_steering(engine, random_vector):
    path, _ = random_vector
    ids = engine.encode_prompt("Solve step by step, with a blank line between steps: a shirt costs $12 and "
                               "pants cost $20. What do 2 shirts and 1 pair of pants cost?")
    (dense,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=48))])
    (zero,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=48))], "steering",
                              {"vector": str(path), "alpha0": 0, "gamma": 0})
    assert zero.telemetry["steering_applications"] > 0  # steering did run at boundaries
    assert zero.token_ids == dense.token_ids
    (strong,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=48))], "steering",
                                {"vector": str(path), "alpha0": 40, "gamma": 0})
    first = reference_boundaries(dense.token_ids, engine.tokenizer)[0][0]
    assert strong.token_ids[: first + 1] == dense.token_ids[: first + 1]  # nothing changes before it
    assert strong.token_ids != dense.token_ids  # a strong push does change the text after it


def test_shipped_vector_for_the_bundled_model(engine):
    """A shipped vector must fit the bundled model; without one, the default stack refuses with a
    message naming the build command."""
    import json

    from cotserve.policies.steering import check_vector, shipped_dir

    folder = shipped_dir() / "smollm2-135m-instruct"
    req = GenRequest(engine.encode_prompt("Hi"), SamplingParams(max_tokens=2))
    if not list(folder.glob("layer_*.safetensors")):
        with pytest.raises(PolicyError, match="no steering vector shipped for model 'smollm2-135m-instruct'.*cotserve build-steering"):
            engine.generate([req], "steering")
        (res,) = engine.generate([req], "steering", {"enabled": False})  # off needs no vector
        assert res.telemetry["steering_applications"] == 0
        return
    sv = resolve_vector(SteeringConfig(), engine.info.model_name)
    check_vector(sv, sv.layer, engine.info.hidden_size, engine.info.num_layers, engine.info.model_name)
    manifest = json.loads(sv.path.with_suffix(".json").read_text())
    assert manifest["layer"] == sv.layer and manifest["counts"]["non_execution"] > 0
    assert manifest["vector_sha256"] == __import__("hashlib").sha256(sv.vector.numpy().tobytes()).hexdigest()
    (res,) = engine.generate([req], "steering")
    assert "steering_alpha_mean" in res.telemetry


def test_steering_composes_with_sfi_and_skipkv_in_one_request(engine, tok, random_vector):
    """`skipkv+sfi+steering`: all three parts act in one request (teacher-forced on a trace with
    blank lines; small budgets so SkipKV evicts and SFI selects), and with alpha 0 the stack makes
    the same predictions as `skipkv+sfi`."""
    path, _ = random_vector
    ids = tok.encode(TRACE)
    opts = {"skipkv.budget": 32, "skipkv.interval": 4, "sfi.k": 8, "sfi.recent": 8, "steering.vector": str(path)}
    plain = {k: v for k, v in opts.items() if not k.startswith("steering")}
    (base,) = engine.generate([forced(engine, ids)], "skipkv+sfi", plain)
    (zero,) = engine.generate([forced(engine, ids)], "skipkv+sfi+steering", {**opts, "steering.alpha0": 0,
                                                                            "steering.gamma": 0})
    (strong,) = engine.generate([forced(engine, ids)], "skipkv+sfi+steering", {**opts, "steering.alpha0": 40})
    t = strong.telemetry
    assert t["policy"] == "skipkv+sfi+steering"
    assert t["evicted_tokens"] > 0 and t["sfi_steps"] > 0 and t["sfi_retained_ratio"] < 1.0
    assert t["steering_applications"] == 5 and t["steering_non_execution"] == 2
    assert zero.telemetry["steering_applications"] == 5
    assert zero.greedy_ids == base.greedy_ids
    assert strong.greedy_ids != base.greedy_ids
