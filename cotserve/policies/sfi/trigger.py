"""When SFI takes a slow step (dense attention + re-selection): the refresh trigger.

SFI (arXiv:2603.12038) observes that the dominant attention support is stable within a sentence,
so the selection is refreshed near sentence boundaries. Per sequence, at decode step t (0 = the
first decode forward; the bootstrap after prefill counts as a refresh at t = -1), with
g = t - (last refresh):

* `boundary` (default): when the step's input token is the first token after a sentence-end
  token (`boundaries.sentence_end_ids`, from the vocabulary), a refresh is due. It fires at once
  if g >= min_gap, otherwise it stays pending and fires at the first step with g >= min_gap.
  A boundary seen within `cooldown` steps of the last refresh is dropped (a run such as ".\\n\\n"
  gives one refresh, not three). Whatever happens, g >= max_interval forces a refresh (the
  refresh budget T_max). The paper's trigger (Sec. 5.1: a boundary set and T_max = 64) is
  min_gap=1, cooldown=0, the defaults; min_gap and cooldown are additions of ours.
* `fixed_periodic` (ablation): every `period` steps, boundaries ignored.
* `disabled` (ablation): never after the bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass

from cotserve.policies.options import SFIOptions, option_default


@dataclass
class RefreshTrigger:
    """Defaults: SFI's options of the same meaning (`trigger` is `mode` here)."""

    mode: str = option_default(SFIOptions, "trigger")
    min_gap: int = option_default(SFIOptions, "min_gap")
    max_interval: int = option_default(SFIOptions, "max_interval")
    cooldown: int = option_default(SFIOptions, "cooldown")
    period: int = option_default(SFIOptions, "period")
    last: int = -1  # step of the last refresh (bootstrap = -1)
    pending: bool = False

    def reset(self, step: int = -1) -> None:
        self.last = step
        self.pending = False

    def step(self, t: int, after_boundary: bool) -> bool:
        """Decide step t; `after_boundary`: the previous token ended a sentence. True = slow step."""
        g = t - self.last
        if self.mode == "disabled":
            return False
        if self.mode == "fixed_periodic":
            fire = g >= self.period
        else:
            if after_boundary and g > self.cooldown:
                self.pending = True
            fire = (self.pending and g >= self.min_gap) or g >= self.max_interval
        if fire:
            self.reset(t)
        return fire
