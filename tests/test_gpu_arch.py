"""The GPU's capability as the engine takes it (engines/fastpath/gpu_arch.py, issue 37): what it
decides on each profile, forced or real, without a GPU (the CUDA queries are stood in for),
and how a setting the GPU cannot run is refused: one line at start."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.errors import GpuArchError
from engines.fastpath import attention, fp8_gemv, gpu_arch, kv_write
from engines.model.layers import fp8_matmul_for
from engines.runtime.torch_engine import EngineOptions, check_gpu
from orchestrator.settings import Settings, SettingsError
from orchestrator.settings_help import settings_help

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_profile():
    """Each test starts from "auto" with nothing decided, and leaves it so."""
    gpu_arch.configure("auto")
    gpu_arch._seen.clear()
    yield
    gpu_arch.configure("auto")
    gpu_arch._seen.clear()


def _gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    """Stand in for torch's CUDA queries: one GPU of ``capability``."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def _decisions() -> dict[str, object]:
    return {"attention bf16": attention.available(CUDA), "attention fp8": attention.available(CUDA, fp8=True),
            "kv write": kv_write.available(CUDA, 128), "fp8 gemv": fp8_gemv.device_available(CUDA),
            "fp8 matmul": fp8_matmul_for(CUDA)}


@pytest.mark.parametrize("profile, e4m3", [("sm80", False), ("sm86", False), ("sm89", True), ("sm90", True)])
def test_each_profile_decides_e4m3(profile, e4m3):
    from engines.config import GPU_ARCH_PROFILES

    assert gpu_arch.has_fp8_e4m3(GPU_ARCH_PROFILES[profile]) == e4m3


def test_an_h200_forced_to_sm80_takes_what_an_a100_takes(monkeypatch, caplog):
    _gpu(monkeypatch, (9, 0), "NVIDIA H200")
    native = _decisions()
    assert native == {"attention bf16": True, "attention fp8": True, "kv write": True, "fp8 gemv": True,
                      "fp8 matmul": "scaled_mm"}
    gpu_arch.configure("sm80")
    with caplog.at_level(logging.INFO, logger="engines.fastpath.gpu_arch"):
        forced = _decisions()
        gpu_arch.capability(CUDA)
    assert gpu_arch.capability(CUDA) == (8, 0)
    assert forced == {"attention bf16": True, "attention fp8": False, "kv write": False, "fp8 gemv": False,
                      "fp8 matmul": "w8a16"}
    # Decided once, logged once.
    assert [r.getMessage() for r in caplog.records] == [
        "cuda:0 (NVIDIA H200): compute capability 9.0 taken as 8.0 (PERSONAPLEX_GPU_ARCH=sm80): no fp8 e4m3 kernel, "
        "no scaled_mm"]
    with pytest.raises(ValueError, match=r"scaled_mm' needs .* 8.9 or newer; cuda:0 \(NVIDIA H200\) is 9.0, taken as "
                                         r"8.0 \(PERSONAPLEX_GPU_ARCH=sm80\): use 'w8a16'"):
        fp8_matmul_for(CUDA, "scaled_mm")


def test_a_real_a100_takes_the_same(monkeypatch):
    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    assert _decisions() == {"attention bf16": True, "attention fp8": False, "kv write": False, "fp8 gemv": False,
                            "fp8 matmul": "w8a16"}
    assert gpu_arch.describe(CUDA) == "cuda:0 (NVIDIA A100-SXM4-80GB) is 8.0"


def test_a_profile_cannot_raise_the_capability(monkeypatch):
    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    gpu_arch.configure("sm90")
    with pytest.raises(GpuArchError, match=r"^PERSONAPLEX_GPU_ARCH=sm90 asks for compute capability 9.0, but cuda:0 "
                                           r"\(NVIDIA A100-SXM4-80GB\) is 8.0: a profile can only lower it"):
        gpu_arch.capability(CUDA)
    with pytest.raises(ValueError, match="gpu arch must be one of auto, sm80, sm86, sm89, sm90"):
        gpu_arch.configure("sm75")


def test_cpu_takes_no_gpu_kernel_and_asks_no_gpu():
    cpu = torch.device("cpu")
    assert not gpu_arch.e4m3_kernels(cpu) and not attention.available(cpu) and not kv_write.available(cpu, 128)
    assert fp8_matmul_for(cpu) == "w8a16"


def test_an_fp8_kv_cache_below_8_9_is_refused_at_start_in_one_line(monkeypatch):
    _gpu(monkeypatch, (9, 0), "NVIDIA H200")
    check_gpu(EngineOptions(device="cuda:0", kv_cache="fp8"))  # the H200 itself runs it
    check_gpu(EngineOptions(device="cuda:0", weights="fp8", gpu_arch="sm80"))  # fp8 weights: W8A16 there
    with pytest.raises(GpuArchError) as refused:
        check_gpu(EngineOptions(device="cuda:0", kv_cache="fp8", gpu_arch="sm80"))
    line = str(refused.value)
    assert "\n" not in line
    assert line == ("PERSONAPLEX_KV_CACHE=fp8 needs fp8 e4m3 kernels, which need a GPU of compute capability 8.9 or "
                    "newer; cuda:0 (NVIDIA H200) is 9.0, taken as 8.0 (PERSONAPLEX_GPU_ARCH=sm80): set "
                    "PERSONAPLEX_KV_CACHE=int8 (the same memory, no e4m3) or auto")


def test_the_refusal_comes_through_the_factory(monkeypatch):
    """From the server's spec down to the engine's start, before any weight is made."""
    import engines.fastpath.compiled
    from engines.runtime.factory import create_engine

    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(engines.fastpath.compiled, "use_persistent_caches", lambda: None)
    with pytest.raises(GpuArchError, match=r"^PERSONAPLEX_KV_CACHE=fp8 needs .* cuda:0 \(NVIDIA A100-SXM4-80GB\) is "
                                           r"8.0: set PERSONAPLEX_KV_CACHE=int8 \(the same memory, no e4m3\) or auto$"):
        create_engine("random:tiny", device="cuda:0", max_slots=1, kv_cache="fp8", compile="off")


def test_the_server_logs_the_refusal_as_one_line(caplog):
    from orchestrator.lockstep.loading import EngineLoad

    def refuse():
        raise GpuArchError("PERSONAPLEX_KV_CACHE=fp8 needs fp8 e4m3 kernels")

    load = EngineLoad(refuse, warmup_frames=0, device="cuda:0")
    with caplog.at_level(logging.ERROR):
        assert load.run() is None
    assert isinstance(load.error, GpuArchError)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == ("engine failed to load (device cuda:0): PERSONAPLEX_KV_CACHE=fp8 needs fp8 e4m3 "
                                   "kernels")
    assert record.exc_info is None  # what the operator gave: no traceback


def test_the_setting_reaches_the_engine_and_is_checked():
    spec = Settings(gpu_arch="sm80").engine_spec("cuda:0")
    assert spec.gpu_arch == "sm80" and EngineOptions.from_spec(spec).gpu_arch == "sm80"
    assert Settings.from_mapping({"gpu_arch": "sm86"}).gpu_arch == "sm86"
    assert Settings().gpu_arch == "auto"
    with pytest.raises(SettingsError, match=r"^PERSONAPLEX_GPU_ARCH must be one of auto, sm80, sm86, sm89, sm90, "
                                            r"got 'sm75'$"):
        Settings.from_mapping({"gpu_arch": "sm75"})
    with pytest.raises(ValueError, match="gpu_arch must be one of"):
        EngineOptions(gpu_arch="a100")
    assert "--gpu-arch / PERSONAPLEX_GPU_ARCH (default auto)" in settings_help()
