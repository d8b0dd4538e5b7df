"""``torch.compile`` as the GPU fast path uses it: one policy for every compiled piece.

Dynamic shapes, so one compilation of a function serves every batch bucket of the tick
graphs; no graph breaks by default, since a break would quietly split a piece back into
eager kernels.  Only the GPU path compiles (``EngineOptions.compile``); the CPU reference
path stays eager.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TypeVar

import torch

from engines.config import default_cache_dir

F = TypeVar("F", bound=Callable)
T = TypeVar("T")

# Variants dynamo keeps per function before it quietly falls back to eager (8 by default):
# a size-1 and a dynamic batch, per module instance (the encoder and decoder share SEANet's
# code), per device (one engine per GPU in one process).
COMPILED_VARIANTS = 64


def use_persistent_caches(root: str | Path | None = None) -> Path:
    """Keep torch.compile's on-disk caches (Inductor's FX graphs, AOTAutograd entries and
    autotuning results; Triton's compiled kernels) under ``root`` (default: the project's
    cache directory, ``compile/`` in it) instead of Inductor's default under /tmp, which a
    container loses: a restart then finds every compiled piece of the tick.  An operator's
    own ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` win.  Both are read when a
    compilation happens, so this has to run before the first one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    base = Path(root) if root is not None else default_cache_dir() / "compile"
    # Importing torch._dynamo writes Inductor's default into the environment: that value is
    # Inductor's, not the operator's.
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(inductor_default()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(base / "triton"))
    return base


def static_shapes(tensors: T) -> T:
    """``tensors`` (a tensor, or tuples of them and None, nested) with their shapes marked
    static for ``compile_dynamic``'d functions they are passed to, and returned.

    With dynamic shapes every dimension of every tensor argument gets a symbol unless it is an
    ``nn.Parameter``'s; slices of parameters (one depformer step's weights) are not, so each of
    their dimensions became a symbol that tracing, Inductor's reasoning and every guard check
    carried.  Marked static, the depformer step (6 layers, 3 variants, 7B shapes) compiled in
    44 s instead of 86 s and loaded from the caches in 9 s instead of 26 s (2-core CPU,
    Inductor's C++ backend: docs/PERFORMANCE.md, "Start-up budgets").  The mark lives on the
    tensor object: keep the marked objects and pass those same ones on every call."""
    import torch._dynamo

    if isinstance(tensors, torch.Tensor):
        torch._dynamo.mark_static(tensors)
    elif isinstance(tensors, tuple):
        for item in tensors:
            static_shapes(item)
    elif tensors is not None:
        raise TypeError(f"static_shapes takes tensors, tuples of them and None, not {type(tensors).__name__}")
    return tensors


def compile_dynamic(fn: F, fullgraph: bool = True) -> F:
    """``fn`` compiled with dynamic shapes (and, with ``fullgraph``, no graph breaks), its
    compilations cached where a restart finds them (``use_persistent_caches``).  While an
    engine is built (``precompiled.storing_in``), a ``fullgraph`` piece is compiled ahead of
    time and saved whole, so that a restart loads it without tracing (``precompiled``)."""
    from engines.fastpath import precompiled

    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as shape_config

    use_persistent_caches()
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILED_VARIANTS)
    # No "duck sizing": by default two dimensions of equal size when first traced share one
    # symbol, and Mimi's transformer sees its batch and its time steps both at 2 in the
    # 2-slot graph, so the 4-slot graph compiled everything again (seconds at every start;
    # docs/PERFORMANCE.md, "Start-up on the H200").
    shape_config.use_duck_shape = False
    directory = precompiled.current_directory()
    # aot_compile takes no graph breaks, and a nested function or a lambda has no name that
    # another process would find it by.
    if directory is not None and fullgraph and "<" not in getattr(fn, "__qualname__", "<"):
        return precompiled.Precompiled(fn, directory)  # type: ignore[return-value]
    return torch.compile(fn, dynamic=True, fullgraph=fullgraph)
