"""Errors raised while reading user-supplied files (checkpoints, voices, audio)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or holds a missing or mis-shaped tensor.

    The message always names the file and, where relevant, the tensor.
    """


class AudioInputError(ValueError):
    """An audio file cannot be read or is not usable as model input."""


class MemoryPlanError(RuntimeError):
    """The configured sessions do not fit the device's memory plan
    (``engines.runtime.memory_plan``).  Its message is one line for the operator: what was
    asked, the largest that fits, and the plan's items."""


class GpuArchError(RuntimeError):
    """The GPU (or the profile ``PERSONAPLEX_GPU_ARCH`` forces) lacks what a setting needs,
    such as fp8 e4m3 kernels below compute capability 8.9 (``engines.fastpath.gpu_arch``).
    Its message is one line for the operator: the setting, the GPU, what to set instead."""
