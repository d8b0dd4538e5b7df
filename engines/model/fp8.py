"""float8 e4m3 values with one float32 scale per row of their last dimension.

Each row (a head's key vector at one position, or one output channel of a weight matrix) is
scaled by its own absolute maximum when it is quantized: no calibration is needed, and one
large row cannot crush the others' precision.  Shared by the fp8 KV cache
(``kv_ring.SlotKVRing``) and fp8 weights (``fp8_weights``).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] -> (float8 values [..., D], float32 scales [...]) with x ~= q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-30)
    # The clamp guards the rounding of amax / scale just above FP8_MAX (e4m3fn has no inf).
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
