"""Small numerical building blocks of the Moshi LM, written to match the reference's
operation order (which matters for bit-level agreement in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.fastpath import fp8_gemv, gpu_arch
from engines.model.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8

# How an fp8 weight is multiplied (``linear``'s ``matmul``), chosen once per model by
# ``fp8_matmul_for``: "scaled_mm" quantizes each activation row to fp8 too and runs
# Hopper's fp8 tensor cores (``torch._scaled_mm``, row-wise scales); "w8a16" dequantizes
# the weight to the activations' dtype first (the reference numerics, any device).
FP8_MATMULS = ("scaled_mm", "w8a16")


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Moshi's ``rms_norm_f32``: statistics and scaling in float32, result in x's dtype."""
    xf = x.float()
    var = eps + torch.mean(xf * xf, dim=-1, keepdim=True)
    return (xf * (alpha.float() * torch.rsqrt(var))).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           matmul: str = "w8a16") -> torch.Tensor:
    """``F.linear`` whose result for one batch row does not depend on the other rows.

    PyTorch's CPU GEMMs pick their blocking from the number of rows, which moves the last
    bits of a session's activations when other sessions share its batch (and flips greedy
    near-ties).  On CPU we run one GEMM per batch item (``bmm``), which gives the same bits
    as running the item alone; accelerators use the plain kernel (their fast path is not
    batch-invariant and documents its agreement instead).

    ``scale``: ``weight`` is fp8 with one float32 scale per output channel
    (``model.fp8_weights``), multiplied as ``matmul`` says above ``fp8_gemv.GEMV_ROWS``
    rows; on a GPU, fewer rows read the fp8 weight directly (``fastpath.fp8_gemv``, W8A16
    numerics) whichever ``matmul``: there the product does little besides reading the weight.
    """
    if scale is not None:
        if fp8_gemv.available(x):
            return fp8_gemv.fp8_gemv(x, weight, scale)
        if matmul == "scaled_mm" and _fits_scaled_mm(x, weight):
            return scaled_mm_linear(x, weight, scale)
        weight = dequantize_fp8(weight, scale, x.dtype)
    if x.device.type != "cpu":
        return F.linear(x, weight)
    B = x.shape[0]
    rows = x.reshape(B, -1, x.shape[-1])
    y = torch.bmm(rows, weight.t().expand(B, *weight.t().shape))
    return y.view(*x.shape[:-1], weight.shape[0])


def _fits_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Row-wise scaled fp8 GEMMs take bfloat16 results and both dimensions in multiples of 16.
    return x.dtype == torch.bfloat16 and weight.shape[-1] % 16 == 0 and weight.shape[-2] % 16 == 0


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 with a dynamic scale per activation row (per token), so no calibration."""
    rows = x.reshape(-1, x.shape[-1]).float()
    row_scale = (rows.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (rows / row_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    y = torch._scaled_mm(q, weight.t(), scale_a=row_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight.shape[-2])


def fp8_matmul_for(device: torch.device, requested: str = "auto") -> str:
    """The ``matmul`` of fp8 weights on ``device``: "auto" is "scaled_mm" where fp8 tensor
    cores exist (CUDA compute capability 8.9 and up, as ``gpu_arch`` takes it: a forced
    profile counts), else "w8a16".  "scaled_mm" asked for on an older GPU is refused; on CPU
    it runs (PyTorch's CPU fp8 GEMM: tests measure its numerics there).

    Below 8.9 fp8 weights still work, as W8A16 with no e4m3 Triton kernel: the few-row
    product (``fp8_gemv``) is not taken there (Triton refuses its e4m3 weight pointer for
    sm_80: ``python -m engines.tools.check_targets --arch 80``), and ``linear`` dequantizes
    with torch ops, which convert e4m3 on any CUDA GPU (torch.compile's kernels too: Inductor
    reads e4m3 inputs as bytes below 8.9, torch/_inductor/codegen/triton_utils.py in 2.13)."""
    if requested not in ("auto", *FP8_MATMULS):
        raise ValueError(f"fp8 matmul must be one of {('auto', *FP8_MATMULS)}, got {requested!r}")
    device = torch.device(device)
    fp8_cores = gpu_arch.e4m3_kernels(device)
    if requested == "scaled_mm" and device.type == "cuda" and not fp8_cores:
        raise ValueError(f"fp8 matmul 'scaled_mm' needs a GPU of compute capability 8.9 or newer; "
                         f"{gpu_arch.describe(device)}: use 'w8a16'")
    if requested != "auto":
        return requested
    return "scaled_mm" if fp8_cores else "w8a16"


def gated_ffn(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, s_in: torch.Tensor | None = None,
              s_out: torch.Tensor | None = None, matmul: str = "w8a16") -> torch.Tensor:
    """SiLU-gated FFN: ``linear_in`` rows are [gate; up]; ``s_*``: fp8 scales (``linear``)."""
    h = linear(x, w_in, s_in, matmul)
    h = h.view(*h.shape[:-1], 2, -1)
    return linear(F.silu(h[..., 0, :]) * h[..., 1, :], w_out, s_out, matmul)


def embed(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Embedding lookup where the token -1 ("zero token") gives an exact zero vector."""
    out = F.embedding(tokens.clamp(min=0), table)
    return torch.where((tokens == -1).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
