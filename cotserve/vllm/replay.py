"""`ReplayForcer`: a vLLM logits processor that makes a replayed request's next token the text's.

The benchmark replay (`cotserve.engine.replay`) on vLLM: a request whose
`SamplingParams.extra_args["cotserve_replay"]` holds token ids gets, at each step, every logit
but the next id's set to -inf, so whatever sampling it asked for picks that id; the model still
runs every step. vLLM keeps each row's output list current (async scheduling fills in -1 for the
tokens in flight), so its length is the index of the next token.

A guest in any vLLM: it leaves every other request alone, and refuses a replayed request unless
the engine was started for benchmark replay (`$COTSERVE_BENCH_REPLAY=1`, set by `--bench-replay`
and the benches' `--replay`): a client of a plain `vllm serve` cannot turn it on.
"""

from __future__ import annotations

import os

import torch

from cotserve.vllm.compat import BatchUpdate, LogitsProcessor, MoveDirectionality

ARG = "cotserve_replay"
ENV = "COTSERVE_BENCH_REPLAY"  # the same name as cotserve.engine.replay.ENV


def replay_ids(extra_args) -> list[int] | None:
    ids = (extra_args or {}).get(ARG) if isinstance(extra_args, dict) else None
    return None if ids is None else list(ids)


class ReplayForcer(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ids = replay_ids(sampling_params.extra_args)
        if ids is None:
            return
        if os.environ.get(ENV) != "1":
            raise ValueError(f"{ARG} is a benchmark facility: this engine was not started for replay")
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{ARG} must be a non-empty list of token ids")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # row -> (replayed ids, the row's output ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            ids = replay_ids(params.extra_args) if params is not None else None
            if ids:
                self.rows[index] = (ids, output_ids)
            else:
                self.rows.pop(index, None)
        for src, dst, direction in batch_update.moved:
            a, b = self.rows.pop(src, None), self.rows.pop(dst, None)
            if a is not None:
                self.rows[dst] = a
            if direction == MoveDirectionality.SWAP and b is not None:
                self.rows[src] = b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows, toks = [], []
        for row, (ids, out) in self.rows.items():
            if row < logits.shape[0]:
                rows.append(row)
                toks.append(ids[len(out) % len(ids)] % logits.shape[1])  # ids come from the model's tokenizer
        if rows:
            r = torch.tensor(rows, device=logits.device)
            t = torch.tensor(toks, device=logits.device)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits
