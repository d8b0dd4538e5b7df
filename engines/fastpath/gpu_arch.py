"""The GPU's compute capability as the engine sees it: the one place where the engine asks what
a GPU can run (issue 37).

What depends on it is fp8 e4m3: fp8 tensor cores (``torch._scaled_mm``) exist from compute
capability 8.9 (Ada, Hopper), and Triton refuses e4m3 types when it compiles for an older
target ("type fp8e4nv not supported in this architecture", Triton 3.9 for sm_80).  So on an
A100 (8.0) or an A10 (8.6) the engine takes none of its e4m3 kernels (the fp8 decode
attention, the fused fp8 KV write, the few-row fp8 product) and no scaled_mm;
``python -m engines.tools.check_targets`` compiles every kernel for each target to hold that.

``PERSONAPLEX_GPU_ARCH`` forces a profile (``engines.config.GPU_ARCH_PROFILES``): ``sm80``
makes an H200 take exactly the kernels an A100 would, so the A100 path can be run on the GPU
at hand.  A profile can only lower the capability: kernels of a newer GPU would not run.
(torch.compile's own generated kernels still follow the real device.)

The profile is the process's (the server runs one engine per process): the engine sets it at
start (``configure``), then ``capability`` answers from a cache, logged once per device.  The
hot path (``fp8_gemv.available``, traced by torch.compile) reads only that cache.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from engines.config import GPU_ARCH_MODES, GPU_ARCH_PROFILES
from engines.errors import GpuArchError

log = logging.getLogger(__name__)

SETTING = "PERSONAPLEX_GPU_ARCH"
# fp8 e4m3 tensor cores, and Triton's e4m3 types, from here up.
E4M3_MIN = (8, 9)

_profile = "auto"
# Per CUDA device index: (capability taken, real capability, device name).
_seen: dict[int, tuple[tuple[int, int], tuple[int, int], str]] = {}
# check_targets and tests: every CUDA device taken to be of this capability, no GPU asked.
_simulated: tuple[int, int] | None = None


def has_fp8_e4m3(capability: tuple[int, int]) -> bool:
    """Whether a GPU of ``capability`` runs fp8 e4m3 (tensor cores, Triton's e4m3 types)."""
    return tuple(capability) >= E4M3_MIN


def configure(profile: str = "auto") -> None:
    """Set the process's profile (``auto`` or a key of ``GPU_ARCH_PROFILES``); a change
    forgets what was decided under the previous one."""
    global _profile
    if profile not in GPU_ARCH_MODES:
        raise ValueError(f"gpu arch must be one of {', '.join(GPU_ARCH_MODES)}, got {profile!r}")
    if profile != _profile:
        _profile = profile
        _seen.clear()


def capability(device: torch.device | str) -> tuple[int, int]:
    """``device``'s compute capability as the engine takes it: the real one, or the forced
    profile's.  ``GpuArchError`` where the profile is above the real one."""
    if _simulated is not None:
        return _simulated
    return _entry(device)[0]


def e4m3_kernels(device: torch.device) -> bool:
    """Whether the engine runs fp8 e4m3 kernels on ``device``: a CUDA device of 8.9 or newer."""
    return device.type == "cuda" and has_fp8_e4m3(capability(device))


def describe(device: torch.device | str) -> str:
    """``device`` in an operator's words: "cuda:0 (NVIDIA A100-SXM4-80GB) is 8.0", or "... is
    9.0, taken as 8.0 (PERSONAPLEX_GPU_ARCH=sm80)"."""
    if _simulated is not None:
        return f"{device} is taken as {_text(_simulated)}"
    taken, real, name = _entry(device)
    text = f"{_index(device)} ({name}) is {_text(real)}"
    return text if taken == real else f"{text}, taken as {_text(taken)} ({SETTING}={_profile})"


def require_e4m3(device: torch.device, what: str, instead: str) -> None:
    """Refuse ``what`` (a setting, as the operator wrote it) on a CUDA ``device`` without e4m3
    kernels: one line naming the GPU and ``instead``."""
    if device.type == "cuda" and not e4m3_kernels(device):
        raise GpuArchError(f"{what} needs fp8 e4m3 kernels, which need a GPU of compute capability "
                           f"{_text(E4M3_MIN)} or newer; {describe(device)}: {instead}")


@contextlib.contextmanager
def simulated(cap: tuple[int, int]) -> Iterator[None]:
    """Within: every CUDA device is taken to be of capability ``cap``, no GPU asked (what
    check_targets asks the engine's decisions under)."""
    global _simulated
    before, _simulated = _simulated, tuple(cap)
    try:
        yield
    finally:
        _simulated = before


def _index(device: torch.device | str) -> str:
    device = torch.device(device) if isinstance(device, str) else device
    if device.type != "cuda":
        raise ValueError(f"{device} is not a CUDA device")
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def _entry(device: torch.device | str) -> tuple[tuple[int, int], tuple[int, int], str]:
    index = int(_index(device).split(":")[1])
    entry = _seen.get(index)
    if entry is None:
        entry = _seen[index] = _decide(index)
    return entry


def _decide(index: int) -> tuple[tuple[int, int], tuple[int, int], str]:
    real = tuple(torch.cuda.get_device_capability(index))
    name = torch.cuda.get_device_name(index)
    taken = real if _profile == "auto" else GPU_ARCH_PROFILES[_profile]
    if taken > real:
        raise GpuArchError(f"{SETTING}={_profile} asks for compute capability {_text(taken)}, but cuda:{index} "
                           f"({name}) is {_text(real)}: a profile can only lower it (kernels of a newer GPU "
                           f"would not run); set {SETTING}=auto")
    e4m3 = "fp8 e4m3 kernels and scaled_mm on" if has_fp8_e4m3(taken) else "no fp8 e4m3 kernel, no scaled_mm"
    if taken == real:
        log.info("cuda:%d (%s): compute capability %s: %s", index, name, _text(real), e4m3)
    else:
        log.warning("cuda:%d (%s): compute capability %s taken as %s (%s=%s): %s", index, name, _text(real),
                    _text(taken), SETTING, _profile, e4m3)
    return taken, real, name


def _text(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"
