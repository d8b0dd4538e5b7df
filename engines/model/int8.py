"""int8 values with one float32 scale per row of their last dimension (symmetric, absmax).

The int8 KV cache's storage (``kv_ring.SlotKVRing``, ``kv_cache="int8"``): the same layout
and the same per-(position, head) scaling as the fp8 one (``model.fp8``), for GPUs without
float8 e4m3 (compute capability < 8.9, the A100 among them).  Each row is scaled by its own
absolute maximum over 127, so its largest element maps to +-127 and no calibration is
needed.  Integers spread their 255 steps evenly over the row's range, where e4m3 keeps 3
mantissa bits of every value: an element's error is at most half a step, scale / 2, which
for a row of Gaussian values is a few times smaller than fp8's (``tests/test_kv_int8.py``).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0  # symmetric: -128 is never written, so +-amax both round-trip


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] -> (int8 values [..., D], float32 scales [...]) with x ~= q * scale.

    Round to nearest, ties to even (``torch.round``); the fused write kernel
    (``fastpath.kv_write``) computes the same, bit for bit on the CPU's IEEE divisions."""
    xf = x.float()
    # The floor keeps an all-zero row's division finite (its values stay 0).
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_min(1e-30)
    # The clamp guards amax / scale rounding to just above 127.
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
