"""The one place that imports TensorRT and TensorRT-LLM.

Neither can be installed on CPU/CI machines (PyPI holds stub sdists that fetch the real
wheels from pypi.nvidia.com; ``import tensorrt_llm`` also needs ``libcuda.so.1``), so every
use goes through these functions, called when a backend is created, never at import time.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engines.interface import EngineError

TRTLLM_VERSION = "1.2.1"  # the last release with trtllm-build and the engine runtime

INSTALL_HINT = (
    f"install TensorRT-LLM {TRTLLM_VERSION} (it brings TensorRT 10.14) on a machine with an NVIDIA GPU and "
    "driver: the NGC TensorRT-LLM release container, or pip install tensorrt-llm=="
    f"{TRTLLM_VERSION} from https://pypi.nvidia.com; or serve with PERSONAPLEX_BACKEND=torch"
)


class BackendUnavailable(EngineError):
    """The TensorRT-LLM backend cannot start: packages, engine files or GPU missing."""

    code = "engine_unavailable"


def _import(name: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or OSError from a missing libcuda / libnvinfer
        raise BackendUnavailable(
            f"{purpose} needs the {name!r} package, which cannot be imported here "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc


def require_tensorrt_llm(module: str = "tensorrt_llm") -> ModuleType:
    """``tensorrt_llm`` or one of its modules (imports TensorRT too), or
    ``BackendUnavailable`` saying what to do."""
    return _import(module, "PERSONAPLEX_BACKEND=trtllm")


def require_tensorrt() -> ModuleType:
    """``tensorrt`` for the Mimi / depformer plans."""
    return _import("tensorrt", "running TensorRT plans")
