"""The fp8 KV cache's write of one streaming call's keys and values (Triton): quantize each
(row, head) vector with its own scale and store it, with its scale, at its slot's ring index.

One kernel for what ``SlotKVRing._store`` otherwise does in six (two quantizations, four
indexed writes) in every layer of every tick: at a few sessions those launches, not the
bytes, are the cost.  Same numerics as ``model.fp8.quantize_fp8`` on the CPU (IEEE divisions):
amax / 448 (at least 1e-30), values divided by it, clamped, rounded to nearest e4m3.  On a GPU
torch's ``amax / 448`` is a multiplication by the reciprocal of 448, one float32 ulp off the
exact quotient now and then (18 of 1,080 scales in ``tests/test_kv_write.py`` on an H200); the
fp8 values matched bit for bit there.
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

if triton is not None:

    @triton.jit
    def _quantize_store(x_ptr, data_ptr, scale_ptr, d, FP8_MAX: tl.constexpr):
        x = tl.load(x_ptr + d).to(tl.float32)
        # IEEE divisions (div_rn), as torch's: Triton's plain "/" on float32 is the
        # approximate one, which moves a scale by an ulp now and then.
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), 1e-30)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(data_ptr + d, q.to(data_ptr.dtype.element_ty))
        tl.store(scale_ptr, scale)

    @triton.jit
    def _fp8_write_kernel(K, V, KData, VData, KScale, VScale, Slots, Ring,
                          stride_kr, stride_kh, stride_vr, stride_vh,
                          stride_ds, stride_dh, stride_dc, stride_ss, stride_sh,
                          HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(Slots + r).to(tl.int64)
        idx = tl.load(Ring + r).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        # Keys and values share the ring's layout (and so its strides).
        at = slot * stride_ds + h * stride_dh + idx * stride_dc
        scale_at = slot * stride_ss + h * stride_sh + idx
        _quantize_store(K + r * stride_kr + h * stride_kh, KData + at, KScale + scale_at, d, FP8_MAX)
        _quantize_store(V + r * stride_vr + h * stride_vh, VData + at, VScale + scale_at, d, FP8_MAX)


def available(device: torch.device, head_dim: int) -> bool:
    """A GPU that runs e4m3 kernels (Triton refuses them below compute capability 8.9:
    ``gpu_arch``), and a power-of-two head size (one program holds one head's vector)."""
    return (triton is not None and device.type == "cuda" and head_dim & (head_dim - 1) == 0
            and gpu_arch.e4m3_kernels(device))


def write_fp8(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_scales: torch.Tensor,
              value_scales: torch.Tensor, slots: torch.Tensor, ring_idx: torch.Tensor) -> None:
    """Quantize rows ``k``, ``v`` [R, H, D] and store them at (``slots``, ``ring_idx``) [R] of one
    layer's fp8 ring ``keys``/``values`` [S, H, C, D], their scales in ``key_scales`` /
    ``value_scales`` [S, H, C]."""
    R, H, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or keys.stride(-1) != 1:
        raise ValueError("write_fp8 needs contiguous head vectors")
    if keys.stride() != values.stride() or key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1:
        raise ValueError("write_fp8 needs keys and values (and their scales) of one layout")
    _fp8_write_kernel[(R, H)](
        k, v, keys, values, key_scales, value_scales, slots, ring_idx,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), key_scales.stride(0), key_scales.stride(1),
        HEAD_DIM=D, FP8_MAX=FP8_MAX, num_warps=1)
