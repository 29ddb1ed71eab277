"""The lean decoder stack (engine/decoder.py) against transformers' own modules (the reference
path, `NativeEngine.forward_reference`): the bundled model in float32 and bf16w, and small
random-weight Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm) models for the branches SmolLM2 lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cotserve.engine.decoder import LeanDecoder
from cotserve.engine.native import GenRequest, NativeEngine
from cotserve.engine.sampling import SamplingParams
from cotserve.kv.batch import BatchState
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.models import LoadedModel, load_model
from cotserve.policies.base import PolicyStack


def _batch(engine: NativeEngine, prompt_lens: list[int], capacity: int) -> BatchState:
    info = engine.info
    cache = KVCache(CacheShape(info.num_layers, len(prompt_lens), info.num_kv_heads, capacity, info.head_dim),
                    engine.dtype, engine.device)
    return BatchState(info=info, cache=cache, policy=PolicyStack(), scaling=engine.scaling,
                      prompt_lens=torch.tensor(prompt_lens), tokens=[[] for _ in prompt_lens])


def _run(engine: NativeEngine, forward, head, ids: torch.Tensor, lens: list[int], steps: list[torch.Tensor]
         ) -> list[torch.Tensor]:
    """Prefill ids [B, T] (right-padded to lens), then one decode step per entry of `steps`
    ([B] ids); returns the logits (by `head`) of every forward's last real token."""
    b, t = ids.shape
    batch = _batch(engine, lens, t + len(steps) + 1)
    batch.mode = "prefill"
    hidden = forward(ids, torch.arange(t).expand(b, -1), batch)
    out = [head(hidden[torch.arange(b), torch.tensor(lens) - 1])]
    batch.mode = "decode"
    for i, tok in enumerate(steps):
        pos = torch.tensor(lens) + i
        batch.positions = pos
        out.append(head(forward(tok.view(-1, 1), pos.view(-1, 1), batch)[:, -1]))
    return out


def _compare(engine: NativeEngine, vocab: int, atol: float, seed: int = 0, mean_atol: float | None = None) -> None:
    """The lean stack and LM head against transformers' layer modules and `lm_head` module."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 12), generator=gen)
    lens = [12, 9, 5]
    steps = [torch.randint(0, vocab, (3,), generator=gen) for _ in range(4)]
    assert engine.lean is not None and engine.lean.head is not None
    lean = _run(engine, engine.forward, engine.lean.logits, ids, lens, steps)
    ref = _run(engine, engine.forward_reference, lambda h: engine.model.lm_head(h).float(), ids, lens, steps)
    for a, r in zip(lean, ref, strict=True):
        torch.testing.assert_close(a, r, atol=atol, rtol=0)
        if mean_atol is not None:
            assert (a - r).abs().mean() <= mean_atol
        assert torch.equal(a.argmax(-1), r.argmax(-1))


def test_lean_equals_transformers_float32(engine):
    """Prefill and decode logits of the lean stack equal transformers' modules' (same weights)."""
    _compare(engine, engine.model.config.vocab_size, atol=2e-4)


def test_lean_engine_greedy_and_logprobs_equal_reference_path(engine):
    prompts = [engine.encode_prompt("What is 12 times 7?"), engine.encode_prompt("Name three primes.")]

    def gen():
        reqs = [GenRequest(p, SamplingParams(max_tokens=12, ignore_eos=True), record_logprobs=True) for p in prompts]
        return engine.generate(reqs, "dense")

    lean = gen()
    saved, engine.lean = engine.lean, None
    try:
        ref = gen()
    finally:
        engine.lean = saved
    for a, r in zip(lean, ref, strict=True):
        assert a.token_ids == r.token_ids
        # float16 rows: a -32 logprob has a step of 1/32, hence the relative tolerance
        torch.testing.assert_close(a.logprobs.float(), r.logprobs.float(), atol=2e-3, rtol=2e-3)


def test_lean_bf16w_close_to_transformers():
    """Under bf16 weights the fused and pre-packed GEMMs may round a product differently from the
    separate ones (another accumulation order, output rounded to bf16), depending on the CPU's bf16
    GEMM kernels: on some CPUs the two agree exactly, on others (AVX-512 without its bf16
    instructions) the prefill logits differ by at most 1/16 and the decode steps' by up to 0.44,
    0.09 on average, at logits of magnitude 25-35 (one bf16 step there is 1/8 to 1/4). The bound:
    the same greedy token, every logit within 1, the mean within 0.15; a wrong weight or cache
    entry moves logits by whole units. The float32 test above holds the two paths to 2e-4."""
    loaded = load_model("smollm2-135m-instruct", device="cpu", dtype="bf16w")
    engine = NativeEngine(loaded, max_batch=3)
    _compare(engine, loaded.model.config.vocab_size, atol=1.0, mean_atol=0.15)


def test_fused_weights_are_shared_views(engine):
    """Fusing q/k/v and gate/up leaves the modules' weights as views of the fused tensors: no
    copy, so the transformers path reads the same memory."""
    att = engine.model.model.layers[0].self_attn
    fused = engine.lean.layers[0].qkv.weight
    assert att.q_proj.weight.data_ptr() == fused.data_ptr()
    assert att.k_proj.weight.data_ptr() == fused[att.q_proj.weight.shape[0]:].data_ptr()


def _tiny(model_type: str, **extra) -> NativeEngine:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    if model_type == "llama":  # every projection with a bias: o_proj's and down_proj's too
        cfg.attention_bias = cfg.mlp_bias = True
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random (non-unit) norm weights and biases, so every term is exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    loaded = LoadedModel(name=f"tiny-{model_type}", path=Path("."), model=model, tokenizer=None,
                         device=torch.device("cpu"), dtype=torch.float32)
    return NativeEngine(loaded, max_batch=3)


def test_a_second_engine_on_the_same_model_reuses_the_fused_weights():
    """A second `NativeEngine` on one loaded model (q/k/v biases included) takes the weights the
    first one fused as they are: both engines and the modules read one memory, nothing is copied
    again, and the first engine's output is unchanged."""
    first = _tiny("qwen2")
    before = _run(first, first.forward, first.lean.logits, torch.tensor([[5, 9, 2, 7]]), [4], [torch.tensor([3])])
    second = NativeEngine(first.loaded, max_batch=3)
    layer = first.model.model.layers[1]
    for eng in (first, second):
        lean = eng.lean.layers[1]
        assert lean.qkv.weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert lean.qkv.bias.data_ptr() == layer.self_attn.q_proj.bias.data_ptr()
        assert lean.gate_up.weight.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
        assert lean.gate_up.weight.shape == (2 * 96, 64) and lean.qkv.bias.shape == (64 + 2 * 32,)
    after = _run(first, first.forward, first.lean.logits, torch.tensor([[5, 9, 2, 7]]), [4], [torch.tensor([3])])
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_lean_equals_transformers_on_other_llama_family_layouts(model_type):
    engine = _tiny(model_type)
    if model_type == "qwen2":
        assert engine.model.model.layers[0].self_attn.q_proj.bias is not None
    if model_type == "qwen3":
        assert engine.lean.layers[0].q_norm is not None
    if model_type == "llama":
        assert engine.lean.layers[0].o.bias is not None and engine.lean.layers[0].down.bias is not None
    _compare(engine, 97, atol=1e-5)


def test_unsupported_layout_takes_the_transformers_path():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")
    assert not LeanDecoder.supports(AutoModelForCausalLM.from_config(cfg))
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert not LeanDecoder.supports(gpt2)


def test_a_forward_hook_on_a_layer_takes_the_module_path(engine):
    """Hooks fire only when the modules run: with one registered, the engine uses transformers'
    modules (the hook sees every decode step); without, the lean stack (it sees none)."""
    seen: list[int] = []
    handle = engine.model.model.layers[3].register_forward_hook(lambda m, a, o: seen.append(1))
    ids = engine.encode_prompt("Hello")
    try:
        engine.generate([GenRequest(ids, SamplingParams(max_tokens=5, ignore_eos=True))], "dense")
    finally:
        handle.remove()
    assert len(seen) == 5  # prefill + 4 decode forwards
    engine.generate([GenRequest(ids, SamplingParams(max_tokens=5, ignore_eos=True))], "dense")
    assert len(seen) == 5
    # a hook deeper in a layer (a projection) or on the LM head counts too
    for module in (engine.model.model.layers[2].self_attn.q_proj, engine.model.lm_head):
        handle = module.register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            engine.generate([GenRequest(ids, SamplingParams(max_tokens=3, ignore_eos=True))], "dense")
        finally:
            handle.remove()
    assert len(seen) == 5 + 3 + 3
