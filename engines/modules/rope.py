"""Rotary position embedding with interleaved pairs, as Moshi and Mimi use it.

Dims (2i, 2i+1) rotate together by ``pos * max_period ** (-2i / D)``; the angle and the
rotation are computed in float32 and cast back, which is what the reference does.
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(head_dim: int, max_period: float, device: torch.device) -> torch.Tensor:
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_period: float) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] at absolute ``positions`` [B, T] (int64)."""
    B, H, T, D = x.shape
    freqs = rope_frequencies(D, max_period, x.device)
    angles = freqs * positions.to(torch.float32).view(B, 1, T, 1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    pairs = x.view(B, H, T, D // 2, 2)
    re, im = pairs[..., 0].float(), pairs[..., 1].float()
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    return torch.stack([out_re.to(x.dtype), out_im.to(x.dtype)], dim=-1).view(B, H, T, D)
