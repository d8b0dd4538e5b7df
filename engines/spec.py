"""What an engine is built from, whole and checked once: ``EngineSpec`` (issue 35, step 3).

The server builds one from its settings per device (``orchestrator.settings.Settings.engine_spec``)
and hands it to the factory (``engines.runtime.factory.build_engine``), which hands it on to the
backend.  ``check_engine_options`` is the one check of these values: the spec runs it, and so do
the server's settings (naming each value by its environment variable) and the PyTorch backend's
own options.  Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engines.config import BACKENDS, COMPILE_MODES, GPU_ARCH_MODES, KV_CACHE_MODES, WEIGHT_MODES, WindowMode

GIB = 1 << 30


class SpecError(ValueError):
    """An engine option that cannot be used, or options that do not go together."""


@dataclass(frozen=True)
class MemorySettings:
    """What the operator sets of the engine's device-memory plan (engines/runtime/memory_plan.py;
    ``PERSONAPLEX_MEMORY_*``, ``..._PREFILL_CACHE_GB``, ``..._CONCURRENT_JOINS``)."""

    # Plan at all (on CUDA, or on any device with ``limit_bytes``); the benchmarks size their
    # engines themselves.
    enabled: bool = True
    # The most device memory the engine plans with; None = the device's own, less what it
    # holds before the engine loads (other processes, the CUDA context).
    limit_bytes: int | None = None
    # Kept free beside every planned item (allocator rounding, workspaces of new shapes).
    margin_bytes: int = GIB
    # What the cache of prepared prompts may keep on the device (0: none are kept).
    prefill_cache_bytes: int = 2 * GIB
    # Joins prepared at once (the scheduler holds the others back): the plan reserves the
    # longest prompt's peak for each.
    concurrent_joins: int = 1
    # How the operator names the session count, in the plan's refusal.
    sessions_setting: str = "max_sessions"

    def __post_init__(self) -> None:
        if self.concurrent_joins < 1:
            raise SpecError(f"concurrent_joins must be >= 1, got {self.concurrent_joins}")
        for name in ("margin_bytes", "prefill_cache_bytes"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.limit_bytes is not None and self.limit_bytes <= 0:
            raise SpecError(f"limit_bytes must be > 0, got {self.limit_bytes}")


def check_engine_options(values: dict[str, Any], name: Callable[[str], str] = str) -> None:
    """Check the engine options among ``values`` (by ``EngineSpec``'s field names; those absent
    are not checked); ``name(field)`` is how a message names one (an environment variable, for
    the server).  Raises ``SpecError``."""
    choices = {"window": WindowMode.ALL, "kv_cache": KV_CACHE_MODES, "weights": WEIGHT_MODES,
               "compile": COMPILE_MODES, "precompile": ("on", "off"), "backend": BACKENDS,
               "gpu_arch": GPU_ARCH_MODES}
    for key, allowed in choices.items():
        if key in values and values[key] not in allowed:
            raise SpecError(f"{name(key)} must be one of {', '.join(allowed)}, got {values[key]!r}")
    backend = values.get("backend", "torch")
    if backend != "torch" and values.get("weights", "auto") != "auto":
        raise SpecError(f"{name('weights')}={values['weights']} needs {name('backend')}=torch (a TensorRT-LLM "
                        "engine's weight precision is fixed when it is built)")
    if backend != "torch" and values.get("kv_cache") == "int8":
        # (fp8 is only warned about there: a build converted with --kv-cache-dtype fp8 has it.)
        raise SpecError(f"{name('kv_cache')}=int8 needs {name('backend')}=torch (a TensorRT-LLM engine's KV "
                        "cache dtype is fixed when its checkpoint is converted: --kv-cache-dtype)")
    if backend == "trtllm" and "checkpoint" in values and values["checkpoint"] is None:
        raise SpecError(f"{name('backend')}=trtllm needs {name('checkpoint')} set to a build directory written "
                        "by convert_checkpoint.py")
    if "checkpoint" in values:
        from engines.checkpoints.random_weights import random_model_name

        try:
            random_model = random_model_name(values["checkpoint"])
        except ValueError as exc:
            raise SpecError(f"{name('checkpoint')}: {exc}") from None
        if random_model is not None and backend != "torch":
            raise SpecError(f"{name('checkpoint')}={values['checkpoint']} (random weights) needs "
                            f"{name('backend')}=torch")
    if values.get("cpu_threads", 0) < 0:
        raise SpecError(f"{name('cpu_threads')} must be >= 0, got {values['cpu_threads']}")


@dataclass(frozen=True)
class EngineSpec:
    # A checkpoint directory, a Hugging Face repo id, "random:<model>", or None: the embedded
    # tiny demo model (engines/runtime/factory.py).
    checkpoint: str | Path | None = None
    # Session slots; None: as many as the memory plan fits (the torch backend).
    max_slots: int | None = None
    device: str = "cpu"
    backend: str = "torch"
    window: str = WindowMode.REFERENCE
    kv_cache: str = "auto"
    compile: str = "auto"  # auto (on for CUDA), on, off
    # torch.compile's portable artifacts (engines/fastpath/compile_artifacts.py): "auto" = in
    # the cache directory, "off", or a directory.
    compile_artifacts: str = "auto"
    # Compiled pieces kept whole beside the artifacts, loaded without tracing
    # (engines/fastpath/precompiled.py): "on", or "off": torch.compile at every start.
    precompile: str = "on"
    weights: str = "auto"
    voice_dir: str | Path | None = None  # more voices, served ahead of the checkpoint's
    cpu_threads: int = 0  # torch's intra-op threads for an engine on the CPU; 0: torch's default
    # The GPU's compute capability as the engine takes it: "auto" (the device's), or a profile
    # ("sm80", ...) that makes a newer GPU take what that one would (engines/fastpath/gpu_arch.py).
    gpu_arch: str = "auto"
    memory: MemorySettings = field(default_factory=MemorySettings)

    def __post_init__(self) -> None:
        check_engine_options({f: getattr(self, f) for f in self.__dataclass_fields__})
        if self.max_slots is not None and self.max_slots < 1:
            raise SpecError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_slots is None and self.backend != "torch":
            raise SpecError("the TensorRT-LLM backend admits the sessions its build was made for: give max_slots")

    @property
    def compiled(self) -> bool:
        """Whether to torch.compile: pays off on a GPU (fewer kernels in the tick graph); on
        CPU the exact eager path is the reference."""
        return self.compile == "on" or (self.compile == "auto" and self.device.startswith("cuda"))
