"""A thinking budget: at most N tokens inside a `<think>` segment, then `</think>` is forced and
the model goes on to its answer (vLLM's `thinking_token_budget`, for models whose vocabulary has
single `<think>` and `</think>` tokens).

The segment is open when the prompt's last think tag is `<think>` (a template that opens it for
the model) or when the model writes `<think>`; every token after the `<think>` counts, the
prompt's own included (as vLLM counts them), and once `budget` have been counted the next token
is `</think>`. A `</think>` the model writes itself
closes it earlier; a later `<think>` opens a new segment with a fresh count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ThinkingBudget:
    budget: int
    open_id: int
    close_id: int
    inside: bool = False
    used: int = 0

    @classmethod
    def start(cls, budget: int, open_id: int, close_id: int, prompt_ids: list[int]) -> ThinkingBudget:
        at = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] in (open_id, close_id)), None)
        inside = at is not None and prompt_ids[at] == open_id
        return cls(budget, open_id, close_id, inside=inside, used=len(prompt_ids) - 1 - at if inside else 0)

    def forced(self) -> int | None:
        """The token the next step must be (`</think>` once the budget is spent), else None."""
        return self.close_id if self.inside and self.used >= self.budget else None

    def push(self, tok: int) -> None:
        if tok == self.open_id:
            self.inside, self.used = True, 0
        elif tok == self.close_id:
            self.inside = False
        elif self.inside:
            self.used += 1
