"""The 8-bit KV cache's write of one streaming call's keys and values (Triton): quantize each
(row, head) vector with its own scale and store it, with its scale, at its slot's ring index.

One kernel for what ``SlotKVRing._store`` otherwise does in six (two quantizations, four
indexed writes) in every layer of every tick: at a few sessions those launches, not the
bytes, are the cost.  One kernel serves both 8-bit kinds, told apart by the ring's element
type (a constexpr): float8 e4m3 (``kv_cache="fp8"``) and int8 (``"int8"``, which touches no
e4m3 type, so it compiles for GPUs without one such as the A100, sm_80).

Same numerics as ``model.fp8.quantize_fp8`` / ``model.int8.quantize_int8`` on the CPU (IEEE
divisions): amax / 448 (or / 127; at least 1e-30), values divided by it, clamped, rounded to
nearest (even).  On a GPU torch's ``amax / 448`` is a multiplication by the reciprocal of
448, one float32 ulp off the exact quotient now and then (18 of 1,080 scales in
``tests/test_kv_write.py`` on an H200); the fp8 values matched bit for bit there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ring writes with indexed assignments
    triton = None

from engines.fastpath import gpu_arch
from engines.model.fp8 import FP8_MAX
from engines.model.int8 import INT8_MAX

if triton is not None:

    @triton.jit
    def _round_half_even(y):
        """Round to the nearest integer, ties to even (``torch.round``'s), as a float.  Triton's
        core language has no rint, and libdevice's does not run in the interpreter (the CPU
        tests'); float -> int conversion truncates."""
        a = tl.abs(y)
        f = tl.floor(a)
        d = a - f  # exact: a and f are within a factor of two (or f = 0)
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
        return tl.where(y < 0, -r, r)

    @triton.jit
    def _quantize_store(x_ptr, data_ptr, scale_ptr, d, QMAX: tl.constexpr, INTEGER: tl.constexpr):
        x = tl.load(x_ptr + d).to(tl.float32)
        # IEEE divisions (div_rn), as torch's: Triton's plain "/" on float32 is the
        # approximate one, which moves a scale by an ulp now and then.
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), QMAX), 1e-30)
        q = tl.div_rn(x, scale)
        if INTEGER:  # the cast to an integer truncates: round first
            q = _round_half_even(q)
        # (The conversion to e4m3 rounds to nearest itself.)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        tl.store(data_ptr + d, q.to(data_ptr.dtype.element_ty))
        tl.store(scale_ptr, scale)

    @triton.jit
    def _write_kernel(K, V, KData, VData, KScale, VScale, Slots, Ring,
                      stride_kr, stride_kh, stride_vr, stride_vh,
                      stride_ds, stride_dh, stride_dc, stride_ss, stride_sh,
                      HEAD_DIM: tl.constexpr, QMAX: tl.constexpr, INTEGER: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(Slots + r).to(tl.int64)
        idx = tl.load(Ring + r).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        # Keys and values share the ring's layout (and so its strides).
        at = slot * stride_ds + h * stride_dh + idx * stride_dc
        scale_at = slot * stride_ss + h * stride_sh + idx
        _quantize_store(K + r * stride_kr + h * stride_kh, KData + at, KScale + scale_at, d, QMAX, INTEGER)
        _quantize_store(V + r * stride_vr + h * stride_vh, VData + at, VScale + scale_at, d, QMAX, INTEGER)


def available(device: torch.device, head_dim: int, fp8: bool = True) -> bool:
    """A GPU, a power-of-two head size (one program holds one head's vector), and for an fp8
    ring (``fp8``) one that runs e4m3 kernels (Triton refuses them below compute capability
    8.9: ``gpu_arch``); an int8 ring's write runs on any."""
    return (triton is not None and device.type == "cuda" and head_dim & (head_dim - 1) == 0
            and (not fp8 or gpu_arch.e4m3_kernels(device)))


def write_scaled(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 key_scales: torch.Tensor, value_scales: torch.Tensor, slots: torch.Tensor,
                 ring_idx: torch.Tensor) -> None:
    """Quantize rows ``k``, ``v`` [R, H, D] and store them at (``slots``, ``ring_idx``) [R] of one
    layer's 8-bit ring ``keys``/``values`` [S, H, C, D] (float8 e4m3 or int8), their scales in
    ``key_scales`` / ``value_scales`` [S, H, C]."""
    R, H, D = k.shape
    if keys.dtype == torch.int8:
        qmax, integer = INT8_MAX, True
    elif keys.dtype == torch.float8_e4m3fn:
        qmax, integer = FP8_MAX, False
    else:
        raise ValueError(f"write_scaled writes an int8 or float8_e4m3fn ring, not {keys.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or keys.stride(-1) != 1:
        raise ValueError("write_scaled needs contiguous head vectors")
    if (keys.stride() != values.stride() or keys.dtype != values.dtype or key_scales.stride() != value_scales.stride()
            or key_scales.stride(-1) != 1):
        raise ValueError("write_scaled needs keys and values (and their scales) of one layout")
    _write_kernel[(R, H)](
        k, v, keys, values, key_scales, value_scales, slots, ring_idx,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), key_scales.stride(0), key_scales.stride(1),
        HEAD_DIM=D, QMAX=qmax, INTEGER=integer, num_warps=1)
