"""Incremental detokenization, stop-string matching and <think> splitting."""

from __future__ import annotations

from cotserve.engine.sampling import filter_logits
from cotserve.engine.textproc import (
    IncrementalDetokenizer,
    ReasoningStream,
    StopStringMatcher,
    split_reasoning,
)


def test_detokenizer_handles_multibyte_and_merged_tokens(loaded):
    tok = loaded.tokenizer
    text = "Héllo wörld, 日本語 text 🙂🚀 with  double  spaces and émojis 👩‍👩‍👧!"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    out = "".join(pieces) + d.flush()
    assert out == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_partial_and_cuts():
    m = StopStringMatcher(["STOP"])
    emitted = "".join(m.feed(x) for x in ["abc S", "T", "O", "P tail"])
    assert emitted == "abc "
    assert m.stopped and m.text == "abc "


def test_stop_matcher_releases_false_alarm():
    m = StopStringMatcher(["STOP"])
    out = m.feed("abc ST") + m.feed("ART") + m.finish()
    assert out == "abc START"
    assert not m.stopped


def test_split_reasoning_forms():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("plain") == (None, "plain")
    assert split_reasoning("<think>still going") == ("still going", "")
    assert split_reasoning("pre-opened</think>ans") == ("pre-opened", "ans")


def test_reasoning_stream_matches_split_char_by_char():
    for text in ["<think>\nI think.\n</think>\n\nThe answer is 4.", "No thinking here <thin", "<think>abc</thi"]:
        s = ReasoningStream()
        r = c = ""
        for ch in text:
            a, b = s.feed(ch)
            r += a
            c += b
        a, b = s.finish()
        r += a
        c += b
        want_r, want_c = split_reasoning(text)
        assert r.strip("\n") == (want_r or "")
        assert c == want_c


def test_top_k_and_top_p_filters():
    import torch

    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    k2 = filter_logits(logits, 2, 1.0)
    assert torch.isfinite(k2).tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits, 0)
    p = float(probs[0] + probs[1]) - 1e-4
    kp = filter_logits(logits, 0, p)
    assert torch.isfinite(kp).tolist() == [True, True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.01)).sum() == 1
