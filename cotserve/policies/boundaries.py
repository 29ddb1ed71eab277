"""Sentence and thought boundaries derived from the tokenizer's own vocabulary.

Never hard-coded token ids: each set is computed by decoding every vocabulary entry once per
tokenizer (cached).

* `sentence_end_ids`: tokens whose text, trailing spaces removed, ends with . ? ! ; 。 ？ ！ ； or a
  newline (SFI's boundary set, paper Sec. 5.1: {., ?, !, ;, \\n}). SFI (Slow-Fast Inference)
  refreshes its selection on the first token after one.
* `thought_delimiter_ids`: newline-type tokens that end a thought in a chain of thought, the
  SkipKV paper's set ("\\n", ".\\n", ")\\n", "\\n\\n", ".\\n\\n", ")\\n\\n", "?\\n\\n") and their
  vocabulary variants (a leading space, more newlines): the text, leading spaces removed, is one
  optional character of . ) ? ! : followed by one or more newlines.
* `think_ids`: the single-token `<think>` / `</think>` ids, where the vocabulary has them (the
  engine's thinking budget, steering's thought regions).
"""

from __future__ import annotations

import re
from functools import lru_cache

SENTENCE_END_CHARS = (".", "?", "!", ";", "。", "？", "！", "；", "\n")
_THOUGHT_RE = re.compile(r"^[ \t]*[.)?!:]?\n+$")


def _vocab_texts(tokenizer) -> list[tuple[int, str]]:
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    for i in range(size):
        if i in special:
            continue
        out.append((i, tokenizer.decode([i], clean_up_tokenization_spaces=False)))
    return out


@lru_cache(maxsize=8)
def _sets(tokenizer) -> tuple[frozenset[int], frozenset[int]]:
    sentence, thought = set(), set()
    for i, text in _vocab_texts(tokenizer):
        if not text or "\ufffd" in text:
            continue
        if text.rstrip(" \t").endswith(SENTENCE_END_CHARS):
            sentence.add(i)
        if _THOUGHT_RE.match(text):
            thought.add(i)
    return frozenset(sentence), frozenset(thought)


def sentence_end_ids(tokenizer) -> frozenset[int]:
    """Token ids that end a sentence (see module docstring)."""
    return _sets(tokenizer)[0]


def thought_delimiter_ids(tokenizer) -> frozenset[int]:
    """Token ids that end a thought (newline-type delimiters, see module docstring)."""
    return _sets(tokenizer)[1]


def think_ids(tokenizer) -> tuple[int | None, int | None]:
    """Single-token `<think>` / `</think>` ids of this vocabulary, else None."""
    out = []
    for text in ("<think>", "</think>"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(int(ids[0]) if len(ids) == 1 else None)
    return out[0], out[1]
