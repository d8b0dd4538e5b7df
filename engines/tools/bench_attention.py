"""Micro-benchmark: in-place Triton decode attention vs gather + SDPA, 7B shapes.

    python -m engines.tools.bench_attention [--fp8 | --int8] [--batch-sizes 1,8,32,64]

Sweeps the kernel's block size, warps, pipeline stages and minimum split count per B and
prints the best (graphed) configuration with its effective bandwidth over the KV bytes.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from engines.config import GPU_ARCH_MODES
from engines.errors import GpuArchError
from engines.fastpath import attention, gpu_arch


def _time(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed_time(fn, reps: int = 20) -> float:
    """Time ``fn`` replayed from a CUDA graph (no launch overhead, as in the engine)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _time(g.replay, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--fp8", action="store_true", help="fp8 cache with per-(position, head) scales")
    kind.add_argument("--int8", action="store_true", help="int8 cache with per-(position, head) scales")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--gpu-arch", choices=GPU_ARCH_MODES, default=os.environ.get(gpu_arch.SETTING, "auto"),
                        help="the GPU capability taken, as the server's PERSONAPLEX_GPU_ARCH (its default)")
    args = parser.parse_args()
    scaled = "fp8" if args.fp8 else "int8" if args.int8 else None
    gpu_arch.configure(args.gpu_arch)
    if scaled == "fp8":  # the e4m3 variant: Triton refuses it below 8.9
        try:
            gpu_arch.require_e4m3(torch.device("cuda"), "--fp8", "time --int8 instead")
        except GpuArchError as refused:
            raise SystemExit(f"bench_attention: {refused}") from None
    H, C, D = 32, 3000, 128
    for B in (int(b) for b in args.batch_sizes.split(",")):
        S = B + 1
        keys = torch.randn(S, H, C, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        scales = None
        if scaled is not None:
            from engines.state.kv_ring import SCALED_STORAGE

            quantize = SCALED_STORAGE[scaled][1]
            keys, k_scale = quantize(keys)
            values, v_scale = quantize(values)
            scales = (k_scale, v_scale)
        slots = torch.arange(B, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        q_pos = torch.full((B,), 10 * C, device="cuda")
        lo = q_pos - C + 2

        def triton_path():
            attention.decode_attention(q, keys, values, slots, q_pos, lo, scales=scales)

        gbytes = 2 * B * H * C * (D + 4 if scaled else 2 * D) / 1e9
        best = None
        for block_n in (32, 64, 128, 256):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for min_splits in (1, 4):
                        def variant(bn=block_n, w=warps, st=stages, ms=min_splits):
                            attention.decode_attention(q, keys, values, slots, q_pos, lo, bn, w, st, ms,
                                                       scales=scales)
                        try:
                            t = graphed_time(variant)
                        except Exception:  # some configs exceed shared memory or registers
                            continue
                        if best is None or t < best[0]:
                            best = (t, block_n, warps, stages, min_splits)
        print(f"B={B:3d} best graphed config {best[1:]} (block, warps, stages, min_splits): "
              f"{best[0]:.3f} ms/layer = {gbytes / (best[0] / 1e3):.0f} GB/s")

        def gather_path():
            k, v = keys[slots], values[slots]
            if scales is not None:
                k = (k.float() * scales[0][slots].unsqueeze(-1)).bfloat16()
                v = (v.float() * scales[1][slots].unsqueeze(-1)).bfloat16()
            F.scaled_dot_product_attention(q.unsqueeze(2), k, v)

        t_tri, t_gat = graphed_time(triton_path), graphed_time(gather_path)
        print(f"B={B:3d} per layer: triton {t_tri:.3f} ms ({gbytes / (t_tri / 1e3):.0f} GB/s), "
              f"gather+sdpa {t_gat:.3f} ms; x32 layers: {32 * t_tri:.1f} vs {32 * t_gat:.1f} ms")
        keys = values = scales = None  # free this B's cache before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
