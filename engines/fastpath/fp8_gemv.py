"""Weight-only fp8 products for a few rows (Triton): ``y = x @ (q * scale)^T``.

A candidate for the decode ticks of up to ``GEMV_ROWS`` sessions, which are bound by reading
the weights: fp8 weights should halve that time, but ``torch._scaled_mm`` does not get there
(the whole tick measured slower with it than with bf16 weights at B = 1: 11.82 against
10.99 ms, docs/PERFORMANCE.md).  This kernel reads the fp8 weight once, converts it in
registers, multiplies with the bf16 activations on tensor cores (rows padded to 16) and
applies the per-output-channel scale: W8A16 numerics with a float32 sum before the scale.

**Not used by the engine**: with the constants below it measured slower than the bf16
weights' cuBLAS product on the H200 (1.1-1.5 TB/s of fp8 weight against ~3.5 TB/s of bf16,
``engines.tools.bench_fp8_gemm``, 2026-12-03), so ``layers.linear`` does not take it.  The
micro-benchmark's ``--sweep`` times its block shapes; a configuration that beats cuBLAS's
bf16 product by reading half the bytes is the condition for wiring it in.  Exposed as the
custom op ``personaplex::fp8_gemv`` so compiled pieces could call it without a graph break.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: layers.linear dequantizes instead
    triton = None

# Most rows one call takes: one tensor-core tile.  Above it the GEMM libraries' fp8 or bf16
# kernels reuse each weight tile across rows and win.
GEMV_ROWS = 16
# Output channels per program and the K step: 16 channels keep >= 256 programs on the 7B
# temporal layers (N >= 4096) for the H200's 132 SMs; 256-wide K steps move 4 KB of weight
# per stage.
BLOCK_N = 16
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 4


if triton is not None:

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        # 64-bit weight offsets: ffn weights of a 7B model pass 2**31 bytes per tensor stack.
        w_ptr = W + n[:, None].to(tl.int64) * stride_wn + k[None, :]
        x_ptr = X + m[:, None] * stride_xm + k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + k) < K
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        scale = tl.load(S + n, mask=n_ok, other=0.0)
        y = acc * scale[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :], y.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def available(x: torch.Tensor) -> bool:
    """Whether ``fp8_gemv`` takes ``x``: a GPU (or Triton's interpreter) and at most
    ``GEMV_ROWS`` rows of bf16 / fp16.  Under ``torch.compile`` the row test becomes a
    guard, so batches above and below it get their own compiled variant."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    rows = x.numel() // x.shape[-1]
    return rows <= GEMV_ROWS and (x.is_cuda or _interpreted())


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("personaplex::fp8_gemv", mutates_args=())
def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] (bf16 / fp16, at most ``GEMV_ROWS`` rows) times fp8 ``weight`` [N, K]
    with float32 ``scale`` [N] per output channel -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = launch(rows, weight, scale, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)
    return y.view(*x.shape[:-1], weight.shape[0])


def launch(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
           num_warps: int, num_stages: int) -> torch.Tensor:
    """The kernel on contiguous ``rows`` [M <= 16, K] with an explicit configuration (the
    op's constants; ``engines.tools.bench_fp8_gemm`` sweeps them)."""
    M, K = rows.shape
    N = weight.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(M, N, dtype=rows.dtype, device=rows.device)
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
        rows, weight, scale.contiguous(), y, M, N, K, rows.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=GEMV_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y


@fp8_gemv.register_fake
def _fp8_gemv_shape(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
