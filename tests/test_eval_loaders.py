"""Loaders (local JSONL files, Hugging Face row formats, custom JSONL mappings), prompts, the
--policy variant syntax and the report statistics. Multiple-choice content here is made up."""

from __future__ import annotations

import json

import pytest

from cotserve.errors import CotserveError
from cotserve.eval.loaders import SUITES, load_suite, parse_suites
from cotserve.eval.prompts import build_prompt
from cotserve.eval.report import union_seconds
from cotserve.eval.runner import job_seed, parse_variants, read_log


def test_every_bundled_suite_loads_from_the_data_dir(data_dir):
    """aime25 is left out: its file is not in every data directory (see test_eval_sampling)."""
    for ref in parse_suites("gsm8k,math500,aime24,gpqa,livecodebench"):
        items = load_suite(ref, data_dir, "local", limit=3)
        assert len(items) == 3 and len({i.id for i in items}) == 3
        for it in items:
            prompt = build_prompt(it)
            assert it.question.strip()[:40] in prompt
            if it.kind in ("math", "gsm8k"):
                assert "\\boxed{}" in prompt and it.answer
            elif it.kind == "gpqa":
                assert it.answer in "ABCD" and "Answer: $LETTER" in prompt
                assert all(f"{L}) " in prompt for L in "ABCD")
            else:
                assert it.meta["tests"] and "```python" in prompt


def test_gsm8k_reference_is_the_final_number(data_dir):
    (first,) = load_suite(parse_suites("gsm8k")[0], data_dir, limit=1)
    raw = json.loads((data_dir / "gsm8k_test.jsonl").open().readline())
    assert first.answer == raw["final_answer"] and first.id == raw["id"]


def test_livecodebench_functional_items_carry_starter_code(data_dir):
    items = load_suite(parse_suites("livecodebench")[0], data_dir)
    func = next(i for i in items if i.meta["func_name"])
    assert func.meta["starter_code"].rstrip() in build_prompt(func)
    assert all(t["testtype"] == "functional" for t in func.meta["tests"])
    stdin = next(i for i in items if not i.meta["starter_code"])
    assert "STDOUT" in build_prompt(stdin)


def test_hugging_face_row_formats_map_onto_the_same_items():
    """Rows shaped like the Hugging Face copies (made-up content): original GPQA column names,
    LiveCodeBench tests and metadata as JSON strings, GSM8K's `####` answers, AIME's padded ints."""
    gsm = SUITES["gsm8k"].from_row({"question": "q?", "answer": "work <<1+1=2>>\n#### 1,234"}, 0, "gsm8k")
    assert gsm.answer == "1234" and gsm.id == "gsm8k-test-0"
    aime = SUITES["aime24"].from_row({"id": 60, "problem": "p", "answer": "025"}, 0, "aime24")
    assert aime.answer == "25"
    row = {"Question": "Which gas do plants take in?", "Correct Answer": "carbon dioxide",
           "Incorrect Answer 1": "neon", "Incorrect Answer 2": "argon", "Incorrect Answer 3": "helium",
           "Record ID": "made-up-7"}
    a = SUITES["gpqa"].from_row(row, 0, "gpqa")
    b = SUITES["gpqa"].from_row(dict(row), 0, "gpqa")
    assert a.meta["choices"] == b.meta["choices"]  # a fixed shuffle
    assert a.meta["choices"]["ABCD".index(a.answer)] == "carbon dioxide"
    lcb = SUITES["livecodebench"].from_row({
        "question_id": "x1", "question_content": "Add two numbers.", "starter_code": "",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "metadata": "{}", "platform": "atcoder"}, 0, "livecodebench")
    assert lcb.meta["tests"][0]["output"] == "3\n" and lcb.meta["func_name"] is None


def test_hf_source_fails_with_one_clear_error_offline():
    with pytest.raises(CotserveError, match="datasets|Hugging Face"):
        load_suite(parse_suites("gsm8k")[0], None, "hf", limit=1)


def test_custom_jsonl_with_a_field_mapping(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"key": "a1", "prompt": "What is 2+3?", "gold": "5"}, {"key": "a2", "prompt": "Half of 1?", "gold": "1/2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ref,) = parse_suites(f"custom:{path}:prompt:gold:math:key")
    items = load_suite(ref, None)
    assert [i.id for i in items] == ["a1", "a2"] and ref.name == "custom:mine"
    assert items[1].answer == "1/2" and "What is 2+3?" in build_prompt(items[0])
    with pytest.raises(CotserveError, match="no field 'question'"):
        load_suite(parse_suites(f"custom:{path}")[0], None)
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"question": "Pick the even number.", "choices": ["3", "5", "8", "9"], "answer": "8"}) + "\n")
    (item,) = load_suite(parse_suites(f"custom:{mc}:question:answer:gpqa")[0], None)
    assert item.answer == "C"


def test_suite_errors():
    with pytest.raises(CotserveError, match="unknown suite"):
        parse_suites("gsm9k")
    with pytest.raises(CotserveError, match="twice"):
        parse_suites("gsm8k,gsm8k")
    with pytest.raises(CotserveError, match="not found"):
        load_suite(parse_suites("gsm8k")[0], __import__("pathlib").Path("/nonexistent"), "local")


def test_policy_variants():
    vs = parse_variants("dense,small=sfi[k=256,recent=8],big=sfi+skipkv[k=1024]", {"sfi.sink": "4", "budget": "9"})
    assert [v.label for v in vs] == ["dense", "small", "big"]
    assert vs[0].options == {}  # plain dense takes no global option
    assert vs[1].policy == "sfi" and vs[1].options == {"sfi.sink": "4", "budget": "9", "k": "256", "recent": "8"}
    assert vs[2].policy == "sfi+skipkv" and vs[2].options["k"] == "1024"
    with pytest.raises(CotserveError, match="twice"):
        parse_variants("dense,dense")
    assert [v.label for v in parse_variants("a=dense,b=dense")] == ["a", "b"]
    with pytest.raises(CotserveError, match="unbalanced"):
        parse_variants("sfi[k=1")


def test_wall_union_and_seeds():
    assert union_seconds([(0, 2), (1, 3), (10, 11)]) == 4
    assert job_seed(0, "gsm8k", "x", 0) == job_seed(0, "gsm8k", "x", 0) != job_seed(0, "gsm8k", "x", 1)


def test_resume_log_ignores_torn_lines_and_retries_errors(tmp_path):
    log = tmp_path / "predictions.jsonl"
    good = {"suite": "s", "policy": "p", "id": "1", "sample": 0, "correct": True}
    failed = {"suite": "s", "policy": "p", "id": "2", "sample": 0, "error": "HTTP 503"}
    log.write_text(json.dumps(good) + "\n" + json.dumps(failed) + "\n" + '{"suite": "s", "pol')
    done = read_log(log)
    assert list(done) == [("s", "p", "1", 0)]
