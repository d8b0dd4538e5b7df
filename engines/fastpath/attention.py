"""Decode attention that reads each live slot's window in place (Triton, split-K).

One query token per slot attends to the keys of its own slot in the shared ring cache
``[num_slots, heads, capacity, head_dim]``: no gather of the windows into a batch copy
(which would move every live window twice per layer and tick).  Visible keys are the
absolute positions ``max(lo, 0) .. q_pos`` (a contiguous run of positions, so a contiguous
run of ring indices modulo the capacity), which covers both window modes of
``engines.state.kv_ring``.  The window is split across programs (flash-decoding) so a
single session still fills the GPU; a second small kernel merges the partial softmaxes
(one launch, where the same merge in PyTorch ops took eight).

With an 8-bit cache (``scales`` given) keys and values are float8 e4m3 or int8 with one
float32 scale per (position, head): the kernel folds the key scale into the score and the
value scale into the softmax weight, so dequantisation costs two multiplies per position.
The two kinds share the kernel: Triton compiles one variant per element type of the ring,
and each converts its elements to float32 exactly; the int8 variant holds no e4m3 type, so
it compiles for GPUs that have none (sm_80, ``tests/test_kv_int8.py``).  (Running the
two products on tensor cores as zero-padded 16-wide fp16 matrix products was measured
slower on the H200: 1.6-1.7 against 2.4-2.5 TB/s at B=64-128, 2026-12-01,
docs/results/2026-12-01-h200-fp8-mma-ab.txt.)
"""

from __future__ import annotations

import math

import torch

from engines.fastpath import gpu_arch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path in kv_ring is used instead
    triton = None


if triton is not None:

    @triton.jit
    def _partial_kernel(
        Q, K, V, KScale, VScale, Slots, QPos, Lo, Acc, Max, Sum,
        stride_qb, stride_qh,
        stride_ks, stride_kh, stride_kc,
        stride_vs, stride_vh, stride_vc,
        stride_ss, stride_sh,
        stride_ab, stride_ah, stride_as,
        stride_mb, stride_mh,
        capacity, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        q_pos = tl.load(QPos + b)
        # Positions older than the ring's capacity are no longer held, whatever lo says.
        lo = tl.maximum(tl.maximum(tl.load(Lo + b), q_pos - capacity + 1), 0)
        count = (q_pos - lo + 1).to(tl.int32)
        # Ring index of the first visible position; later ones wrap at most once.  One
        # 64-bit modulo per program instead of one per position.
        first = (lo % capacity).to(tl.int32)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qb + h * stride_qh + d).to(tl.float32) * sm_scale
        # 64-bit only for the (slot, head) base; offsets inside one head's ring fit in
        # 32 bits, which keeps the per-element address arithmetic cheap.
        k_base = K + slot * stride_ks + h * stride_kh
        v_base = V + slot * stride_vs + h * stride_vh
        # Key and value scales share one layout [slots, heads, capacity].
        ks_base = KScale + slot * stride_ss + h * stride_sh
        vs_base = VScale + slot * stride_ss + h * stride_sh
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        for n0 in tl.range(sp * SPLIT, (sp + 1) * SPLIT, BLOCK_N, num_stages=NUM_STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < count
            ring = first + n
            ring = tl.where(ring >= capacity, ring - capacity, ring)
            k = tl.load(k_base + ring[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
            if SCALED:
                s = s * tl.load(ks_base + ring, mask=valid, other=0.0)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            # A block with no visible key keeps m at -inf: guard the rescale against nan.
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
            p = tl.where(valid, tl.exp(s - m_new), 0.0)
            v = tl.load(v_base + ring[:, None] * stride_vc + d[None, :], mask=valid[:, None], other=0.0)
            pv = p
            if SCALED:
                pv = p * tl.load(vs_base + ring, mask=valid, other=0.0)
            acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        tl.store(Acc + b * stride_ab + h * stride_ah + sp * stride_as + d, acc)
        tl.store(Max + b * stride_mb + h * stride_mh + sp, m_i)
        tl.store(Sum + b * stride_mb + h * stride_mh + sp, l_i)


    @triton.jit
    def _merge_kernel(
        Acc, Max, Sum, Out,
        stride_ab, stride_ah, stride_as,
        stride_mb, stride_mh,
        stride_ob, stride_oh,
        n_split,
        HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Combine the per-split partial softmaxes of one (query, head) into the output."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        live = sp < n_split
        m = tl.load(Max + b * stride_mb + h * stride_mh + sp, mask=live, other=float("-inf"))
        l = tl.load(Sum + b * stride_mb + h * stride_mh + sp, mask=live, other=0.0)
        m_all = tl.max(m, axis=0)
        # A split that saw no visible key has m = -inf and contributes nothing.
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
        d = tl.arange(0, HEAD_DIM)
        acc = tl.load(Acc + b * stride_ab + h * stride_ah + sp[:, None] * stride_as + d[None, :],
                      mask=live[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


# Tuned on the H200 with engines.tools.bench_attention (docs/PERFORMANCE.md, "GPU: lockstep
# tick at PersonaPlex-7B shapes": 256 positions were the best fp8 block of a sweep, 128 the
# best bf16 one, docs/results/2026-12-01-h200-attention-ab-int32.json): fp8 rows are half
# the bytes, so a block of twice the positions keeps as many bytes in flight.  int8 rows are
# as many bytes as fp8 ones and take the same block (not swept: no A100 run yet).
BLOCK_N = 128
BLOCK_N_8BIT = 256
NUM_WARPS = 4
NUM_STAGES = 2
PROGRAMS_PER_SM = 4
# Below this many (query, head) rows the window is split in at least two, above it one
# program per row already fills the GPU many times over.
MANY_ROWS = 4096


def _split_size(capacity: int, batch_heads: int, device: torch.device, block: int, min_splits: int | None) -> int:
    """Positions per program: enough programs to fill every SM a few times over."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if min_splits is None:
        min_splits = 1 if batch_heads >= MANY_ROWS else 2
    splits = max(min_splits, min(64, math.ceil(PROGRAMS_PER_SM * sms / max(batch_heads, 1))))
    return max(block, math.ceil(math.ceil(capacity / splits) / block) * block)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    q_pos: torch.Tensor,
    lo: torch.Tensor,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_splits: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query per slot over its ring window.

    q [B, H, D]; keys/values [S, H, C, D] (the whole ring of one layer); slots, q_pos, lo [B]
    int64 (lowest visible position, may be negative); ``scales`` = (key scales, value
    scales) [S, H, C] float32 for an 8-bit (fp8 or int8) cache.  Returns [B, H, D] in q's dtype.
    No host synchronisation: safe inside a CUDA graph.
    """
    B, H, D = q.shape
    C = keys.shape[2]
    # The kernel indexes these per query row: a broadcast view (stride 0) would be misread.
    slots, q_pos, lo = slots.contiguous(), q_pos.contiguous(), lo.contiguous()
    block_n = block_n or (BLOCK_N_8BIT if scales is not None else BLOCK_N)
    split = _split_size(C, B * H, q.device, block_n, min_splits)
    n_split = math.ceil(C / split)
    acc = torch.empty(B, H, n_split, D, device=q.device, dtype=torch.float32)
    mx = torch.empty(B, H, n_split, device=q.device, dtype=torch.float32)
    sm = torch.empty_like(mx)
    k_scale, v_scale = scales if scales is not None else (mx, mx)  # unread when unscaled
    if scales is not None and (k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1):
        raise ValueError("key and value scales must share one contiguous-per-position layout")
    _partial_kernel[(B, H, n_split)](
        q, keys, values, k_scale, v_scale, slots, q_pos, lo, acc, mx, sm,
        q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        mx.stride(0), mx.stride(1),
        C, 1.0 / math.sqrt(D),
        HEAD_DIM=D, BLOCK_N=block_n, SPLIT=split, NUM_STAGES=num_stages or NUM_STAGES,
        SCALED=scales is not None, num_warps=num_warps or NUM_WARPS,
    )
    out = torch.empty_like(q)
    _merge_kernel[(B, H)](
        acc, mx, sm, out,
        acc.stride(0), acc.stride(1), acc.stride(2),
        mx.stride(0), mx.stride(1),
        out.stride(0), out.stride(1),
        n_split,
        HEAD_DIM=D, SPLITS=triton.next_power_of_2(n_split), num_warps=1,
    )
    return out


def available(device: torch.device, fp8: bool = False) -> bool:
    """Whether the kernel runs on ``device``, for a bf16/fp16 cache or (``fp8``) an e4m3 one:
    Triton refuses e4m3 pointers below compute capability 8.9 (``gpu_arch``), so an fp8 cache
    there is read by the gather path."""
    return triton is not None and device.type == "cuda" and (not fp8 or gpu_arch.e4m3_kernels(device))


if triton is not None:
    # The same kernel as an opaque operator, so torch.compile'd code can call it (dynamo
    # would otherwise trace into the launch, whose split size depends on the batch).

    @torch.library.custom_op("personaplex::decode_attention", mutates_args=())
    def decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                            q_pos: torch.Tensor, lo: torch.Tensor, k_scale: torch.Tensor | None,
                            v_scale: torch.Tensor | None) -> torch.Tensor:
        scales = None if k_scale is None else (k_scale, v_scale)
        return decode_attention(q, keys, values, slots, q_pos, lo, scales=scales)

    @decode_attention_op.register_fake
    def _decode_attention_shape(q, keys, values, slots, q_pos, lo, k_scale, v_scale):
        return torch.empty_like(q)
