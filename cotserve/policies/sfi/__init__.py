"""`sfi`: Slow-Fast Inference (Xie et al., arXiv:2603.12038) for the native engine.

* `config.py`: every knob, with its default and where it comes from;
* `trigger.py`: when a slow (dense, re-selecting) step fires;
* `attention.py`: the fast step (compact sink+selected buffer + recent window, one softmax) and
  the slow step (dense attention that also returns the selector's logits), with references;
* `policy.py`: the policy (state per sequence, layer and KV head; bootstrap; re-pack; telemetry).
"""

from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.policy import SFIPolicy
from cotserve.policies.sfi.trigger import RefreshTrigger

__all__ = ["SFIConfig", "SFIPolicy", "RefreshTrigger"]
