"""The CPU engine's tick against torch's intra-op thread count, on an idle host and beside busy
processes: what ``PERSONAPLEX_CPU_THREADS`` defaults to, measured.

    python -m tests.e2e.cpu_tick_threads --threads 1,2 --busy 0,2 --output ticks.json

For each pair, a fresh process loads the embedded tiny model with that many intra-op threads,
opens ``--sessions`` greedy sessions, steps them through ``--warmup`` ticks of real speech, then
times ``--ticks`` more, with ``busy`` busy-looping processes running beside it throughout.
Prints a table (p50 / p99 / longest tick) and writes JSON (command, date, git revision, CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(threads: int, sessions: int, warmup: int, ticks: int) -> list[float]:
    """Tick times in ms (run in a process of its own: the thread count is fixed per process)."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    from engines.interface import SamplingParams, SessionSpec
    from engines.runtime.factory import create_engine
    from tests.orch_support import speech_frames

    engine = create_engine(None, max_slots=sessions)
    slots = [engine.open_slot(SessionSpec(voice="NATF2.pt", sampling=SamplingParams(greedy=True)))
             for _ in range(sessions)]
    frames = speech_frames(warmup + ticks)
    times = []
    for k in range(warmup + ticks):
        pcm = np.repeat(frames[k][None, :], sessions, axis=0)
        started = time.perf_counter()
        engine.step(slots, pcm)
        if k >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return times


def run_one(threads: int, busy: int, args: argparse.Namespace) -> dict:
    hogs = []
    try:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        time.sleep(0.5 if busy else 0.0)
        done = subprocess.run([sys.executable, "-m", "tests.e2e.cpu_tick_threads", "--child", str(threads),
                               "--sessions", str(args.sessions), "--warmup", str(args.warmup),
                               "--ticks", str(args.ticks)], cwd=REPO, capture_output=True, text=True, check=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    import numpy as np

    times = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"threads": threads, "busy_processes": busy, "ticks": len(times),
            "p50_ms": round(float(np.percentile(times, 50)), 2), "p99_ms": round(float(np.percentile(times, 99)), 2),
            "max_ms": round(float(times.max()), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts, comma-separated")
    parser.add_argument("--busy", default="0,2", help="busy processes beside each run, comma-separated")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.sessions, args.warmup, args.ticks)))
        return 0
    rows = [run_one(int(t), int(b), args) for b in args.busy.split(",") for t in args.threads.split(",")]
    print(f"{'threads':>7} {'busy':>4} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    for row in rows:
        print(f"{row['threads']:7d} {row['busy_processes']:4d} {row['p50_ms']:7.1f} {row['p99_ms']:7.1f} "
              f"{row['max_ms']:7.1f}")
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    result = {"command": " ".join([sys.executable, "-m", "tests.e2e.cpu_tick_threads", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": revision, "cpus": len(os.sched_getaffinity(0)), "sessions": args.sessions,
              "model": "the embedded tiny demo model", "rows": rows}
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
