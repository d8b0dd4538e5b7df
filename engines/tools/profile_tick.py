"""Where a graphed tick spends its GPU time: kernel totals from the PyTorch profiler.

    python -m engines.tools.profile_tick --batch 64 [--ticks 20] [--config fp8+compile] [--sampled] [--output F.txt]
    python -m engines.tools.profile_tick --prefill --batch 1 [--config ...]

Builds the 7B-shaped random engine of ``engines.tools.bench`` with full windows, replays the
tick graph under ``torch.profiler`` and prints the kernels by total time.  A tick also gets
its GPU time per stage (Mimi encode, temporal transformer with the text token, depformer,
Mimi decode): a tick graph captured with the engine's stage clock recording into it
(``StageClock.external``), replayed ``--ticks`` times, p50 per stage.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from engines.tools.bench import GREEDY_SESSION, SAMPLED_SESSION, BenchConfig, full_window_prefill, typical_voice
from engines.checkpoints.random_model import build_random_engine
from engines.spec import MemorySettings
from engines.runtime.torch_engine import EngineOptions
from engines.model.prefill import build_prefill
from engines.checkpoints.tiny import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--config", default="bf16", help="engine variant, as engines.tools.bench --configs (default bf16)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    parser.add_argument("--prefill", action="store_true", help="profile a cold voice + persona prefill instead")
    parser.add_argument("--sampled", action="store_true",
                        help="sessions that sample (the server's defaults) instead of greedy ones, whose ticks "
                             "skip the sampler")
    args = parser.parse_args()
    config = BenchConfig.parse(args.config)
    tok = Path(tempfile.mkdtemp()) / "tok.model"
    train_tokenizer(tok)
    engine = build_random_engine(args.batch, "cuda", tok, kv_cache=config.kv_cache, compile=config.compile,
                                 weights=config.weights, fp8_matmul=config.fp8_matmul,
                                 overlap_encode=config.overlap_encode,
                                 options=EngineOptions(memory=MemorySettings(enabled=False)))  # a batch, not a plan
    base = build_prefill(engine.lm, typical_voice(engine.cfg), list(range(100, 200)), engine.options.window,
                         engine.kv.capacity)
    prefill = full_window_prefill(engine, base)
    if args.prefill:
        voice, persona = typical_voice(engine.cfg), list(range(100, 200))

        def run_once() -> None:
            with torch.inference_mode():
                build_prefill(engine.lm, voice, persona, engine.options.window, engine.kv.capacity,
                              engine.options.prefill_chunk, engine.prefill_graphs)
        label = f"prefill (60-frame voice + 100-token persona) {config.name}"
    else:
        spec = SAMPLED_SESSION if args.sampled else GREEDY_SESSION
        slots = [engine.open_slot(spec, prefill=prefill) for _ in range(args.batch)]
        pcm = np.zeros((args.batch, 1920), np.float32)

        def run_once() -> None:
            engine.step(slots, pcm)
        label = f"B={args.batch} {config.name} tick, {'sampling' if args.sampled else 'greedy'} sessions"
    for _ in range(5):
        run_once()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.ticks):
            run_once()
        torch.cuda.synchronize()
    stages = []
    if not args.prefill:
        try:
            stages = stage_times(engine, slots, args.ticks)
        except RuntimeError as error:  # timing events inside graphs unsupported here
            print(f"no per-stage times: {error}")
    events = prof.key_averages()
    kernels_only = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(kernels_only, key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows)
    kernels = sum(e.count for e in rows) // args.ticks
    lines = [f"{label}: {total / 1e3 / args.ticks:.2f} ms of kernel time per call, {kernels} kernels per call"]
    for e in rows[: args.top]:
        lines.append(f"{e.device_time_total / 1e3 / args.ticks:8.3f} ms/call  {e.count // args.ticks:5d}x  {e.key[:110]}")
    if stages:
        lines.append("GPU time per stage of a graphed tick, p50 of %d replays: " % args.ticks + ", ".join(
            f"{name} {statistics.median(d[name] for d in stages):.3f} ms" for name in stages[0]))
    lines.append("host (CPU) time by operator:")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]:
        lines.append(f"{e.self_cpu_time_total / 1e3 / args.ticks:8.3f} ms/call  {e.count // args.ticks:5d}x  {e.key[:110]}")
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")


def stage_times(engine, slots: list[int], ticks: int) -> list[dict[str, float]]:
    """Per-stage GPU milliseconds of ``ticks`` replays of a tick graph of ``slots`` (padded to
    their bucket with the scratch slot, as the engine's own graphs are) captured with the
    stage clock's events inside it."""
    bucket = engine.graphs.bucket_for(len(slots)) if engine.graphs is not None else len(slots)
    ids = torch.tensor(slots + [engine.scratch] * (bucket - len(slots)), device=engine.device)
    pcm = torch.zeros(bucket, 1920, device=engine.device)
    clock = engine.clock
    clock.enabled, clock.external = True, True
    engine.greedy_tick = engine.greedy_tick_for(slots)  # the graph run_tick would replay
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            engine.live_tick(ids, pcm)  # the compiled pieces have run at this bucket already
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                clock.start()
                engine.live_tick(ids, pcm)
        out = []
        for _ in range(ticks):
            graph.replay()
            out.append(clock.durations_ms())
        return out
    finally:
        clock.enabled, clock.external = False, False
        engine.greedy_tick = False


if __name__ == "__main__":
    main()
