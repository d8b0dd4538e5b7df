"""Rotary position embedding with interleaved pairs, as Moshi and Mimi use it.

Dims (2i, 2i+1) rotate together by ``pos * max_period ** (-2i / D)``; the angle and the
rotation are computed in float32 and cast back, which is what the reference does.  The
cos/sin tables depend only on the positions, so a transformer computes them once per call
(``rope_tables``) and every layer rotates its queries and keys with them (``rotate``).
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(head_dim: int, max_period: float, device: torch.device) -> torch.Tensor:
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / head_dim))


def rope_tables(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D/2] (float32) for absolute ``positions`` [B, T]."""
    B, T = positions.shape
    freqs = rope_frequencies(head_dim, max_period, positions.device)
    angles = freqs * positions.to(torch.float32).view(B, 1, T, 1)
    return torch.cos(angles), torch.sin(angles)


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] with ``rope_tables`` of its positions."""
    cos, sin = tables
    B, H, T, D = x.shape
    pairs = x.view(B, H, T, D // 2, 2)
    re, im = pairs[..., 0].float(), pairs[..., 1].float()
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    return torch.stack([out_re.to(x.dtype), out_im.to(x.dtype)], dim=-1).view(B, H, T, D)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_period: float) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] at absolute ``positions`` [B, T] (int64)."""
    return rotate(x, rope_tables(positions, x.shape[-1], max_period))
