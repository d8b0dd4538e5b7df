"""Weight-only fp8 products for a few rows (Triton): ``y = x @ (q * scale)^T``.

For the decode ticks of up to ``GEMV_ROWS`` sessions, which only read weights: fp8 weights
halve the bytes, but neither cuBLASLt's fp8 kernels (``torch._scaled_mm``, which also has to
quantize the activations first) nor a tensor-core Triton kernel read them faster than cuBLAS
reads bf16 at a few rows (1.1-1.75 TB/s against ~3.5 TB/s on the H200, docs/PERFORMANCE.md,
"Second run: a few-row fp8 kernel").
This kernel does the arithmetic on CUDA cores instead: each program streams ``BLOCK_N``
output channels' weight rows in ``BLOCK_K``-wide steps, converts them to float32 in
registers and multiplies them with every activation row, keeping float32 partial sums per
lane until the end, then applies the per-output-channel scale: W8A16 numerics (float32
sums, the scale after the sum).  On the H200 it reads the 7B temporal weights at 2.0-2.9
TB/s of fp8 at one row and 1.8-2.5 at two (cuBLAS: 2.7-3.7 TB/s of bf16), so a one- or
two-row product takes 60-80 % of the bf16 one's time; ncu puts half of each warp's cycles
in waiting for its weight load (latency, not bandwidth, is what is left to win).  Each
further row costs its share of multiplies: at four rows it is slower than bf16.

Exposed as the custom op ``personaplex::fp8_gemv`` so compiled pieces call it without a
graph break.  ``layers.linear`` takes it where ``available`` says so.
"""

from __future__ import annotations

import os

import torch

from engines.fastpath import gpu_arch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: layers.linear dequantizes instead
    triton = None

# Most rows ``layers.linear`` gives it: at 4 rows it took 1.5x the time of bf16 cuBLAS
# and of scaled_mm (in_proj 42.9 against 28.1 / 28.5 us, H200), at 2 rows 0.8x.  The
# kernel itself takes up to ``KERNEL_ROWS`` (the micro-benchmark times 4).
GEMV_ROWS = 2
KERNEL_ROWS = 4
# Output channels per program and the K step (the defaults; ``launch`` takes others for the
# micro-benchmark's sweep): the sweep's best or within 2 % of it at two rows on each of the
# four 7B temporal weights (H200, 2026-12-03: in_proj 22.8 us, out_proj 9.5, ffn_in 37.5,
# ffn_out 20.4; docs/PERFORMANCE.md, "Third session of measurements").  Triton does not
# pipeline this loop (it has no dot): the stage count changed nothing.
BLOCK_N = 4
BLOCK_K = 512
NUM_WARPS = 4
NUM_STAGES = 3


if triton is not None:

    @triton.jit
    def _rows_fma(acc0, acc1, acc2, acc3, w_raw, X, stride_xm, k_off, k_mask, ROWS: tl.constexpr,
                  MASKED: tl.constexpr):
        """acc_r [BLOCK_N, BLOCK_K] += weight tile * activation row r's K slice, for each row.
        The weight tile is converted once for all rows; each row's slice is loaded as a
        [1, BLOCK_K] tile in the weight tile's own layout, so the broadcast over the channels
        needs no shuffle through shared memory."""
        w = w_raw.to(tl.float32)
        ptr = X + k_off
        acc0 += w * (tl.load(ptr, mask=k_mask, other=0.0) if MASKED else tl.load(ptr)).to(tl.float32)
        if ROWS > 1:
            ptr = ptr + stride_xm
            acc1 += w * (tl.load(ptr, mask=k_mask, other=0.0) if MASKED else tl.load(ptr)).to(tl.float32)
        if ROWS > 2:
            ptr = ptr + stride_xm
            acc2 += w * (tl.load(ptr, mask=k_mask, other=0.0) if MASKED else tl.load(ptr)).to(tl.float32)
        if ROWS > 3:
            ptr = ptr + stride_xm
            acc3 += w * (tl.load(ptr, mask=k_mask, other=0.0) if MASKED else tl.load(ptr)).to(tl.float32)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _fp8_rows_kernel(X, W, S, Y, N, K, stride_xm, stride_wn, stride_ym,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)[None, :]
        n_ok = n < N
        # Out-of-range channels read row 0 instead of being masked: the loads stay unmasked
        # 16-byte vectors, and their sums are never stored.
        n_safe = tl.where(n_ok, n, 0)
        # 64-bit weight offsets: an FFN weight stack of a 7B model passes 2**31 bytes.
        w_ptr = W + n_safe[:, None].to(tl.int64) * stride_wn + k
        # Float32 partials per (channel, lane position), one set per row (ROWS <= KERNEL_ROWS): no
        # cross-lane reduction until the end.
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # (Loading the next two weight tiles ahead of the one being multiplied, against the
        # latency ncu shows, measured 40-60 % slower on the H200, 2026-12-03.)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + k) < K
            if EVEN_K:
                w_raw = tl.load(w_ptr + k0, eviction_policy="evict_first")
            else:
                w_raw = tl.load(w_ptr + k0, mask=k_mask, other=0.0, eviction_policy="evict_first")
            acc0, acc1, acc2, acc3 = _rows_fma(acc0, acc1, acc2, acc3, w_raw, X, stride_xm, k0 + k, k_mask,
                                               ROWS, not EVEN_K)
        scale = tl.load(S + n_safe)
        out = Y.dtype.element_ty
        tl.store(Y + n, (tl.sum(acc0, axis=1) * scale).to(out), mask=n_ok)
        if ROWS > 1:
            tl.store(Y + stride_ym + n, (tl.sum(acc1, axis=1) * scale).to(out), mask=n_ok)
        if ROWS > 2:
            tl.store(Y + 2 * stride_ym + n, (tl.sum(acc2, axis=1) * scale).to(out), mask=n_ok)
        if ROWS > 3:
            tl.store(Y + 3 * stride_ym + n, (tl.sum(acc3, axis=1) * scale).to(out), mask=n_ok)


def available(x: torch.Tensor) -> bool:
    """Whether ``fp8_gemv`` takes ``x``: a GPU (or Triton's interpreter) and at most
    ``GEMV_ROWS`` rows of bf16 / fp16.  Under ``torch.compile`` the row test becomes a
    guard, so batches above and below it get their own compiled variant."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    rows = x.numel() // x.shape[-1]
    return 1 <= rows <= GEMV_ROWS and ((x.is_cuda and device_available(x.device)) or _interpreted())


def device_available(device: torch.device) -> bool:
    """Whether the kernel runs on CUDA ``device``: its weight pointer is e4m3, which Triton
    refuses below compute capability 8.9 (``gpu_arch``; ``python -m engines.tools.check_targets``
    shows it refused for sm_80).  There ``layers.linear`` dequantizes instead (W8A16)."""
    return triton is not None and gpu_arch.e4m3_kernels(device)


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
    """The kernel on contiguous ``rows`` [M <= KERNEL_ROWS, K] with an explicit configuration
    (the op's constants; ``engines.tools.bench_fp8_gemm`` sweeps them)."""
    M, K = rows.shape
    N = weight.shape[0]
    if not 1 <= M <= KERNEL_ROWS:
        raise ValueError(f"the few-row fp8 kernel takes 1 to {KERNEL_ROWS} rows, got {M}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(M, N, dtype=rows.dtype, device=rows.device)
    _fp8_rows_kernel[(triton.cdiv(N, block_n),)](
        rows, weight, scale.contiguous(), y, N, K, rows.stride(0), weight.stride(0), y.stride(0),
        ROWS=M, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        num_warps=num_warps, num_stages=num_stages)
    return y


@fp8_gemv.register_fake
def _fp8_gemv_shape(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
