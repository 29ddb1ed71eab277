"""Which policy combinations a vLLM request may ask for (`cotserve.vllm.batch_rows.request_policy_of`),
per platform: an eviction policy with SFI runs on both backends; any policy the vLLM engine does
not run is refused with a clear error when it arrives; h2o runs alone (with steering) on both,
within its score buffers' length."""

from __future__ import annotations

import pytest

from cotserve.errors import PolicyError
from cotserve.vllm.batch_rows import request_policy_of


def _ask(policy: str, platform: str, **options):
    return request_policy_of({"cotserve": {"policy": policy, "options": options}}, platform=platform)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("evict", ["skipkv", "rkv", "streamingllm"])
def test_eviction_with_sfi_runs_on_both_backends(evict, platform):
    opts = {f"{evict}.budget": 256, "sfi.k": 64, "sfi.recent": 64}
    pol = _ask(f"{evict}+sfi", platform, **opts)
    assert pol.evict.name == evict and pol.evict.budget == 256
    assert pol.sfi.k == 64 and pol.sfi.recent == 64 and pol.sfi.dense_heads == 0
    both = _ask(f"{evict}+sfi+steering", platform, **opts, **{"steering.alpha0": 2.0})
    assert both.evict.name == evict and both.sfi.k == 64 and both.steer.config.alpha0 == 2.0
    assert _ask(evict, platform, budget=256).sfi is None  # each alone too
    assert _ask("sfi", platform, k=64).evict is None


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_h2o_runs_alone_and_with_steering(platform):
    pol = _ask("h2o", platform, budget=256, interval=16, group_reduce="max")
    assert pol.evict.name == "h2o" and pol.evict.budget == 256 and pol.evict.config.group_reduce == "max"
    both = _ask("h2o+steering", platform, **{"h2o.budget": 128, "steering.alpha0": 2.0})
    assert both.evict.name == "h2o" and both.steer.config.alpha0 == 2.0 and both.sfi is None


def test_h2o_within_the_score_buffers(monkeypatch):
    assert _ask("h2o", "cuda", budget=1024).evict.config.interval == 1  # the defaults fit the default 2048
    with pytest.raises(PolicyError, match=r"h2o budget \+ interval \(2064\) exceeds the vllm engine's 2048"):
        _ask("h2o", "cuda", budget=2048, interval=16)
    monkeypatch.setenv("COTSERVE_VLLM_H2O_MAX_LEN", "4096")
    assert _ask("h2o", "cuda", budget=2048, interval=16).evict.budget == 2048
    monkeypatch.setenv("COTSERVE_VLLM_H2O_MAX_LEN", "0")
    with pytest.raises(PolicyError, match="h2o is off"):
        _ask("h2o", "cpu", budget=64)


def test_combinations_that_stay_refused():
    for platform in ("cpu", "cuda"):  # the native engine refuses h2o+sfi too
        with pytest.raises(PolicyError, match=r"h2o\+sfi is not available on the vllm engine"):
            _ask("h2o+sfi", platform, **{"sfi.dense_heads": 0})
    with pytest.raises(PolicyError, match="'snapkv' is not available on the vllm engine"):
        _ask("snapkv+sfi", "cpu")
    with pytest.raises(PolicyError, match="dense_heads"):  # the unstable-head fallback is native-only
        _ask("skipkv+sfi", "cpu", **{"sfi.dense_heads": 0.1})
    with pytest.raises(PolicyError, match="window=32"):
        _ask("rkv+sfi", "cpu", **{"rkv.window": 32})


def test_sfi_is_served_beside_prefix_caching_and_computes_its_whole_prompt():
    """With prefix caching on, cotserve's engine serves SFI (check_policy passes it; eviction is
    refused there as before): its requests skip reading the prefix cache, so SFI's bootstrap sees
    the prompt's own last query rows; dense requests read cached prefixes."""
    from types import SimpleNamespace

    from cotserve.engine.native import GenRequest
    from cotserve.policies.registry import build_policy
    from cotserve.vllm.engine import VLLMEngine
    from cotserve.vllm.params import policy_extra_args, reads_whole_prompt, sampling_params

    caching = SimpleNamespace(evicting=False, prefix_caching=True, async_scheduling=True, steering_vector=None)
    VLLMEngine.check_policy(caching, build_policy("sfi", {}))
    VLLMEngine.check_policy(caching, build_policy("dense", {}))
    with pytest.raises(PolicyError, match="no-async-scheduling"):
        VLLMEngine.check_policy(caching, build_policy("skipkv+sfi", {}))
    req = GenRequest(request_id="r", prompt_ids=[1, 2, 3])
    for policy, whole in (("sfi", True), ("skipkv+sfi", True), ("dense", False), ("skipkv", False)):
        extra = policy_extra_args(build_policy(policy, {}))
        assert reads_whole_prompt(extra) is whole
        assert sampling_params(req, extra, 64).skip_reading_prefix_cache is whole


def test_a_plain_vllm_with_prefix_caching_decodes_sfi_densely(caplog):
    """In a vLLM started with prefix caching on (vllm serve's default), the row tracker hands an
    SFI request that may read a cached prefix to the backends as dense (with one warning), never as
    SFI over skipped queries; one that computes its whole prompt (as cotserve's are) runs SFI."""
    from types import SimpleNamespace

    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from cotserve.vllm.batch_rows import BatchRows
    from cotserve.vllm.logitsproc import RowTracker

    ours = SimpleNamespace(architectures=["CotserveLlamaForCausalLM"])  # an engine that asks for cotserve
    for caching in (True, False):
        tracker = RowTracker(SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=caching),
                                             model_config=ours), torch.device("cpu"), False)
        tracker.rows = BatchRows()
        params = SamplingParams(max_tokens=4, extra_args={"cotserve_policy": "sfi"})
        tracker.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                         added=[(0, params, [1, 2, 3], []), (1, params, [4, 5], [])]))
        assert all((r.sfi is None) == caching for r in tracker.rows.rows.values())
        whole = SamplingParams(max_tokens=4, extra_args={"cotserve_policy": "sfi"}, skip_reading_prefix_cache=True)
        tracker.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(2, whole, [1, 2, 3], [])]))
        assert tracker.rows.rows[2].sfi is not None
    assert sum("prefix caching is on" in r.message for r in caplog.records) == 1


def test_an_engine_that_did_not_ask_for_cotserve_gets_no_policy():
    """On a plain vLLM engine (vLLM's own model class, not started by cotserve) the row tracker gives
    no request a policy, even one whose extra_args ask for SFI or an eviction: cotserve's attention
    backend then runs vLLM's attention alone. cotserve's model class or cotserve's additional_config
    key turns it on."""
    from types import SimpleNamespace as NS

    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from cotserve.vllm.batch_rows import BatchRows
    from cotserve.vllm.gpu_memory import COTSERVE_CONFIG
    from cotserve.vllm.logitsproc import RowTracker

    cache = NS(enable_prefix_caching=False)
    plain = NS(cache_config=cache, model_config=NS(architectures=["LlamaForCausalLM"]), additional_config={})
    by_class = NS(cache_config=cache, model_config=NS(architectures=["CotserveLlamaForCausalLM"]))
    by_cotserve = NS(cache_config=cache, model_config=NS(architectures=["MistralForCausalLM"]),
                     additional_config={COTSERVE_CONFIG: {"engine": True}})
    asked = [SamplingParams(max_tokens=4, extra_args={"cotserve_policy": p}) for p in ("sfi", "skipkv", "h2o")]
    for config, engaged in ((plain, False), (by_class, True), (by_cotserve, True)):
        tracker = RowTracker(config, torch.device("cpu"), False)
        tracker.rows = BatchRows()
        tracker.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                         added=[(i, p, [1, 2, 3], []) for i, p in enumerate(asked)]))
        rows = tracker.rows.rows
        assert len(rows) == 3
        assert all((r.sfi, r.evict, r.steer) == (None, None, None) for r in rows.values()) != engaged


def test_additional_config_must_be_an_object():
    """cotserve adds its own key to vLLM's additional_config; another form is refused clearly."""
    import torch

    from cotserve.errors import ModelError
    from cotserve.vllm.engine import VLLMEngine, VLLMOptions

    with pytest.raises(ModelError, match="additional_config takes a JSON object"):
        VLLMEngine._config("m", "auto", torch.device("cpu"), VLLMOptions(extra={"additional_config": "x"}))
