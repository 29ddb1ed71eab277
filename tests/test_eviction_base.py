"""The one score-based eviction base (`eviction.ScoredEviction`) against each eviction policy's own
selection rule written out here by hand: on the bundled model, every one of the five policies gives
the same greedy tokens, the same surviving cache entries and the same eviction telemetry whether the
base compacts the cache or the hand-written rule does."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.base import PolicyStack
from cotserve.policies.h2o import H2OPolicy
from cotserve.policies.registry import build_policy
from cotserve.policies.rkv import RKVPolicy, rkv_scores
from cotserve.policies.scoring import protected_top
from cotserve.policies.skipkv import SkipKVPolicy
from cotserve.policies.snapkv import SnapKVPolicy
from cotserve.policies.streamingllm import StreamingLLMPolicy


class _ByHand:
    """Mixin: the slot loop of an eviction policy, written out; `trigger` and `keep_of` are the
    policy's rule, `kept` the entries left after a compaction, `carried` the per-entry tensors that
    move with the entries. Every slot stays active here (same length, no EOS)."""

    def trigger(self, batch) -> int | None:
        raise NotImplementedError

    def keep_of(self, batch, layer: int, slot: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def kept(self) -> int:
        return self.config.budget

    def carried(self, layer: int, slot: int) -> list[torch.Tensor]:
        return []

    def after_forward(self, batch) -> None:
        self.observe(batch)
        cache = batch.cache
        lens = cache.lens.amax(0).tolist()
        for i, n in enumerate(lens):
            self.peak_entries[i] = max(self.peak_entries[i], n)
        limit = self.trigger(batch)
        if limit is None:
            return
        budget = self.kept()
        for slot, n in enumerate(lens):
            if n <= limit:
                continue
            for layer in range(cache.shape.layers):
                keep = self.keep_of(batch, layer, slot, n).sort(dim=-1).values
                for f in self.carried(layer, slot):
                    f[:, :budget] = torch.gather(f[:, :n], 1, keep)
                    f[:, budget:] = 0
                cache.compact(layer, slot, keep)
            self.compactions[slot] += 1
            self.evicted[slot] += n - budget
            self.after_compaction(batch, slot)


class _RKVByHand(_ByHand, RKVPolicy):
    """R-KV: every `interval` decode steps (and after prefill), the top budget - window entries by
    the joint score plus the window."""

    def trigger(self, batch):
        c = self.config
        if batch.mode == "prefill":
            return c.budget if c.compact_prefill else None
        return None if (batch.step + 1) % c.interval else c.budget

    def scores_of(self, batch, layer, slot, n):
        qmask = self.q_pos[slot] >= 0
        q = self.q_win[layer][slot][:, qmask]
        k, pos = batch.cache.k[layer, slot, :, :n], batch.cache.pos[layer, slot, :, :n]
        return rkv_scores(q, self.q_pos[slot, qmask], k, pos, batch.scaling, self.config), pos

    def keep_of(self, batch, layer, slot, n):
        scores, _ = self.scores_of(batch, layer, slot, n)
        c = self.config
        m = scores.shape[1]
        top = scores.topk(min(c.budget - c.window, m), dim=-1).indices
        return torch.cat([top, torch.arange(m, m + c.window).expand(scores.shape[0], -1)], dim=-1)


class _SkipKVByHand(_RKVByHand, SkipKVPolicy):
    """SkipKV: R-KV's score minus the sentence penalty of each entry's sentence."""

    def scores_of(self, batch, layer, slot, n):
        scores, pos = super().scores_of(batch, layer, slot, n)
        return scores - self.sentences[slot].penalty_of(pos[:, : scores.shape[1]]), pos


class _H2OByHand(_ByHand, H2OPolicy):
    """H2O: the last `recent` entries plus the heaviest accumulated scores among the others."""

    def trigger(self, batch):
        c = self.config
        return c.budget if batch.mode == "prefill" else c.budget + c.interval - 1

    def carried(self, layer, slot):
        return [self.scores[layer, slot]]

    def keep_of(self, batch, layer, slot, n):
        c = self.config
        recent = min(c.recent, c.budget)
        heavy = self.scores[layer, slot, :, : n - recent].topk(c.budget - recent, dim=-1).indices
        return torch.cat([heavy, torch.arange(n - recent, n).expand(heavy.shape[0], -1)], dim=-1)


class _SnapKVByHand(_ByHand, SnapKVPolicy):
    """SnapKV: once after prefill, the top pooled window votes plus the window."""

    def trigger(self, batch):
        return self.config.budget if batch.mode == "prefill" else None

    def keep_of(self, batch, layer, slot, n):
        c = self.config
        top = self._pooled[layer][slot].topk(c.budget - c.window, dim=-1).indices
        return torch.cat([top, torch.arange(n - c.window, n).expand(top.shape[0], -1)], dim=-1)

    def after_forward(self, batch):
        super().after_forward(batch)
        self._pooled.clear()


class _StreamingByHand(_ByHand, StreamingLLMPolicy):
    """StreamingLLM: the first `sinks` and the last `recent` entries, nothing scored."""

    def trigger(self, batch):
        c = self.config
        return c.kept if batch.mode == "prefill" else c.kept + c.interval - 1

    def kept(self):
        return self.config.kept

    def keep_of(self, batch, layer, slot, n):
        c = self.config
        idx = torch.cat([torch.arange(c.sinks), torch.arange(n - c.window, n)])
        return idx.expand(batch.cache.shape.kv_heads, -1)


CASES = [
    ("rkv", _RKVByHand, {"budget": 24, "interval": 4, "window": 4}),
    ("skipkv", _SkipKVByHand, {"budget": 20, "interval": 3, "window": 4, "prompt_sentences": True}),
    ("h2o", _H2OByHand, {"budget": 20, "interval": 3, "recent_ratio": 0.25}),
    ("snapkv", _SnapKVByHand, {"budget": 24, "window": 8}),
    ("streamingllm", _StreamingByHand, {"budget": 20, "sinks": 2, "recent": 12, "interval": 3}),
]
TIMES = ("prefill_s", "decode_s", "decode_tok_s")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    texts = ["Problem: add the first n odd numbers.\n\nSolution: the first odd number is 1, then 3.\n\n" * 2,
             "Count with me: one, two, three, four, five.\n\nAgain: one, two, three."]
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("name,by_hand,opts", CASES, ids=[c[0] for c in CASES])
def test_base_compacts_as_the_policy_rule_written_by_hand(engine, prompts, name, by_hand, opts):
    runs = []
    for stack in (build_policy(name, opts), PolicyStack([by_hand(build_policy(name, opts).parts[0].config)])):
        res = engine.generate([GenRequest(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts], stack)
        cache = stack.parts[0].batch.cache
        runs.append(([r.token_ids for r in res],
                     [{k: v for k, v in r.telemetry.items() if k not in TIMES} for r in res],
                     cache.lens.clone(), cache.pos.clone()))
    (tokens, tele, lens, pos), (want_tokens, want_tele, want_lens, want_pos) = runs
    assert tokens == want_tokens
    assert tele == want_tele
    assert all(t["compactions"] >= 1 and t["evicted_tokens"] > 0 for t in tele[:1])  # the long prompt evicted
    assert torch.equal(lens, want_lens) and torch.equal(pos, want_pos)


def test_protected_top_keeps_both_ends_and_the_best_between():
    torch.manual_seed(0)
    n, budget, first, last = 30, 12, 3, 4
    scores = torch.randn(2, n - first - last)
    keep = protected_top(scores, n, budget, first, last, 2, torch.device("cpu"))
    assert keep.shape == (2, budget)
    for h in range(2):
        got = keep[h].tolist()
        assert got == sorted(got)
        best = (scores[h].argsort(descending=True)[: budget - first - last] + first).tolist()
        assert set(got) == {0, 1, 2, *best, *range(n - last, n)}
    # nothing left to choose: the scores are not needed
    ends = protected_top(None, n, 6, 2, 4, 1, torch.device("cpu"))
    assert ends.tolist() == [[0, 1, 26, 27, 28, 29]]
