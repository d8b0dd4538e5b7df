"""Micro-benchmark: one linear layer of PersonaPlex-7B at few and many rows, bf16 weights
against the fp8 weight products.

    python -m engines.tools.bench_fp8_gemm [--rows 1,8,16,64,128] [--sweep] --output gemm.json

Per weight shape of the temporal transformer and the depformer and per row count M, the GPU
time (CUDA-graph replays, no launch overhead, as in the engine's tick) of:
``bf16`` (``F.linear`` on the bf16 weight), ``gemv`` (``fastpath.fp8_gemv``, M <= 16), and
``layers.linear``'s two fp8 products compiled as in the engine's pieces: ``scaled_mm``
(per-row activation quantization + ``torch._scaled_mm``) and ``w8a16`` (dequantize, then the
bf16 GEMM).  The effective
bandwidth is the weight's bytes over the time.  ``--sweep`` also times the gemv kernel's
configurations at M = 1 and reports the best per shape.  Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json

import torch
import torch.nn.functional as F

from engines.config import LMConfig
from engines.fastpath import fp8_gemv
from engines.fastpath.compiled import compile_dynamic
from engines.model.fp8_weights import quantize_weight
from engines.model.layers import linear
from engines.tools.bench import fp8_linear_shapes, git_revision
from engines.tools.bench_attention import graphed_time


SWEEP = list(itertools.product((16, 32), (128, 256, 512), (4, 8), (3, 4, 6)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,64,128", help="comma-separated row counts M")
    parser.add_argument("--sweep", action="store_true", help="also sweep the gemv configurations at M = 1")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm: needs a CUDA GPU")
    rows_list = [int(r) for r in args.rows.split(",")]
    product = compile_dynamic(linear)
    results = []
    torch.manual_seed(0)
    for name, (N, K) in fp8_linear_shapes(LMConfig()).items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        q = quantize_weight(w)
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"weight": name, "N": N, "K": K, "M": M,
                   "bf16_ms": graphed_time(lambda: F.linear(x, w)),
                   "scaled_mm_ms": graphed_time(lambda: product(x, q.data, q.scale, "scaled_mm")),
                   "w8a16_ms": graphed_time(lambda: product(x, q.data, q.scale, "w8a16"))}
            if M <= fp8_gemv.GEMV_ROWS:
                row["gemv_ms"] = graphed_time(lambda: fp8_gemv.fp8_gemv(x, q.data, q.scale))
            results.append(row)
            print(f"{name:>20} M={M:<4} " + "  ".join(f"{k[:-3]} {v * 1e3:7.1f} us" for k, v in row.items()
                                                      if k.endswith("_ms")), flush=True)
        if args.sweep:
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            timed = []
            for config in SWEEP:
                try:
                    timed.append((graphed_time(lambda: fp8_gemv.launch(x, q.data, q.scale, *config)), config))
                except Exception as error:  # a configuration the GPU cannot hold (shared memory)
                    print(f"  config {config} failed: {type(error).__name__}")
            best_ms, best = min(timed)
            results.append({"weight": name, "N": N, "K": K, "M": 1, "sweep_best_ms": best_ms,
                            "sweep_best": dict(zip(("block_n", "block_k", "num_warps", "num_stages"), best)),
                            "sweep_default_ms": dict((c, t) for t, c in timed).get(
                                (fp8_gemv.BLOCK_N, fp8_gemv.BLOCK_K, fp8_gemv.NUM_WARPS, fp8_gemv.NUM_STAGES))})
            print(f"{name:>20} sweep at M=1: best {best_ms * 1e3:.1f} us with {best} "
                  f"({N * K / best_ms / 1e9:.2f} TB/s of fp8 weight)", flush=True)
    print("\n weight                 M   bf16 us  gemv us  scaled_mm us  w8a16 us   gemv TB/s")
    for r in results:
        if "bf16_ms" not in r:
            continue
        gemv = r.get("gemv_ms")
        print(f" {r['weight']:<20} {r['M']:>4} {r['bf16_ms'] * 1e3:9.1f} "
              f"{(gemv or float('nan')) * 1e3:8.1f} {r['scaled_mm_ms'] * 1e3:13.1f} {r['w8a16_ms'] * 1e3:9.1f} "
              f"{(r['N'] * r['K'] / gemv / 1e9) if gemv else float('nan'):11.2f}")
    report = {"command": "python -m engines.tools.bench_fp8_gemm " + " ".join(
                  f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in vars(args).items()
                  if v is not False),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": git_revision(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "gemv_config": {"block_n": fp8_gemv.BLOCK_N, "block_k": fp8_gemv.BLOCK_K,
                                                          "num_warps": fp8_gemv.NUM_WARPS,
                                                          "num_stages": fp8_gemv.NUM_STAGES},
              "results": results}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
