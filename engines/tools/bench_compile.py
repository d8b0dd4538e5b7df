"""What torch.compile costs the depformer step (the tick's largest compiled piece) at 7B
shapes, three ways: ``symbolic``, the concatenating step (``depformer_step``) with its weights'
shapes symbolic as ``compile_dynamic`` makes a plain tensor's; ``static``, the same with the
weights marked static (``fastpath.compiled.static_shapes``); ``fixed``, the shape-stable step
the engine compiles (``depformer_step_fixed``, static weights, the steps' keys in fixed-size
buffers).  Per mode, a first compilation on empty caches and a second start that reads them,
each in a process of its own; three steps (0, 1 and 2 steps so far: the concatenating step's
three variants) at batches 2, 4, 8.

    python -m engines.tools.bench_compile [--device cpu] [--output bench_compile.json]

Prints a table and writes JSON (command, date, git revision, device).  On the CPU the
compiler is Inductor's C++ backend: compile seconds differ from a GPU's Triton, the tracing
and symbolic reasoning the marks save do not depend on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("symbolic", "static", "fixed")
STARTS = ("first", "second")


def _one_start(mode: str, device: str) -> dict[str, float]:
    """Compile and run the step in this process; seconds per (batch, steps so far) call."""
    import torch
    import torch.nn.functional as F

    from engines.config import LMConfig
    from engines.fastpath.compiled import compile_dynamic, static_shapes
    from engines.model.lm import depformer_step, depformer_step_fixed

    cfg = LMConfig()
    dev, dtype = torch.device(device), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    dd, heads, ffn = cfg.depformer_dim, cfg.depformer_num_heads, cfg.depformer_ffn_hidden

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dev, dtype)

    # Plain tensors, as the slices of the parameters that MoshiLM passes are.
    layers = tuple((torch.ones(dd, device=dev, dtype=dtype), weight(3 * dd, dd), None, weight(dd, dd),
                    torch.ones(dd, device=dev, dtype=dtype), weight(2 * ffn, dd), weight(dd, ffn), None)
                   for _ in range(cfg.depformer_num_layers))
    weights = (weight(dd, cfg.dim), None, weight(cfg.card + 1, dd), weight(cfg.card, dd), layers)
    if mode != "symbolic":
        static_shapes(weights)
    fixed = mode == "fixed"
    step = compile_dynamic(depformer_step_fixed if fixed else depformer_step)
    steps = 8
    position = torch.arange(steps, device=dev)
    masks = [static_shapes((position == k, position <= k)) for k in range(steps)]
    seconds: dict[str, float] = {}
    with torch.inference_mode():
        for batch in (2, 4, 8):
            hidden = torch.randn(batch, cfg.dim, generator=g).to(dev, dtype)
            prev = torch.zeros(batch, dtype=torch.long, device=dev)
            shape = (cfg.depformer_num_layers, batch, heads, steps if fixed else 0, dd // heads)
            keys, values = torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)
            if fixed:  # as MoshiLM._depformer_fixed: every dimension but the batch static
                for buffer in (keys, values):
                    for dim in (0, 2, 3, 4):
                        torch._dynamo.mark_static(buffer, dim)
            for k in range(3):
                start = time.perf_counter()
                if fixed:
                    in_proj, in_scale, table, head, layer_weights = weights
                    _, keys, values = step(hidden, F.embedding(prev, table), keys, values, *masks[k],
                                           (in_proj, in_scale, head, layer_weights), heads, cfg.norm_eps, "w8a16")
                else:
                    _, keys, values = step(hidden, prev, keys, values, 0, weights, heads, cfg.norm_eps, "w8a16")
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                seconds[f"B={batch},k={k}"] = time.perf_counter() - start
    return seconds


def _start_process(mode: str, device: str, caches: Path) -> dict[str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"),
               PERSONAPLEX_CACHE_DIR=str(caches / "project"))
    done = subprocess.run([sys.executable, "-m", "engines.tools.bench_compile", "--one", mode, "--device", device],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--output", default="bench_compile.json", help="the JSON report")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # one start, in this process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one_start(args.one, args.device)))
        return
    from engines.tools.bench import git_revision

    report = {"command": " ".join([sys.executable, "-m", "engines.tools.bench_compile",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": git_revision(), "device": args.device, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "starts": {}}
    print(f"{'mode':10s} {'start':7s} {'k=0 s':>7s} {'k=1 s':>7s} {'k=2 s':>7s} {'total s':>8s}")
    for mode in MODES:
        caches = Path(tempfile.mkdtemp(prefix=f"bench-compile-{mode}-"))
        for start in STARTS:
            seconds = _start_process(mode, args.device, caches)
            report["starts"][f"{mode}/{start}"] = seconds
            first = [seconds[f"B=2,k={k}"] for k in range(3)]
            print(f"{mode:10s} {start:7s} {first[0]:7.1f} {first[1]:7.1f} {first[2]:7.1f} {sum(seconds.values()):8.1f}")
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
