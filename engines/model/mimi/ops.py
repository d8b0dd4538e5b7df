"""Batch-invariant primitives for the streaming path.

A session's codes must not depend on which other slots share the call.  PyTorch's
default CPU kernels do not guarantee that: oneDNN convolutions and folded GEMMs pick
their algorithm from the batch size, and a 1e-7 change in a latent flips near-tie codes
of the deep acoustic codebooks.  So streaming steps compute every slot with the shapes
the reference uses for a single stream: native im2col+GEMM convolutions on CPU (what
PyTorch itself runs for one small stream), one GEMM per slot (``bmm`` over slots instead
of a GEMM over slots x time) and per-slot ``cdist``.  On a 2-thread CPU this is bit for
bit; with many threads MKL may still split a lone slot's larger GEMMs differently (seen
at 16 threads: ~1e-7 relative, codes unchanged).  Off CPU the convolutions use the
default kernels (cuDNN), so there batching may move the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int = 1,
           dilation: int = 1, groups: int = 1, batch_invariant: bool = True) -> torch.Tensor:
    """``F.conv1d`` without padding; with ``batch_invariant`` computed per batch item identically on CPU."""
    if not batch_invariant or x.device.type != "cpu" or groups != 1:
        return F.conv1d(x, weight, bias, stride, 0, dilation, groups)
    x2, w2 = x.unsqueeze(2), weight.unsqueeze(2)  # the 2-D view PyTorch's own conv1d uses
    kernel = (1, weight.shape[-1])
    if dilation == 1:
        y = torch._C._nn.thnn_conv2d(x2, w2, kernel, bias, (1, stride), (0, 0))
    else:
        y = torch._C._nn.slow_conv_dilated2d(x2, w2, kernel, bias, (1, stride), (0, 0), (1, dilation))
    return y.squeeze(2)


def conv_transpose1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int,
                     groups: int = 1, batch_invariant: bool = True) -> torch.Tensor:
    """``F.conv_transpose1d`` without padding; with ``batch_invariant`` computed per batch item identically on CPU."""
    if not batch_invariant or x.device.type != "cpu":
        return F.conv_transpose1d(x, weight, bias, stride, groups=groups)
    if groups == 1:
        y = torch._C._nn.slow_conv_transpose2d(x.unsqueeze(2), weight.unsqueeze(2), (1, weight.shape[-1]), bias,
                                               (1, stride), (0, 0), (0, 0), (1, 1))
        return y.squeeze(2)
    if groups != x.shape[1] or weight.shape[1] != 1:
        raise NotImplementedError("grouped transposed conv is only supported depthwise")
    return _depthwise_conv_transpose1d(x, weight, bias, stride)


def _depthwise_conv_transpose1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                stride: int) -> torch.Tensor:
    # One scaled copy of the input per kernel tap: elementwise, hence batch-invariant.
    B, C, T = x.shape
    kernel = weight.shape[-1]
    span = (T - 1) * stride + 1
    y = x.new_zeros(B, C, span + kernel - 1)
    for tap in range(kernel):
        y[..., tap:tap + span:stride] += x * weight[:, 0, tap, None]
    if bias is not None:
        y += bias[:, None]
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on [B, T, in] as one GEMM per batch item (same bits as B=1) on CPU.

    Off CPU a per-item GEMM of 2 rows wastes the GPU (milliseconds per tick at 64 slots):
    one plain GEMM over all rows is used there, as for the convolutions.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight)
    B = x.shape[0]
    return torch.bmm(x, weight.t().expand(B, *weight.t().shape))


def nearest_code(vectors: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """argmin of L2 distances (``torch.cdist``) per batch item: [B, T, D] -> [B, T]."""
    B = vectors.shape[0]
    return torch.cdist(vectors, codebook[None].expand(B, *codebook.shape), p=2).argmin(dim=-1)
