"""SFI's knobs. Every option of `SFIOptions` (`policies/options.py`, where each is defined with its
type, range, default and meaning) is a field here and a `--policy-opt sfi.NAME=VALUE` (or a
YAML/JSON key, or a per-request option). docs/policies-paper-fidelity.md lists each default and
where it comes from."""

from __future__ import annotations

from cotserve.policies.base import PolicyConfig
from cotserve.policies.options import SFIOptions, check_config, options_config


@options_config(SFIOptions)
class SFIConfig(PolicyConfig):
    """Defaults are the paper's ("Default SFI configuration", Sec. 5.1 of arXiv:2603.12038; the
    refinement values also Sec. 5.4, Tables 6-7). Fields the paper leaves unstated keep the
    reconstruction documented in docs/policies-paper-fidelity.md; additions of ours are off."""

    def validate(self) -> None:
        check_config(self)

    @property
    def tail_len(self) -> int:
        return self.recent if self.tail < 0 else self.tail
