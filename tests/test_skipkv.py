"""skipkv / rkv on the bundled model: sentence spans through compactions, the memory bound, the
redundant sentence is the one dropped, padding never attended, thought counts, batch grouping."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.native import GenRequest, group_by_length
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.base import Axis, Policy, PolicyStack
from cotserve.policies.registry import build_policy
from cotserve.policies.thoughts import EXECUTION, classify_thought

REPEAT = "Wait, let me check again: the integral of x squared from zero to three is nine.\n"
# The small model's sentence embeddings (final-norm hidden means) are strongly anisotropic: on
# this text the repeated sentence's copies have cosine 0.93, every other pair <= 0.84 (measured),
# so tests use sentence_threshold 0.9 where the paper's 0.95 is meant for large reasoning models.
SENTENCES = [
    "Paris is the capital of France.\n",
    REPEAT,
    "Cats like to sleep in the sun all afternoon.\n",
    "The train leaves at seven in the morning.\n",
    REPEAT,
    "Blue whales are the largest animals.\n",
]
TAU = "0.9"
# the decode run goes on after the second copy, so that compactions follow its marking
FORCED_SENTENCES = SENTENCES + [
    "The sky was clear and the stars were bright tonight.\n",
    "We walked home slowly along the river bank.\n",
]


def sentence_ids(tok, sentences):
    ids, spans = [], []
    for s in sentences:
        piece = tok.encode(s)
        spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
    return ids, spans


def kept_positions(cache, layer, slot, head):
    n = int(cache.lens[layer, slot])
    return cache.pos[layer, slot, head, :n].tolist()


def test_redundant_sentence_is_the_one_dropped_at_prefill(engine):
    tok = engine.tokenizer
    ids, spans = sentence_ids(tok, SENTENCES)
    first = spans[1]
    budget = len(ids) - (first[1] - first[0])  # room for everything but one copy
    # the prompt's sentences are tracked only with prompt_sentences (ours; the paper: output only)
    off = build_policy("skipkv", {"budget": str(budget), "sentence_threshold": TAU, "window": "8"})
    engine.generate([GenRequest(ids, SamplingParams(max_tokens=1))], off)
    assert len(off.parts[0].sentences[0]) == 0
    stack = build_policy("skipkv", {"budget": str(budget), "sentence_threshold": TAU, "window": "8", "prompt_sentences": "true"})
    (res,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=1))], stack)
    pol = stack.parts[0]
    track = pol.sentences[0]
    assert list(zip(track.starts, track.ends, strict=True)) == spans
    assert [p > 0 for p in track.penalty] == [False, True, False, False, False, False]
    cache = pol.batch.cache
    want = [p for p in range(len(ids)) if not first[0] <= p < first[1]]
    for layer in range(engine.info.num_layers):
        for head in range(engine.info.num_kv_heads):
            assert kept_positions(cache, layer, 0, head) == want
    assert res.telemetry["sentences_dropped"] == 1 and res.telemetry["redundant_sentences_dropped"] == 1
    # rkv (the same token score without the sentence term) does not single the copy out
    stack = build_policy("rkv", {"budget": str(budget), "window": "8"})
    engine.generate([GenRequest(ids, SamplingParams(max_tokens=1))], stack)
    cache = stack.parts[0].batch.cache
    assert any(kept_positions(cache, layer, 0, h) != want
               for layer in range(engine.info.num_layers) for h in range(engine.info.num_kv_heads))


@pytest.fixture(scope="module")
def forced_run(engine):
    """Teacher-forced decode of SENTENCES after a short prompt: several decode-time compactions."""
    tok = engine.tokenizer
    prompt = tok.encode("Notes:\n")
    forced, spans = sentence_ids(tok, FORCED_SENTENCES)
    forced += tok.encode(" Done")  # fed after the last sentence's delimiter, so that one closes too
    budget, interval = 40, 8
    stack = build_policy("skipkv", {"budget": str(budget), "interval": str(interval), "sentence_threshold": TAU})
    req = GenRequest(prompt, SamplingParams(max_tokens=len(forced), ignore_eos=True), forced_ids=forced)
    (res,) = engine.generate([req], stack)
    return dict(prompt=prompt, forced=forced, spans=[(a + len(prompt), b + len(prompt)) for a, b in spans],
                policy=stack.parts[0], res=res, layer0_keys=layer0_keys(engine, prompt + forced), budget=budget,
                interval=interval)


def layer0_keys(engine, ids):
    """The first layer's keys depend only on (token, position): computed here directly from the
    model's own modules, [Hkv, T, D] with RoPE at positions 0..T-1."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = engine.model.model
    x = torch.tensor([ids])
    pos = torch.arange(len(ids)).unsqueeze(0)
    with torch.inference_mode():
        h = inner.embed_tokens(x)
        cos, sin = inner.rotary_emb(h, position_ids=pos)
        attn = inner.layers[0].self_attn
        k = attn.k_proj(inner.layers[0].input_layernorm(h))
        k = k.view(1, len(ids), engine.info.num_kv_heads, engine.info.head_dim).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k[0]


def test_spans_stay_aligned_through_compactions(engine, forced_run):
    r = forced_run
    tok = engine.tokenizer
    pol, res = r["policy"], r["res"]
    assert res.token_ids == r["forced"]
    assert res.telemetry["compactions"] >= 4
    tokens = r["prompt"] + r["forced"]
    track = pol.sentences[0]
    spans = r["spans"]  # output sentences only (the paper's segmentation, the default)
    assert list(zip(track.starts, track.ends, strict=True)) == spans
    assert [tok.decode(tokens[a:b]) for a, b in spans] == FORCED_SENTENCES
    cache = pol.batch.cache
    n_tokens = len(tokens) - 1  # the last forced token is sampled, never fed
    assert track.next_pos == n_tokens
    for layer in range(engine.info.num_layers):
        for head in range(engine.info.num_kv_heads):
            kept = kept_positions(cache, layer, 0, head)
            assert len(kept) == int(cache.lens[layer, 0]) <= r["budget"] + r["interval"]
            assert kept == sorted(set(kept)) and 0 <= kept[0] and kept[-1] == n_tokens - 1
            assert kept[-8:] == list(range(n_tokens - 8, n_tokens))  # the window is always kept
            sid = track.sentence_of(torch.tensor(kept)).tolist()
            for s, (a, b) in enumerate(spans):
                mine = [p for p, j in zip(kept, sid, strict=True) if j == s]
                assert all(a <= p < b for p in mine)
                # the kept tokens of the span, decoded, are pieces of the span's own text, in order
                text, rest = tok.decode(tokens[a:b]), 0
                for p in mine:
                    piece = tok.decode([tokens[p]])
                    at = text.find(piece, rest)
                    assert at >= 0, (layer, head, s, piece)
                    rest = at + len(piece)
            # each kept entry holds the key computed for that very position (layer 0: a function of
            # token and position only)
            if layer == 0:
                n = len(kept)
                torch.testing.assert_close(cache.k[0, 0, head, :n], r["layer0_keys"][head, kept],
                                           atol=1e-4, rtol=1e-4)


def test_memory_stays_below_budget_plus_interval(forced_run):
    r = forced_run
    pol, tele = r["policy"], r["res"].telemetry
    bound = r["budget"] + r["interval"]
    assert pol.batch.cache.capacity <= bound
    assert tele["kv_entries_peak"] <= bound
    per_entry = 2 * pol.batch.info.num_layers * pol.batch.info.num_kv_heads * pol.batch.info.head_dim * 4
    assert tele["kv_bytes_peak"] <= bound * per_entry
    assert tele["evicted_tokens"] == len(r["prompt"]) + len(r["forced"]) - 1 - int(pol.batch.cache.lens[0, 0])
    held = int(pol.batch.cache.lens[0, 0])
    assert tele["retained_ratio"] == round(held / (held + tele["evicted_tokens"]), 4) < 1.0


def test_retained_ratio_is_one_without_eviction(engine):
    """Nothing evicted (a budget above prompt + reply): every entry kept, ratio exactly 1."""
    ids = engine.encode_prompt("Name a colour.")
    (res,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=6))], "skipkv", {"budget": 4096})
    assert res.telemetry["evicted_tokens"] == 0 and res.telemetry["retained_ratio"] == 1.0


def test_redundant_copy_goes_first_during_decode(forced_run):
    r = forced_run
    track = r["policy"].sentences[0]
    first, second = 1, 4  # sentence indices of the two copies
    assert track.penalty[first] > 0.9 and track.penalty[second] == 0
    assert track.dropped[first] and not track.dropped[second]
    assert r["res"].telemetry["redundant_sentences_dropped"] >= 1


def test_skipkv_and_steering_count_the_same_thoughts_by_one_configurable_rule_list(engine, tmp_path):
    """One splitter (blank lines) and one rule list: in one run of skipkv+steering, SkipKV's
    non-execution count equals steering's, and both equal the count over the blank-line thoughts
    of the text; a rules file changes both alike."""
    from cotserve.policies.thoughts import split_thoughts

    tok = engine.tokenizer
    thoughts = ["Paris is the capital of France.", "Wait, let me check again: is it Paris?",
                "Cats like to sleep.\nThey sleep in the sun.", "Alternatively, ask a map.", "Done here."]
    text = "\n\n".join(thoughts) + "\n\n"
    forced = tok.encode(text) + tok.encode(" End")
    prompt = tok.encode("Notes:\n\n")
    closed = split_thoughts(text)
    assert len(closed) == 5

    def counts(extra):
        stack = build_policy("skipkv+steering", {"skipkv.budget": "512", **extra})
        req = GenRequest(prompt, SamplingParams(max_tokens=len(forced), ignore_eos=True), forced_ids=forced)
        (res,) = engine.generate([req], stack)
        return res.telemetry["non_execution_thoughts"], res.telemetry["steering_non_execution"]

    expected = sum(classify_thought(t) != EXECUTION for t in closed)
    assert expected == 2
    assert counts({}) == (expected, expected)
    rules = tmp_path / "rules.yaml"
    rules.write_text("reflection: ['\\bcats?\\b']\ntransition: []\n")
    assert counts({"thought_rules": str(rules)}) == (1, 1)


class _Poison(Policy):
    """After every forward (and compaction), fills every invalid cache entry with huge values:
    if any were ever attended, the output would change."""

    name = "test_poison"
    axis = Axis.STEER

    def after_forward(self, batch):
        cache = batch.cache
        idx = torch.arange(cache.capacity)
        for layer in range(cache.shape.layers):
            for slot in range(cache.shape.slots):
                bad = idx >= cache.lens[layer, slot]
                cache.k[layer, slot, :, bad] = 1e4
                cache.v[layer, slot, :, bad] = 1e4


def test_padding_and_evicted_entries_stay_masked(engine):
    tok = engine.tokenizer
    prompts = [tok.encode("Count: one, two, three, four, five, six, seven, eight.\n"), tok.encode("Hi\n")]
    forced = tok.encode(" nine, ten, eleven.\nWait, twelve.\nThirteen and fourteen.\n" * 2)[:36]
    opts = {"budget": "20", "interval": "6", "sentence_threshold": TAU}

    def run(extra):
        stack = build_policy("skipkv", opts)
        stack = PolicyStack(stack.parts + extra)
        reqs = [GenRequest(p, SamplingParams(max_tokens=len(forced), ignore_eos=True), forced_ids=forced,
                           record_logprobs=True) for p in prompts]
        return engine.generate(reqs, stack), stack

    plain, stack = run([])
    poisoned, _ = run([_Poison()])
    for a, b in zip(plain, poisoned, strict=True):
        assert a.telemetry["compactions"] >= 2  # the short prompt reaches the budget later
        assert torch.equal(a.logprobs, b.logprobs)
    cache = stack.parts[0].batch.cache
    for slot, p in enumerate(sorted(prompts, key=len)):  # generate() batches by prompt length
        total = len(p) + len(forced) - 1
        for layer in range(cache.shape.layers):
            n = int(cache.lens[layer, slot])
            pos = cache.pos[layer, slot]
            assert torch.all(pos[:, n:] == -1) and torch.all((pos[:, :n] >= 0) & (pos[:, :n] < total))


def test_grouping_by_length_lowers_padding(engine):
    tok = engine.tokenizer
    short = [tok.encode("Hi"), tok.encode("Yes")]
    long = [tok.encode("Tell me about the history of the Roman empire in great detail, please."),
            tok.encode("Describe the water cycle, with evaporation, condensation and precipitation.")]
    arrival = [GenRequest(p, SamplingParams(max_tokens=1)) for p in (short[0], long[0], short[1], long[1])]

    def padding(groups):
        fr = []
        for g in groups:
            for deltas in engine.stream(g):
                fr += [d.result.telemetry["padding_fraction"] for d in deltas if d.result]
        return sum(fr) / len(fr)

    in_order = padding([arrival[0:2], arrival[2:4]])
    grouped = padding(group_by_length(arrival, 2))
    assert grouped < in_order / 3
    engine.max_batch, saved = 2, engine.max_batch
    try:
        results = engine.generate(arrival)  # the engine groups by itself
    finally:
        engine.max_batch = saved
    assert sum(r.telemetry["padding_fraction"] for r in results) / len(results) == pytest.approx(grouped)
