"""`dense`: full attention over every cached token at every step (the baseline)."""

from __future__ import annotations

from cotserve.policies.base import Axis, Policy
from cotserve.policies.registry import register


@register
class DensePolicy(Policy):
    """No policy: the engine's default prefill and decode attention are used as they are."""

    name = "dense"
    axis = Axis.READ
