"""Long prompts of real text for benchmarks: MATH training problems and solutions, concatenated.

Falls back to a fixed-seed random token stream when no data directory is found."""

from __future__ import annotations

import json

import torch

from cotserve.data import data_dir as find_data_dir


def long_prompts(tokenizer, context: int, batch: int, data_dir: str | None = None, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of exactly `context` tokens each, from different parts of the text."""
    root = find_data_dir(data_dir, required=False)
    ids: list[int] = []
    need = context * batch + 16
    path = root / "math_train.jsonl" if root else None
    if path is not None and path.is_file():
        with path.open() as f:
            for line in f:
                rec = json.loads(line)
                ids.extend(tokenizer.encode(f"Problem: {rec['problem']}\nSolution: {rec['solution']}\n\n"))
                if len(ids) >= need:
                    break
    if len(ids) < need:
        gen = torch.Generator().manual_seed(seed)
        extra = torch.randint(100, tokenizer.vocab_size - 1, (need - len(ids),), generator=gen).tolist()
        ids.extend(extra)
    return [ids[i * context : (i + 1) * context] for i in range(batch)]
