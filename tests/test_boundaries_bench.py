"""Vocabulary-derived boundaries; teacher forcing and the fidelity comparison."""

from __future__ import annotations

from cotserve.bench.fidelity import compare
from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.boundaries import sentence_end_ids, thought_delimiter_ids


def test_boundaries_come_from_the_vocabulary(loaded):
    tok = loaded.tokenizer
    sent = sentence_end_ids(tok)
    thought = thought_delimiter_ids(tok)
    for text in [".", "?", "!", "\n", "\n\n", " Done.", "Why?"]:
        ids = tok.encode(text)
        assert ids[-1] in sent, text
    for text in ["\n", ".\n", "\n\n", ".\n\n", "?\n\n", ")\n\n"]:
        ids = tok.encode(text)
        assert ids[-1] in thought, text  # this vocabulary may split ".\n" into "." + "\n"
    for text in [" the", "cat", ",", " and"]:
        (i,) = tok.encode(text)
        assert i not in sent and i not in thought
    assert not (set(tok.all_special_ids) & sent)
    # every member really decodes to a boundary
    for i in list(thought)[:200]:
        assert tok.decode([i]).rstrip(" ").endswith("\n")


def test_teacher_forcing_and_dense_self_agreement(engine):
    ids = engine.encode_prompt("Count from one to ten in words.")
    (ref,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=12, ignore_eos=True), record_logprobs=True)])
    forced = list(reversed(ref.token_ids))
    (res,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=12, ignore_eos=True), record_logprobs=True,
                                         forced_ids=forced)])
    assert res.token_ids == forced
    assert res.greedy_ids[0] == ref.greedy_ids[0]  # same history before the first forced token
    (again,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=12, ignore_eos=True), record_logprobs=True,
                                           forced_ids=ref.token_ids)])
    stats = compare([ref], [again])
    assert stats["top1_agreement"] == 1.0 and stats["mean_kl"] < 1e-3
    stats = compare([ref], [res])
    assert stats["top1_agreement"] < 1.0
