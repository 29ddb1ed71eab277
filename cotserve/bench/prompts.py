"""Long prompts of real text for benchmarks: MATH training problems and solutions, concatenated.

Without enough real text (no data directory, or too little in it) a benchmark refuses to run
unless it is asked for random tokens (`--random-tokens`: a fixed-seed random token stream, fine
for speed, meaningless for fidelity or calibration). Every report records where its text came
from (`TextSource.describe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cotserve.data import data_dir as find_data_dir
from cotserve.errors import CotserveError
from cotserve.jsonl import read_jsonl

TEXT_FILE = "math_train.jsonl"


@dataclass
class TextSource:
    kind: str  # "text" (real text) | "random_tokens"
    path: str | None = None  # the text file read
    tokens: int = 0  # tokens taken from it

    def describe(self) -> dict[str, object]:
        return {"kind": self.kind, "path": self.path, "tokens": self.tokens}


def long_prompts_with_source(tokenizer, context: int, batch: int, data_dir: str | None = None, seed: int = 0,
                             random_tokens: bool = False, offset: int = 0) -> tuple[list[list[int]], TextSource]:
    """`batch` prompts of exactly `context` tokens each, from different parts of the text, and
    where they came from. `random_tokens=True` uses a fixed-seed random token stream instead of
    text (never mixed with text); without it, missing or too little text is an error. `offset`:
    tokens of the text (or stream) skipped first (e.g. held-out text after a fit's text)."""
    need = offset + context * batch + 16
    if random_tokens:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(100, tokenizer.vocab_size - 1, (need,), generator=gen).tolist()
        return _cut(ids[offset:], context, batch), TextSource("random_tokens", None, need)
    root = find_data_dir(data_dir, required=False)
    path: Path | None = root / TEXT_FILE if root else None
    if path is None or not path.is_file():
        raise CotserveError(f"no prompt text: {TEXT_FILE} not found (pass --data-dir or set COTSERVE_DATA_DIR; "
                            "--random-tokens runs on random tokens instead, for speed only)")
    ids: list[int] = []
    for rec in read_jsonl(path):
        ids.extend(tokenizer.encode(f"Problem: {rec['problem']}\nSolution: {rec['solution']}\n\n"))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise CotserveError(f"{path} holds {len(ids)} tokens of text, fewer than the {need} asked for "
                            f"({batch} x {context}); use fewer or shorter prompts, or --random-tokens")
    return _cut(ids[offset:], context, batch), TextSource("text", str(path), need)


def long_prompts(tokenizer, context: int, batch: int, data_dir: str | None = None, seed: int = 0,
                 random_tokens: bool = False, offset: int = 0) -> list[list[int]]:
    """`long_prompts_with_source` without the source."""
    return long_prompts_with_source(tokenizer, context, batch, data_dir, seed, random_tokens, offset)[0]


def _cut(ids: list[int], context: int, batch: int) -> list[list[int]]:
    return [ids[i * context : (i + 1) * context] for i in range(batch)]
