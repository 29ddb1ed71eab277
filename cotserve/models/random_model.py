"""A random-weight model of a named real architecture's shapes, with a synthetic tokenizer, for speed
work where no checkpoint can be fetched."""

from __future__ import annotations

from pathlib import Path

import torch

from cotserve.errors import ModelError
from cotserve.models.devices import pick_device, pick_dtype
from cotserve.models.loaded import LoadedModel
from cotserve.models.weights import narrow_weights

# Real shapes with random weights, for speed work where no checkpoint can be fetched
# (e.g. the lent GPU machine): `--model random:qwen3-4b`.
RANDOM_SHAPES: dict[str, dict] = {
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


def _synthetic_tokenizer(vocab_size: int, eos_id: int):
    """A word-level tokenizer with one token per id ("t123 "), enough to detokenize random output."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos_id}", unk_token="t0")


def load_random_model(shape: str, device: str = "auto", dtype: str = "auto", seed: int = 0) -> LoadedModel:
    """A random-weight model of a real architecture's shapes (speed work only: its text is noise)."""
    if shape not in RANDOM_SHAPES:
        raise ModelError(f"unknown random shape {shape!r} (known: {', '.join(sorted(RANDOM_SHAPES))})")
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(RANDOM_SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    for p in model.parameters():  # real-scale activations: small normal weights
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    model.eval()
    wdt = narrow_weights(model, dtype, dev, dt)
    tok = _synthetic_tokenizer(config.vocab_size, config.eos_token_id)
    return LoadedModel(name=f"random:{shape}", path=Path("."), model=model, tokenizer=tok, device=dev, dtype=dt,
                       weight_dtype=wdt)
