"""The one JSONL reader (`cotserve.jsonl`): blank lines, a torn last line, clear errors. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cotserve.errors import CotserveError
from cotserve.jsonl import close_last_line, numbered_jsonl, read_jsonl


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def test_rows_in_order_blank_lines_skipped_with_their_line_numbers(tmp_path):
    p = _write(tmp_path / "a.jsonl", '{"x": 1}\n\n   \n{"x": "é"}\n{"x": 3}')
    assert list(read_jsonl(p)) == [{"x": 1}, {"x": "é"}, {"x": 3}]
    assert [n for n, _ in numbered_jsonl(p)] == [1, 4, 5]
    with pytest.raises(CotserveError, match=r"a\.jsonl:2: not valid JSON"):
        list(read_jsonl(p, skip_blank=False))


def test_a_bad_line_names_the_file_and_the_line(tmp_path):
    p = _write(tmp_path / "b.jsonl", '{"x": 1}\n{"x": \n{"x": 3}\n')
    with pytest.raises(CotserveError, match=r"b\.jsonl:2: not valid JSON"):
        list(read_jsonl(p, torn_tail=True))  # a bad line in the middle is never a torn write
    p = _write(tmp_path / "c.jsonl", '{"x": 1}\n[1, 2]\n')
    with pytest.raises(CotserveError, match=r"c\.jsonl:2: expected a JSON object per line"):
        list(read_jsonl(p))
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"x": 1}\n{"x": "\xff"}\n')
    with pytest.raises(CotserveError, match=r"d\.jsonl:2: not valid JSON \(not UTF-8 text\)"):
        list(read_jsonl(p))


def test_a_torn_last_line_is_ignored_only_when_asked(tmp_path):
    p = _write(tmp_path / "e.jsonl", '{"x": 1}\n{"x": 2}\n{"x": "unfini')
    assert list(read_jsonl(p, torn_tail=True)) == [{"x": 1}, {"x": 2}]
    with pytest.raises(CotserveError, match=r"e\.jsonl:3: not valid JSON"):
        list(read_jsonl(p))
    # a bad last line that was written whole (it has its newline) is not a torn write
    p = _write(tmp_path / "f.jsonl", '{"x": 1}\n{"x": "unfini\n')
    with pytest.raises(CotserveError, match=r"f\.jsonl:2"):
        list(read_jsonl(p, torn_tail=True))
    # a last line cut inside a multi-byte character
    p = tmp_path / "g.jsonl"
    p.write_bytes('{"x": 1}\n{"x": "é'.encode()[:-1])
    assert list(read_jsonl(p, torn_tail=True)) == [{"x": 1}]


def test_reading_from_a_byte_offset_and_stopping_early(tmp_path):
    p = _write(tmp_path / "h.jsonl", '{"x": 1}\n')
    start = p.stat().st_size
    with open(p, "a", encoding="utf-8") as f:
        f.write('{"x": 2}\n{"x": 3}\n{"x": oops\n')
    rows = read_jsonl(p, start=start)
    assert next(rows) == {"x": 2} and next(rows) == {"x": 3}
    with pytest.raises(CotserveError, match=r"h\.jsonl:3"):  # lines count from the offset
        next(rows)


def test_close_last_line_cuts_a_torn_write_and_keeps_a_whole_one(tmp_path):
    p = _write(tmp_path / "i.jsonl", '{"x": 1}\n{"x": "unfini')
    assert close_last_line(p) is True
    assert p.read_text() == '{"x": 1}\n'
    assert close_last_line(p) is False and p.read_text() == '{"x": 1}\n'
    p = _write(tmp_path / "j.jsonl", '{"x": 1}\n{"x": 2}')
    assert close_last_line(p) is False
    assert p.read_text() == '{"x": 1}\n{"x": 2}\n'
    big = json.dumps({"x": "y" * 200_000})  # a last line longer than one read block
    p = _write(tmp_path / "k.jsonl", big[:-3])
    assert close_last_line(p) is True and p.read_bytes() == b""
    p = _write(tmp_path / "l.jsonl", '{"x": 0}\n' + big)
    assert close_last_line(p) is False and list(read_jsonl(p))[1] == json.loads(big)
    p = _write(tmp_path / "m.jsonl", "")
    assert close_last_line(p) is False
