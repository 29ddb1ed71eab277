"""`skipkv`: SkipKV sentence-level KV eviction (Tian et al., arXiv 2512.07993, Sec. 4.1).

Each sequence is cut into sentences at thought delimiters (the paper's newline-type tokens,
`boundaries.thought_delimiter_ids`). A sentence's representation is the mean of the last layer's
(final-norm) hidden states over its tokens, L2-normalised (Sec. 4.1, sentence embedding v_i).
When a sentence closes, its cosine similarity with every earlier sentence of the sequence is
computed (pairwise sentence similarity); an EARLIER sentence whose similarity exceeds `sentence_threshold`
(0.95) is marked redundant with a penalty equal to that similarity (the newest copy is kept).

Eviction (every `interval` decode steps, PHYSICAL, budget per KV head, see `eviction`) ranks the
entries of each KV head by the token score of R-KV (`rkv`) minus the sentence penalty:

    score_i = sigma * importance_i - (1 - sigma) * redundancy_i - penalty(sentence(i))

so the tokens of redundant sentences go first and a repeated sentence is dropped as a whole
where the budget allows. Entries are mapped to sentences through their true positions
(`KVCache.pos`), per layer and KV head, so spans stay correct through every compaction.

Batch grouping by prompt length (Sec. 4.3) is the engine's (`native.group_by_length`); the
non-execution thought count (Sec. 4.2) is reported per sequence (`non_execution_thoughts`).

The paper cuts the OUTPUT into sentences, and so does this policy by default: prompt entries carry
no sentence penalty (R-KV's score alone ranks them). `prompt_sentences=true` (an option of ours)
also tracks the prompt's sentences, so that a long prompt compacted at prefill is scored the same
way; on true text it hurts (docs/policies-paper-fidelity.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cotserve.policies.base import Runtime
from cotserve.policies.boundaries import thought_delimiter_ids
from cotserve.policies.options import SkipKVOptions, options_config
from cotserve.policies.registry import register
from cotserve.policies.rkv import RKVConfig, RKVPolicy, rkv_scores

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(SkipKVOptions)
class SkipKVConfig(RKVConfig):
    """`SkipKVOptions`: R-KV's options plus the sentence-level redundancy."""


class SentenceTrack:
    """Sentence spans of one sequence, in true positions [start, end), with their embeddings
    (mean final hidden state, L2-normalised) and penalties (0 unless marked redundant)."""

    def __init__(self, delimiters: frozenset[int], tau: float, start: int = 0):
        self.delims = delimiters
        self.tau = tau
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.penalty: list[float] = []
        self.dropped: list[bool] = []
        self.emb: torch.Tensor | None = None  # [S, H]
        self.open_start = start
        self.open_sum: torch.Tensor | None = None
        self.open_n = 0
        self.open_content = False
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def next_pos(self) -> int:
        return self.open_start + self.open_n

    def _add(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        s = rows.float().sum(0)
        self.open_sum = s if self.open_sum is None else self.open_sum + s
        self.open_n += rows.shape[0]

    def _close(self) -> None:
        v = self.open_sum / self.open_n
        v = v / (v.norm() + 1e-12)
        if self.emb is not None and self.emb.shape[0]:
            sims = self.emb @ v
            for j in torch.nonzero(sims > self.tau).flatten().tolist():
                self.penalty[j] = max(self.penalty[j], float(sims[j]))
            self.emb = torch.cat([self.emb, v.unsqueeze(0)])
        else:
            self.emb = v.unsqueeze(0)
        end = self.open_start + self.open_n
        self.starts.append(self.open_start)
        self.ends.append(end)
        self.penalty.append(0.0)
        self.dropped.append(False)
        self.open_start, self.open_sum, self.open_n, self.open_content = end, None, 0, False
        self._tensors = None

    def feed(self, ids: list[int], hidden: torch.Tensor) -> None:
        """Consume the next tokens (ids) and their final hidden states [T, H]. A delimiter closes
        the open sentence if it holds a non-delimiter token (runs of delimiters stay together)."""
        seg = 0
        for j, t in enumerate(ids):
            if t in self.delims:
                if self.open_content:
                    self._add(hidden[seg : j + 1])
                    seg = j + 1
                    self._close()
            else:
                self.open_content = True
        self._add(hidden[seg:])

    def count(self, token: int) -> bool:
        """`feed` of one token whose hidden state the caller adds to the open sentence's sum itself
        (a batch of tracks keeps their open sums in one tensor): counts it and says whether it
        closes the sentence; if so the caller passes the sum, this token's row included, to
        `close_with`. The same arithmetic as `feed([token], row)`."""
        self.open_n += 1
        if token in self.delims:
            return self.open_content
        self.open_content = True
        return False

    def close_with(self, total: torch.Tensor) -> None:
        """Close the open sentence whose hidden states sum to `total` (see `count`)."""
        self.open_sum = total
        self._close()

    def skip(self, n: int) -> None:
        """Advance over n positions that belong to no sentence (e.g. an untracked prompt)."""
        assert self.open_n == 0
        self.open_start += n

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tensors is None or self._tensors[0].device != device:
            self._tensors = (torch.tensor(self.starts, dtype=torch.long, device=device),
                             torch.tensor(self.ends, dtype=torch.long, device=device),
                             torch.tensor(self.penalty, dtype=torch.float32, device=device))
        return self._tensors

    def sentence_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Closed-sentence index of each true position (-1: none), any shape."""
        if not self.starts:
            return torch.full_like(pos, -1)
        starts, ends, _ = self.tensors(pos.device)
        sid = torch.searchsorted(starts, pos.contiguous(), right=True) - 1
        inside = (sid >= 0) & (pos < ends[sid.clamp(min=0)])
        return torch.where(inside, sid, torch.full_like(sid, -1))

    def penalty_of(self, pos: torch.Tensor) -> torch.Tensor:
        sid = self.sentence_of(pos)
        if not self.starts:
            return torch.zeros(pos.shape, dtype=torch.float32, device=pos.device)
        pen = self.tensors(pos.device)[2]
        return torch.where(sid >= 0, pen[sid.clamp(min=0)], torch.zeros((), device=pos.device))


@register
class SkipKVPolicy(RKVPolicy):
    """SkipKV: R-KV's token score minus a sentence-redundancy penalty (see module docstring)."""

    name = "skipkv"
    config_cls = SkipKVConfig
    runtimes = Runtime.ALL

    def begin(self, batch) -> None:
        super().begin(batch)
        tok = batch.info.tokenizer
        delims = thought_delimiter_ids(tok) if tok is not None else frozenset()
        self.sentences = [SentenceTrack(delims, self.config.sentence_threshold) for _ in range(batch.batch_size)]
        self.dropped_sentences = [0] * batch.batch_size

    def observe(self, batch) -> None:
        hidden = batch.hidden
        if batch.mode == "prefill":
            for i, plen in enumerate(batch.prompt_lens.tolist()):
                if self.config.prompt_sentences:
                    self.sentences[i].feed(batch.tokens[i][:plen], hidden[i, :plen])
                else:
                    self.sentences[i].skip(plen)
            return
        active = batch.active.tolist() if batch.active is not None else [True] * batch.batch_size
        positions = batch.positions.tolist()
        for i, track in enumerate(self.sentences):
            if active[i] and positions[i] == track.next_pos:
                track.feed([batch.tokens[i][positions[i]]], hidden[i, -1:])

    def score(self, batch: BatchState, layer: int, slot: int, n: int) -> torch.Tensor:
        q, q_pos, k, pos = self.observed(batch, layer, slot, n)
        base = rkv_scores(q, q_pos, k, pos, batch.scaling, self.config)
        m = base.shape[1]
        return base - self.sentences[slot].penalty_of(pos[:, :m])

    def after_compaction(self, batch, slot: int) -> None:
        track = self.sentences[slot]
        if not len(track):
            return
        cache = batch.cache
        n = int(cache.lens[:, slot].max())
        pos = cache.pos[:, slot, :, :n].reshape(-1)
        pos = pos[pos >= 0]
        sid = track.sentence_of(pos)
        present = torch.bincount(sid[sid >= 0], minlength=len(track)).tolist()
        for j, cnt in enumerate(present):
            if cnt == 0 and not track.dropped[j]:
                track.dropped[j] = True
                self.dropped_sentences[slot] += 1

    def telemetry(self, slot: int) -> dict[str, Any]:
        out = super().telemetry(slot)
        track = self.sentences[slot]
        out["sentences"] = len(track)
        out["redundant_sentences"] = sum(1 for p in track.penalty if p > 0)
        out["sentences_dropped"] = self.dropped_sentences[slot]
        out["redundant_sentences_dropped"] = sum(
            1 for p, d in zip(track.penalty, track.dropped, strict=True) if p > 0 and d)
        return out
