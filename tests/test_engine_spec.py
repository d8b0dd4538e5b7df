"""The engine spec (engines/spec.py): what an engine is built from, checked once, by one check
that the server's settings share (naming each value by its environment variable)."""

from __future__ import annotations

import pytest

from engines.spec import EngineSpec, SpecError
from orchestrator.settings import Settings, SettingsError


@pytest.mark.parametrize("field, value, words", [
    ("kv_cache", "int4", "must be one of auto, fp8, int8, got 'int4'"),
    ("window", "sideways", "must be one of"),
    ("compile", "maybe", "must be one of auto, on, off"),
    ("backend", "onnx", "must be one of torch, trtllm"),
    ("checkpoint", "random:huge", "unknown random model"),
])
def test_one_check_for_the_engine_and_the_settings(field, value, words):
    with pytest.raises(SpecError, match=f"^{field}.*{words}"):
        EngineSpec(**{field: value})
    with pytest.raises(SettingsError, match=f"^PERSONAPLEX_{field.upper()}.*{words}"):
        Settings.from_mapping({field: value})


def test_options_that_do_not_go_together():
    with pytest.raises(SpecError, match="weights=fp8 needs backend=torch"):
        EngineSpec("build/x", max_slots=2, backend="trtllm", weights="fp8")
    with pytest.raises(SettingsError, match="PERSONAPLEX_WEIGHTS=fp8 needs PERSONAPLEX_BACKEND=torch"):
        Settings.from_mapping({"backend": "trtllm", "weights": "fp8", "checkpoint": "."})
    with pytest.raises(SpecError, match="random weights.*needs backend=torch"):
        EngineSpec("random:tiny", max_slots=2, backend="trtllm")
    with pytest.raises(SpecError, match="give max_slots"):
        EngineSpec("build/x", backend="trtllm")
    with pytest.raises(SpecError, match="max_slots must be >= 1"):
        EngineSpec(max_slots=0)


def test_the_settings_give_the_engine_one_spec_and_the_backend_its_options():
    from engines.runtime.torch_engine import EngineOptions

    spec = Settings(kv_cache="fp8", compile="on", concurrent_joins=2, max_sessions=5).engine_spec("cpu")
    assert (spec.max_slots, spec.kv_cache, spec.device, spec.memory.concurrent_joins) == (5, "fp8", "cpu", 2)
    options = EngineOptions.from_spec(spec, depformer_steps=16)
    assert (options.kv_cache, options.compile, options.memory, options.depformer_steps) == ("fp8", True, spec.memory, 16)
    assert EngineSpec(device="cuda:1").compiled and not EngineSpec(device="cpu").compiled
