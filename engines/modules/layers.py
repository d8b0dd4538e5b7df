"""Small numerical building blocks of the Moshi LM, written to match the reference's
operation order (which matters for bit-level agreement in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Moshi's ``rms_norm_f32``: statistics and scaling in float32, result in x's dtype."""
    xf = x.float()
    var = eps + torch.mean(xf * xf, dim=-1, keepdim=True)
    return (xf * (alpha.float() * torch.rsqrt(var))).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` whose result for one batch row does not depend on the other rows.

    PyTorch's CPU GEMMs pick their blocking from the number of rows, which moves the last
    bits of a session's activations when other sessions share its batch (and flips greedy
    near-ties).  On CPU we run one GEMM per batch item (``bmm``), which gives the same bits
    as running the item alone; accelerators use the plain kernel (their fast path is not
    batch-invariant and documents its agreement instead).
    """
    if x.device.type != "cpu":
        return F.linear(x, weight)
    B = x.shape[0]
    rows = x.reshape(B, -1, x.shape[-1])
    y = torch.bmm(rows, weight.t().expand(B, *weight.t().shape))
    return y.view(*x.shape[:-1], weight.shape[0])


def gated_ffn(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """SiLU-gated FFN: ``linear_in`` rows are [gate; up]."""
    h = linear(x, w_in)
    h = h.view(*h.shape[:-1], 2, -1)
    return linear(F.silu(h[..., 0, :]) * h[..., 1, :], w_out)


def embed(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Embedding lookup where the token -1 ("zero token") gives an exact zero vector."""
    out = F.embedding(tokens.clamp(min=0), table)
    return torch.where((tokens == -1).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
