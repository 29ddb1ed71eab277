"""What a benchmark runs on: policy rows with their own options, and real text or, only when
asked, random tokens (recorded in the report)."""

from __future__ import annotations

import pytest

from cotserve.bench.prompts import long_prompts_with_source
from cotserve.bench.specs import parse_rows
from cotserve.errors import CotserveError, PolicyError


def test_rows_carry_their_own_options():
    rows = parse_rows("dense,dense[kernel=torch],sfi[k=256,dense_heads=0.08], skipkv+steering")
    assert [(r.label, r.policy, r.options) for r in rows] == [
        ("dense", "dense", {}), ("dense[kernel=torch]", "dense", {"kernel": "torch"}),
        ("sfi[k=256,dense_heads=0.08]", "sfi", {"k": "256", "dense_heads": "0.08"}),
        ("skipkv+steering", "skipkv+steering", {})]
    for bad in ("sfi[k=1", "sfi]k=1[", "sfi[k]", "[k=1]"):
        with pytest.raises(PolicyError):
            parse_rows(bad)


def test_prompts_refuse_missing_text_unless_random_tokens_are_asked_for(engine, tmp_path, monkeypatch):
    monkeypatch.delenv("COTSERVE_DATA_DIR", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CotserveError, match="--random-tokens"):
        long_prompts_with_source(engine.tokenizer, 32, 2, str(empty))
    (empty / "math_train.jsonl").write_text('{"problem": "1+1?", "solution": "2"}\n')
    with pytest.raises(CotserveError, match="fewer than"):  # too little text is refused too
        long_prompts_with_source(engine.tokenizer, 512, 2, str(empty))
    prompts, src = long_prompts_with_source(engine.tokenizer, 32, 2, str(empty), random_tokens=True)
    assert src.describe() == {"kind": "random_tokens", "path": None, "tokens": 80}
    assert [len(p) for p in prompts] == [32, 32] and prompts[0] != prompts[1]


def test_prompts_come_from_the_text_and_offsets_give_other_text(engine, data_dir):
    prompts, src = long_prompts_with_source(engine.tokenizer, 64, 2, str(data_dir))
    assert src.kind == "text" and src.path.endswith("math_train.jsonl")
    assert "Problem:" in engine.tokenizer.decode(prompts[0])
    later, _ = long_prompts_with_source(engine.tokenizer, 64, 2, str(data_dir), offset=128)
    assert later[0] != prompts[0] and later[0] != prompts[1]
    # an offset of one prompt shifts the cut by exactly one prompt
    shifted, _ = long_prompts_with_source(engine.tokenizer, 64, 1, str(data_dir), offset=64)
    assert shifted[0] == prompts[1]
