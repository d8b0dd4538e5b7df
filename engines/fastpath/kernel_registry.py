"""Every Triton kernel the engine may launch, as it launches it at the 7B shapes, with the
engine's own decision to take it on a GPU: what ``python -m engines.tools.check_targets``
compiles for each target (issue 37).

One entry per launch variant that differs in what the compiler sees (an e4m3 pointer or a
bf16 one, a head size, a K that fills the block or not).  The shapes are the 7B model's
(engines/config.py: head_dim 128, context 3000, dim 4096, FFN 11264; the depformer's FFN 2816)
and Mimi's transformer (float32, head_dim 64, context 250); the constants are the modules'
own.  ``taken(device)`` calls the module's availability test, so that the check follows what
the engine decides (``gpu_arch``), not a copy of it.  A ``@triton.jit`` function under
``engines/`` that is neither a registered kernel nor a registered kernel's helper fails the
check (``unregistered``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

try:
    import triton
except ImportError:  # CPU-only installs: nothing is compiled, nothing to register
    triton = None

ENGINES = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class KernelLaunch:
    name: str  # module.kernel[variant]
    fn: Any  # the JITFunction
    types: dict[str, str]  # runtime argument -> Triton type ("*bf16", "i32", "fp32")
    constexprs: dict[str, Any]
    taken: Callable[[torch.device], bool]  # the engine's decision on a CUDA device
    num_warps: int = 4
    num_stages: int = 3
    helpers: tuple = field(default=())  # @triton.jit functions it calls (compiled into it)

    def signature(self) -> dict[str, str]:
        """Every argument in order, constexprs marked so (``triton.compile``'s form)."""
        missing = set(self.fn.arg_names) - set(self.types) - set(self.constexprs)
        if missing:
            raise ValueError(f"{self.name}: no type for {sorted(missing)}")
        return {a: "constexpr" if a in self.constexprs else self.types[a] for a in self.fn.arg_names}

    def attrs(self) -> dict[tuple[int], list]:
        """Pointers 16-byte aligned, as torch allocates them (what a launch would specialize)."""
        return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(self.fn.arg_names)
                if self.types.get(a, "").startswith("*")}


def _ints(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


def _attention() -> list[KernelLaunch]:
    from engines.fastpath import attention as a

    strides = _ints("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_kc", "stride_vs", "stride_vh",
                    "stride_vc", "stride_ss", "stride_sh", "stride_ab", "stride_ah", "stride_as", "stride_mb",
                    "stride_mh", "capacity")

    def partial(variant: str, q: str, kv: str, head_dim: int, block: int, fp8: bool) -> KernelLaunch:
        types = dict(Q=q, K=kv, V=kv, KScale="*fp32", VScale="*fp32", Slots="*i64", QPos="*i64", Lo="*i64",
                     Acc="*fp32", Max="*fp32", Sum="*fp32", sm_scale="fp32", **strides)
        scaled = kv in ("*fp8e4nv", "*i8")  # an 8-bit cache: its values times their scales
        consts = dict(HEAD_DIM=head_dim, BLOCK_N=block, SPLIT=2 * block, NUM_STAGES=a.NUM_STAGES, SCALED=scaled)
        return KernelLaunch(f"attention._partial_kernel[{variant}]", a._partial_kernel, types, consts,
                            lambda d: a.available(d, fp8=fp8), a.NUM_WARPS, a.NUM_STAGES)

    def merge(variant: str, out: str, head_dim: int) -> KernelLaunch:
        types = dict(Acc="*fp32", Max="*fp32", Sum="*fp32", Out=out, n_split="i32",
                     **_ints("stride_ab", "stride_ah", "stride_as", "stride_mb", "stride_mh", "stride_ob", "stride_oh"))
        # Taken with the partial kernel of either cache (it reads float32 partials only).
        return KernelLaunch(f"attention._merge_kernel[{variant}]", a._merge_kernel, types,
                            dict(HEAD_DIM=head_dim, SPLITS=16), lambda d: a.available(d), num_warps=1)

    return [
        partial("lm bf16 cache", "*bf16", "*bf16", 128, a.BLOCK_N, False),
        partial("lm fp8 cache", "*bf16", "*fp8e4nv", 128, a.BLOCK_N_8BIT, True),
        partial("lm int8 cache", "*bf16", "*i8", 128, a.BLOCK_N_8BIT, False),
        partial("mimi fp32", "*fp32", "*fp32", 64, a.BLOCK_N, False),
        merge("lm bf16", "*bf16", 128),
        merge("mimi fp32", "*fp32", 64),
    ]


def _kv_write() -> list[KernelLaunch]:
    from engines.fastpath import kv_write as w

    def write(kind: str, data: str, qmax: float, integer: bool) -> KernelLaunch:
        types = dict(K="*bf16", V="*bf16", KData=data, VData=data, KScale="*fp32", VScale="*fp32",
                     Slots="*i64", Ring="*i64", **_ints("stride_kr", "stride_kh", "stride_vr", "stride_vh",
                                                        "stride_ds", "stride_dh", "stride_dc", "stride_ss", "stride_sh"))
        return KernelLaunch(f"kv_write._write_kernel[lm {kind}]", w._write_kernel, types,
                            dict(HEAD_DIM=128, QMAX=qmax, INTEGER=integer),
                            lambda d: w.available(d, 128, fp8=not integer), num_warps=1,
                            helpers=(w._quantize_store, w._round_half_even))

    return [write("fp8", "*fp8e4nv", w.FP8_MAX, False), write("int8", "*i8", w.INT8_MAX, True)]


def _fp8_gemv() -> list[KernelLaunch]:
    from engines.fastpath import fp8_gemv as g

    types = dict(X="*bf16", W="*fp8e4nv", S="*fp32", Y="*bf16", **_ints("N", "K", "stride_xm", "stride_wn",
                                                                        "stride_ym"))

    def launch(rows: int, even_k: bool, where: str) -> KernelLaunch:
        consts = dict(ROWS=rows, BLOCK_N=g.BLOCK_N, BLOCK_K=g.BLOCK_K, EVEN_K=even_k)
        return KernelLaunch(f"fp8_gemv._fp8_rows_kernel[{rows} row{'s' if rows > 1 else ''}, {where}]",
                            g._fp8_rows_kernel, types, consts, g.device_available, g.NUM_WARPS, g.NUM_STAGES,
                            helpers=(g._rows_fma,))

    # K = 4096 and 11264 fill BLOCK_K = 512 (the temporal weights); the depformer's linear_out
    # (K = 2816) does not.
    return [launch(rows, even, "temporal" if even else "depformer out")
            for rows in range(1, g.GEMV_ROWS + 1) for even in (True, False)]


def launches() -> list[KernelLaunch]:
    """Every registered launch (none without Triton)."""
    if triton is None:
        return []
    return _attention() + _kv_write() + _fp8_gemv()


def jit_functions() -> dict[str, Any]:
    """Every ``@triton.jit`` function under ``engines/``, by ``module.name``: the modules whose
    source says ``triton.jit`` imported, their JIT functions collected; a module with more
    decorators than functions found (a kernel hidden where imports do not reach) is an error."""
    found: dict[str, Any] = {}
    if triton is None:  # the kernels' modules define none without it
        return found
    for path in sorted(ENGINES.rglob("*.py")):
        text = path.read_text()
        decorators = len(re.findall(r"^\s*@triton\.jit\b", text, re.MULTILINE))
        if not decorators:
            continue
        module = ".".join(path.relative_to(ENGINES.parent).with_suffix("").parts)
        namespace = vars(importlib.import_module(module))
        mine = {f"{module}.{name}": obj for name, obj in namespace.items()
                if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == module}
        if len(mine) != decorators:
            raise RuntimeError(f"{module}: {decorators} @triton.jit in its source, {len(mine)} found in its namespace")
        found.update(mine)
    return found


def unregistered() -> list[str]:
    """``@triton.jit`` functions under ``engines/`` that no registered launch compiles."""
    covered = {id(fn) for launch in launches() for fn in (launch.fn, *launch.helpers)}
    return sorted(name for name, fn in jit_functions().items() if id(fn) not in covered)
