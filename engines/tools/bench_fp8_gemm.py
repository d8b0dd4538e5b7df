"""Micro-benchmark: one linear layer of PersonaPlex-7B at few and many rows, bf16 weights
against the fp8 weight products.

    python -m engines.tools.bench_fp8_gemm [--rows 1,2,4,16,128] [--sweep] --output gemm.json

Per weight shape of the temporal transformer and the depformer and per row count M, the GPU
time (CUDA-graph replays, no launch overhead, as in the engine's tick) of:
``bf16`` (``F.linear`` on the bf16 weight), ``gemv`` (``fastpath.fp8_gemv``, M <= its
``KERNEL_ROWS``; ``layers.linear`` takes it up to ``GEMV_ROWS``), and its two products for more rows,
compiled as in the engine's pieces: ``scaled_mm`` (per-row activation quantization +
``torch._scaled_mm``) and ``w8a16`` (dequantize, then the bf16 GEMM).  On a GPU without fp8 e4m3
(compute capability < 8.9, or ``--gpu-arch sm80``: what an A100 runs) only ``bf16`` and
``w8a16`` are timed, the products the engine takes there.  Each graph runs the product over enough copies of the
weight to pass the GPU's L2 cache (in the tick, ~8-15 GB of other weights come between two
reads of one layer's), and the time is per product.  The effective bandwidth is the
weight's bytes over the time.  ``--sweep`` also times the gemv kernel's configurations at
M = 2 (the most rows ``layers.linear`` gives it) and reports the best per shape.  Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os

import torch
import torch.nn.functional as F

from engines.config import GPU_ARCH_MODES, LMConfig
from engines.fastpath import fp8_gemv, gpu_arch
from engines.fastpath.compiled import compile_dynamic
from engines.model.fp8_weights import quantize_weight
from engines.model.fp8 import dequantize_fp8
from engines.model.layers import scaled_mm_linear
from engines.tools.bench import fp8_linear_shapes, git_revision
from engines.tools.bench_attention import graphed_time

SWEEP_ROWS = 2
# (block_n, block_k, num_warps, num_stages), kept to <= 64 float32 partial sums per lane at
# SWEEP_ROWS rows (the kernel holds rows x block_n x block_k of them).
SWEEP = [(n, k, w, s) for n, k, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8), (1, 3))
         if SWEEP_ROWS * n * k <= 64 * 32 * w]
# Bytes of weight copies each timed graph cycles through: several times the L2 cache.
ROTATION_BYTES = 256 << 20


def per_copy_time(product, copies: list) -> float:
    """Seconds per product, replaying one graph that runs ``product`` on every copy."""
    return graphed_time(lambda: [product(c) for c in copies]) / len(copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,16,128", help="comma-separated row counts M")
    parser.add_argument("--sweep", action="store_true", help=f"also sweep the gemv configurations at M = {SWEEP_ROWS}")
    parser.add_argument("--gpu-arch", choices=GPU_ARCH_MODES, default=os.environ.get(gpu_arch.SETTING, "auto"),
                        help="the GPU capability taken, as the server's PERSONAPLEX_GPU_ARCH (its default)")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm: needs a CUDA GPU")
    gpu_arch.configure(args.gpu_arch)
    # Below 8.9 Triton refuses the gemv's e4m3 loads and there are no fp8 tensor cores.
    e4m3 = gpu_arch.e4m3_kernels(torch.device("cuda"))
    if not e4m3:
        print(f"{gpu_arch.describe(torch.device('cuda'))}: no fp8 e4m3, so bf16 and w8a16 only", flush=True)
        if args.sweep:
            raise SystemExit("bench_fp8_gemm: --sweep times the e4m3 gemv, which this GPU (as taken) does not run")
    rows_list = [int(r) for r in args.rows.split(",")]
    # The two products of layers.linear for more rows than the gemv takes, timed at every M.
    scaled_mm = compile_dynamic(scaled_mm_linear)
    w8a16 = compile_dynamic(lambda x, w, s: F.linear(x, dequantize_fp8(w, s, x.dtype)))
    results = []
    torch.manual_seed(0)
    for name, (N, K) in fp8_linear_shapes(LMConfig()).items():
        count = min(64, math.ceil(ROTATION_BYTES / (N * K)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        quantized = [quantize_weight(w) for w in weights]
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"weight": name, "N": N, "K": K, "M": M, "copies": count,
                   "bf16_ms": per_copy_time(lambda w: F.linear(x, w), weights),
                   "w8a16_ms": per_copy_time(lambda q: w8a16(x, q.data, q.scale), quantized)}
            if e4m3:
                row["scaled_mm_ms"] = per_copy_time(lambda q: scaled_mm(x, q.data, q.scale), quantized)
            if e4m3 and M <= fp8_gemv.KERNEL_ROWS:
                row["gemv_ms"] = per_copy_time(lambda q: fp8_gemv.fp8_gemv(x, q.data, q.scale), quantized)
            results.append(row)
            print(f"{name:>20} M={M:<4} " + "  ".join(f"{k[:-3]} {v * 1e3:7.1f} us" for k, v in row.items()
                                                      if k.endswith("_ms")), flush=True)
        if args.sweep:
            x = torch.randn(SWEEP_ROWS, K, device="cuda", dtype=torch.bfloat16)
            timed = []
            for config in SWEEP:
                try:
                    timed.append((per_copy_time(lambda q: fp8_gemv.launch(x, q.data, q.scale, *config), quantized),
                                  config))
                except Exception as error:  # a configuration the GPU cannot hold (registers, shared memory)
                    print(f"  config {config} failed: {type(error).__name__}")
            timed.sort()
            best_ms, best = timed[0]
            results.append({"weight": name, "N": N, "K": K, "M": SWEEP_ROWS, "sweep_best_ms": best_ms,
                            "sweep_best": dict(zip(("block_n", "block_k", "num_warps", "num_stages"), best)),
                            "sweep_top5": [[t, list(c)] for t, c in timed[:5]],
                            "sweep_default_ms": dict((c, t) for t, c in timed).get(
                                (fp8_gemv.BLOCK_N, fp8_gemv.BLOCK_K, fp8_gemv.NUM_WARPS, fp8_gemv.NUM_STAGES))})
            print(f"{name:>20} sweep at M={SWEEP_ROWS}: best {best_ms * 1e3:.1f} us with {best} "
                  f"({N * K / best_ms / 1e9:.2f} TB/s of fp8 weight); next "
                  + ", ".join(f"{t * 1e3:.1f} us {c}" for t, c in timed[1:5]), flush=True)
        del weights, quantized
    print("\n weight                 M   bf16 us  gemv us  scaled_mm us  w8a16 us   gemv TB/s  bf16 TB/s")
    for r in results:
        if "bf16_ms" not in r:
            continue
        gemv = r.get("gemv_ms")
        print(f" {r['weight']:<20} {r['M']:>4} {r['bf16_ms'] * 1e3:9.1f} "
              f"{(gemv or float('nan')) * 1e3:8.1f} {r.get('scaled_mm_ms', float('nan')) * 1e3:13.1f} "
              f"{r['w8a16_ms'] * 1e3:9.1f} "
              f"{(r['N'] * r['K'] / gemv / 1e9) if gemv else float('nan'):11.2f}"
              f"{2 * r['N'] * r['K'] / r['bf16_ms'] / 1e9:11.2f}")
    report = {"command": "python -m engines.tools.bench_fp8_gemm " + " ".join(
                  f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in vars(args).items()
                  if v is not False),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": git_revision(), "gpu": torch.cuda.get_device_name(),
              "gpu_arch": gpu_arch.describe(torch.device("cuda")),
              "torch": torch.__version__, "gemv_config": {"block_n": fp8_gemv.BLOCK_N, "block_k": fp8_gemv.BLOCK_K,
                                                          "num_warps": fp8_gemv.NUM_WARPS,
                                                          "num_stages": fp8_gemv.NUM_STAGES},
              "results": results}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
