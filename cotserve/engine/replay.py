"""Replay: a benchmark facility that makes decoding follow a real text.

With random weights of real shapes (the fast way to measure a large model) the sampled tokens are
noise: no sentence ever ends, so the refreshes at sentence ends, SkipKV's sentences and thoughts
and steering's triggers happen at rates no real text gives. Under replay, each request's output
tokens are taken from a real text instead of from the model's choice (teacher forcing through the
engine's `GenRequest.forced_ids`, or on vLLM through `cotserve.vllm.replay.ReplayForcer`), while
the model still computes every step at its real shapes. The policies see the text's boundaries at
the text's rates.

It is never on unless asked for: `bench decode --replay`, `bench capacity --replay`, and the
server's `--bench-replay` (every request of that server then replays; its replies are the text,
not the model's). A source is `math` (the solutions of the data directory's math_train.jsonl) or
a file: JSONL (each line's `solution`, `text`, `content`, `completion` or `output` field) or plain
text. Its texts are joined by blank lines into one token stream; request i takes the stream from
an offset of its own, cycling at the end.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cotserve.data import data_dir as find_data_dir
from cotserve.errors import CotserveError

MATH_FILE = "math_train.jsonl"
TEXT_FIELDS = ("solution", "text", "content", "completion", "output")
MAX_TOKENS = 1 << 20  # tokens read from a source at most (enough for any single request)
ENV = "COTSERVE_BENCH_REPLAY"  # "1" in a vLLM engine's processes: replayed requests are accepted


@dataclass
class ReplayText:
    """One token stream of real text and where it came from."""

    ids: list[int]
    source: str  # "math" or the file's name (never its folder)

    def tokens(self, key: int | str, n: int) -> list[int]:
        """`n` tokens of the stream for request `key` (an index, or a request id hashed to one):
        from its own offset, cycling at the end."""
        if isinstance(key, str):
            key = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        size = len(self.ids)
        start = (key * 7919) % size  # a prime stride: neighbouring requests start far apart
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), size - start)
            out.extend(self.ids[start:start + take])
            start = 0
        return out

    def describe(self) -> dict[str, object]:
        return {"source": self.source, "tokens": len(self.ids)}


def _texts(path: Path):
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CotserveError(f"replay source {path.name} line {n} is not JSON: {exc.msg}") from None
                text = next((rec[k] for k in TEXT_FIELDS if isinstance(rec, dict) and isinstance(rec.get(k), str)),
                            None)
                if text is None:
                    raise CotserveError(f"replay source {path.name} line {n} has none of the text fields "
                                        f"{', '.join(TEXT_FIELDS)}")
                yield text
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def replay_path(source: str, data_dir: str | None = None) -> tuple[Path, str]:
    """(file, name) of a replay source; a clear error when it is missing (checked before a model loads)."""
    if source == "math":
        root = find_data_dir(data_dir, required=False)
        path = root / MATH_FILE if root else None
        if path is None or not path.is_file():
            raise CotserveError(f"replay source 'math' needs {MATH_FILE} in the data directory "
                                "(pass --data-dir or set COTSERVE_DATA_DIR)")
        return path, "math"
    path = Path(source).expanduser()
    if not path.is_file():
        raise CotserveError(f"replay source {path.name!r} is not a file (use 'math' or a JSONL/text file)")
    return path, path.name


def load_replay(source: str, tokenizer, data_dir: str | None = None, max_tokens: int = MAX_TOKENS) -> ReplayText:
    """The token stream of `source` ('math' or a file path) in `tokenizer`'s vocabulary."""
    path, name = replay_path(source, data_dir)
    ids: list[int] = []
    for text in _texts(path):
        ids.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= max_tokens:
            del ids[max_tokens:]
            break
    if len(ids) < 16:
        raise CotserveError(f"replay source {name!r} holds {len(ids)} tokens of text; it needs at least 16")
    return ReplayText(ids, name)
