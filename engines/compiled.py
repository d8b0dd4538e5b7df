"""``torch.compile`` as the GPU fast path uses it: one policy for every compiled piece.

Dynamic shapes, so one compilation of a function serves every batch bucket of the tick
graphs; no graph breaks by default, since a break would quietly split a piece back into
eager kernels.  Only the GPU path compiles (``EngineOptions.compile``); the CPU reference
path stays eager.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# Variants dynamo keeps per function before it quietly falls back to eager (8 by default):
# a size-1 and a dynamic batch, per module instance (the encoder and decoder share SEANet's
# code), per device (one engine per GPU in one process).
COMPILED_VARIANTS = 64


def compile_dynamic(fn: F, fullgraph: bool = True) -> F:
    """``fn`` compiled with dynamic shapes (and, with ``fullgraph``, no graph breaks)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILED_VARIANTS)
    return torch.compile(fn, dynamic=True, fullgraph=fullgraph)
