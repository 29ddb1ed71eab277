"""`cotserve.vllm.compat`: its lookups of vLLM's names (a clear error naming what is missing, a
name that moved found where the installed version has it) and its handling of the host copies of
the sequence lengths in vLLM 0.26's attention metadata layout (a deprecated read-only property
over a field, and lengths vLLM derives from them)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import pytest
import torch

from cotserve.vllm import compat


def test_lookup_takes_the_first_module_that_has_the_name():
    from collections import OrderedDict

    assert compat.lookup("OrderedDict", ("cotserve_no_such_pkg.mod", "collections")) is OrderedDict


def test_lookup_names_what_is_missing_and_where_it_looked():
    with pytest.raises(compat.MissingInVLLM) as err:
        compat.lookup("NoSuchName", ("cotserve_no_such_pkg.mod", "collections"))
    msg = str(err.value)
    assert "NoSuchName" in msg
    assert "cotserve_no_such_pkg.mod (no such module)" in msg and "collections (no NoSuchName)" in msg


def test_lookup_keeps_the_error_of_a_module_whose_own_import_fails(tmp_path, monkeypatch):
    (tmp_path / "cotserve_broken_mod.py").write_text("import cotserve_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as err:
        compat.lookup("X", ("cotserve_broken_mod",))
    assert err.value.name == "cotserve_missing_dependency"


def test_a_lazy_name_vllm_lacks_fails_with_the_lookup_error(monkeypatch):
    monkeypatch.setitem(compat.LAZY, "NoSuchVLLMName", ("cotserve_no_such_pkg.mod", "collections"))
    with pytest.raises(compat.MissingInVLLM, match="NoSuchVLLMName"):
        compat.NoSuchVLLMName  # noqa: B018
    assert "NoSuchVLLMName" not in vars(compat)


def test_every_name_the_plugin_takes_from_the_installed_vllm_is_there():
    pytest.importorskip("vllm")
    for name, modules in compat.LAZY.items():
        assert compat.lookup(name, modules) is not None, name
    for base in compat.MODEL_CLASSES:
        assert compat.model_class(base).__name__ == base
    assert compat.lookup("Attention", compat.ATTENTION_LAYER).__name__ == "Attention"
    assert callable(compat.lookup("get_layers_from_vllm_config", "vllm.config"))
    backends = compat.lookup("AttentionBackendEnum", "vllm.v1.attention.backends.registry")
    assert {"CPU_ATTN", "CUSTOM"} <= set(backends.__members__)


@dataclass
class Metadata26:
    """The fields of vLLM 0.26's `CommonAttentionMetadata` that the host lengths touch, as 0.26
    defines them: `seq_lens_cpu` a deprecated property over `_seq_lens_cpu`, and
    `num_computed_tokens_cpu` derived from it unless the runner gave `_num_computed_tokens_cpu`."""

    seq_lens: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    _seq_lens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        warnings.warn("seq_lens_cpu is deprecated", DeprecationWarning, stacklevel=2)
        if self._seq_lens_cpu is None:
            self._seq_lens_cpu = self.seq_lens.to("cpu")
        return self._seq_lens_cpu

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        if self._num_computed_tokens_cpu is None:
            q = self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]
            self._num_computed_tokens_cpu = self.seq_lens_cpu - q
        return self._num_computed_tokens_cpu


def _metadata26() -> Metadata26:
    lens = torch.tensor([40, 25, 9], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    # a device other than the host (the meta device: no data), as the GPU's lengths are
    return Metadata26(seq_lens=torch.empty(3, dtype=torch.int32, device="meta"), query_start_loc_cpu=qsl,
                      seq_lens_cpu_upper_bound=lens, _seq_lens_cpu=lens, _num_computed_tokens_cpu=lens - 1)


def test_host_lens_reads_the_field_behind_a_deprecated_property():
    cm = _metadata26()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.host_lens(cm).tolist() == [40, 25, 9]


def test_set_host_lens_rewrites_the_copy_and_drops_what_vllm_derives_from_the_lengths():
    src = _metadata26()
    out = compat.metadata_with(src)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.set_host_lens(out, src, 2, torch.tensor([16, 12], dtype=torch.int32))
        assert compat.host_lens(out).tolist() == [16, 12, 9]
    assert out.seq_lens_cpu_upper_bound.tolist() == [16, 12, 9]
    # vLLM derives the computed tokens again, from the new lengths
    assert out._num_computed_tokens_cpu is None and out.num_computed_tokens_cpu.tolist() == [15, 11, 8]
    # vLLM's own metadata is left as it was
    assert src._seq_lens_cpu.tolist() == [40, 25, 9] and src.seq_lens_cpu_upper_bound.tolist() == [40, 25, 9]
    assert src._num_computed_tokens_cpu.tolist() == [39, 24, 8]


def test_set_host_lens_leaves_an_absent_host_copy_absent():
    src = replace(_metadata26(), _seq_lens_cpu=None)  # 0.26 under asynchronous speculative decoding
    out = compat.metadata_with(src)
    compat.set_host_lens(out, src, 1, torch.tensor([7], dtype=torch.int32))
    assert out._seq_lens_cpu is None and src._seq_lens_cpu is None
    assert out.seq_lens_cpu_upper_bound.tolist() == [7, 25, 9]
