"""Soak test: N sessions on a real server for minutes, with churn, and what it costs.

    python -m tests.soak --minutes 5 --sessions 8 --output soak.json

Starts ``hypercorn orchestrator:app`` (the tiny demo model unless ``PERSONAPLEX_CHECKPOINT``
is set) with ``max_sessions = N``.  Each of N clients loops: open a session (one of a few
personas and voices), stream real speech in real time (80 ms per frame) for a few seconds
while reading everything, sometimes cancel, then end it in one of the ways clients do
(``session.close``, a plain close, a dropped connection) and open the next one.

Every few seconds the server's worker process is sampled from ``/proc`` (resident memory,
open file descriptors, threads) and ``/metrics`` (asyncio tasks, live sessions, free slots).
The checks: after the last session ends, every slot is free and the descriptors, threads and
tasks are back where they were before the first session; resident memory after warm-up grows
by no more than ``--max-growth-mb``; no server error or traceback was logged; every session
got one output frame per input frame it sent (within the reference's deficit of 4).
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.load_driver.metrics import least_squares_slope
from tests.orch_support import FRAME, Client, Server, delta_pcm, f32_append, speech

PERSONAS = ("You are a concise and helpful assistant.", "You are a calm and precise assistant.",
            "You are a cheerful travel assistant.", "")
VOICES = ("NATF2.pt", "NATM1.pt", "VARF0.pt")
FRAME_S = 0.08
MAX_DEFICIT = 4  # the reference driver's allowance of input frames without output yet
IDLE_LOOKS_S = 15.0  # the longest wait for sockets, tasks and threads to wind down after the last session
# --faults: every 4th client's model step fails now and then (only its session is failed),
# and another's fails so that nobody can tell whose it was (its whole tick is failed).
FAULT_PLANS = "persona=FAULT-SLOT,mode=slot,after=40,times=0; persona=FAULT-BATCH,mode=batch,after=150,times=0"
FAULT_PERSONAS = {1: "FAULT-SLOT ", 3: "FAULT-BATCH "}


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    live: int
    free: int


@dataclass
class Totals:
    sessions_opened: int = 0
    sessions_refused: int = 0
    cancels: int = 0
    endings: dict[str, int] = field(default_factory=lambda: {"session.close": 0, "close": 0, "drop": 0})
    frames_in: int = 0
    frames_out: int = 0
    worst_deficit: int = 0  # input frames without output, worst session at its end
    errors: dict[str, int] = field(default_factory=dict)
    engine_errors: int = 0  # sessions failed by an (injected) engine fault
    lost_to_faults: int = 0  # frames sent into a context that failed before answering them


def worker_pid(server: Server) -> int:
    """hypercorn runs the app in a spawned child of the process we started (its other child
    is multiprocessing's resource tracker)."""
    parent = server.proc.pid
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    return parent  # --workers 0: the app runs in the process itself


def sample(server: Server, pid: int, t0: float) -> Sample:
    # /proc first: the /metrics request's own connection must not be counted.
    status = Path(f"/proc/{pid}/status").read_text()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    _, text = server.get("/metrics")
    metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    return Sample(t=round(time.monotonic() - t0, 2), rss_mb=round(int(fields["VmRSS"].split()[0]) / 1024, 1),
                  fds=fds, threads=int(fields["Threads"]),
                  tasks=int(metrics["personaplex_event_loop_tasks"]), live=int(metrics["personaplex_sessions_live"]),
                  free=int(metrics["personaplex_slots_free"]))


async def one_session(server: Server, rng: random.Random, seconds: float, totals: Totals, prefix: str = "") -> None:
    client = await Client.connect(server.ws + "/v1/realtime")
    try:
        await client.send({"type": "session.update", "session": {"instructions": prefix + rng.choice(PERSONAS),
                                                                 "voice": rng.choice(VOICES)}})
        opened = await client.next(lambda e: e["type"] in ("session.created", "error"), timeout=60)
        if opened["type"] == "error":
            # resource_exhausted: the previous session's slot is freed right after its socket
            # closes, and this client can be quicker; it retries, as clients do.
            totals.sessions_refused += 1
            await asyncio.sleep(0.2)
            return
        totals.sessions_opened += 1
        pcm = speech(offset_s=rng.uniform(0, 25))
        frames = pcm[: len(pcm) // FRAME * FRAME].reshape(-1, FRAME)
        # The session's epoch moves on with each cancel and each engine failure we are told
        # of; ``sent`` counts the frames sent in the current one.
        epoch, sent, paced, failures = 0, 0, 0, 0

        def new_failures() -> bool:
            nonlocal epoch, sent, failures
            seen = sum(1 for e in client.events if e["type"] == "error" and e["error"]["code"] == "engine_error")
            if seen == failures:
                return False
            # Frames sent before we heard of it went to the failed context: lost to the fault.
            totals.frames_in += sent
            totals.lost_to_faults += sent - answered()
            epoch, sent, failures = epoch + seen - failures, 0, seen
            return True

        def answered() -> int:
            return sum(len(delta_pcm(e)) for e in client.audio() if e["metadata"]["epoch"] == epoch) // FRAME

        start = time.monotonic()
        cancel_at = rng.uniform(0.3, 0.7) * seconds if rng.random() < 0.15 else None
        while time.monotonic() - start < seconds and paced < len(frames):
            new_failures()
            await client.send(f32_append(frames[paced]))
            sent, paced = sent + 1, paced + 1
            if cancel_at is not None and time.monotonic() - start >= cancel_at:
                await client.send({"type": "response.cancel"})
                try:
                    await client.next("response.done", timeout=5)
                except AssertionError:
                    pass  # no response was open (a fault had just ended it)
                totals.cancels += 1
                totals.frames_in += sent
                cancel_at, epoch, sent = None, epoch + 1, 0
            await client.drain(max(0.0, start + (paced + 1) * FRAME_S - time.monotonic()))

        deadline = time.monotonic() + 30  # the last frames' output, however slow the tick
        while answered() < sent and time.monotonic() < deadline and not new_failures():
            await client.drain(0.1)
        totals.frames_in += sent
        totals.frames_out += sum(len(delta_pcm(e)) for e in client.audio()) // FRAME
        totals.worst_deficit = max(totals.worst_deficit, sent - answered())
        ending = rng.choices(("session.close", "close", "drop"), (0.6, 0.3, 0.1))[0]
        totals.endings[ending] += 1
        if ending == "session.close":
            await client.send({"type": "session.close"})
            await client.wait_closed(30)
        elif ending == "close":
            await client.close()
        else:
            client.ws.transport.abort()
    finally:
        for event in client.events:
            if event["type"] == "error" and event["error"]["code"] == "engine_error":
                totals.engine_errors += 1
            elif event["type"] == "error" and event["error"]["code"] != "resource_exhausted":
                code = event["error"]["code"]
                totals.errors[code] = totals.errors.get(code, 0) + 1
        if client.close_code is None:
            client.ws.transport.abort()


async def soak(server: Server, duration_s: float, sessions: int, session_s: tuple[float, float], seed: int,
               sample_every_s: float, faults: bool) -> tuple[list[Sample], Totals, Sample, Sample]:
    pid = worker_pid(server)
    t0 = time.monotonic()
    idle_before = await asyncio.to_thread(sample, server, pid, t0)
    totals = Totals()
    samples: list[Sample] = []
    end = t0 + duration_s

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        prefix = FAULT_PERSONAS.get(index % 4, "") if faults else ""
        while time.monotonic() < end:
            await one_session(server, rng, min(rng.uniform(*session_s), max(1.0, end - time.monotonic())), totals,
                              prefix)

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append(await asyncio.to_thread(sample, server, pid, t0))
            await asyncio.sleep(sample_every_s)

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(sessions)))
    await asyncio.to_thread(server.wait_free_slots, sessions, 30)
    # A leak stays; a socket or task still winding down does not: look again until everything
    # is back where it was (on a busy CI machine the last closes can take seconds: 2 s of looks
    # once saw one task more), at most IDLE_LOOKS_S, and keep the least look.
    idle = []
    settle_end = time.monotonic() + IDLE_LOOKS_S
    while not idle or (time.monotonic() < settle_end and not all(_back(idle[-1], idle_before).values())):
        await asyncio.sleep(0.5)
        idle.append(await asyncio.to_thread(sample, server, pid, t0))
    # The look that came back if one did (it is the last); else the least, for the report.
    idle_after = min(idle, key=lambda s: (not all(_back(s, idle_before).values()), s.fds, s.tasks, s.threads))
    return samples, totals, idle_before, idle_after


def _back(now: Sample, before: Sample) -> dict[str, bool]:
    """Whether sockets, threads and tasks are back to (or under) their count before the load."""
    return {"fds_back": now.fds <= before.fds, "threads_back": now.threads <= before.threads,
            "tasks_back": now.tasks <= before.tasks}


def _unexplained_errors(log: str, faults: bool) -> list[str]:
    """Error lines of the server log that no injected fault explains."""
    if not faults:
        return [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    explained = ("engine.step failed", "injected")
    return [line for line in log.splitlines() if " ERROR " in line and not any(w in line for w in explained)]


def growth_mb_per_min(samples: list[Sample]) -> float:
    """Least-squares slope of resident memory over the second half of the run."""
    half = samples[len(samples) // 2:]
    if len(half) < 3:
        return 0.0
    slope = least_squares_slope([s.t for s in half], [s.rss_mb for s in half])
    return 60 * slope if slope is not None else 0.0


def run_soak(duration_s: float, sessions: int, *, session_s: tuple[float, float] = (4.0, 15.0), seed: int = 1,
             sample_every_s: float = 2.0, max_growth_mb: float = 48.0, torch_threads: int | None = 1,
             faults: bool = False) -> dict[str, Any]:
    # One intra-op thread by default: on a small shared CPU box torch's default (one per core)
    # makes the tiny model's tick many times slower, and this measures leaks, not speed.
    saved = os.environ.get("OMP_NUM_THREADS")
    if torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    try:
        server = Server(max_sessions=sessions, **({"fault_injection": FAULT_PLANS} if faults else {}))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    try:
        samples, totals, before, after = asyncio.run(
            soak(server, duration_s, sessions, session_s, seed, sample_every_s, faults))
    finally:
        server.stop()
    log = server.logs()
    warm = [s for s in samples if s.t >= duration_s * 0.25] or samples
    rss_growth = max(s.rss_mb for s in warm) - warm[0].rss_mb
    checks = {
        "slots_all_free": after.free == sessions and after.live == 0,
        **_back(after, before),
        "memory_bounded": rss_growth <= max_growth_mb,
        "no_server_errors": not _unexplained_errors(log, faults),
        "no_client_errors": not totals.errors and (faults or not totals.engine_errors),
        "every_frame_answered": totals.worst_deficit <= MAX_DEFICIT,
        "no_frames_lost": totals.lost_to_faults <= totals.engine_errors * 8 if faults else not totals.lost_to_faults,
        "sessions_ran": totals.sessions_opened >= sessions,
    }
    return {
        "schema_version": 1,
        "ok": all(checks.values()),
        "checks": checks,
        "duration_s": duration_s,
        "sessions": sessions,
        "seed": seed,
        "totals": asdict(totals),
        "faults_injected": log.count("injected fault #"),
        "memory": {"rss_idle_before_mb": before.rss_mb, "rss_after_warmup_mb": warm[0].rss_mb,
                   "rss_max_mb": max(s.rss_mb for s in samples), "rss_idle_after_mb": after.rss_mb,
                   "growth_after_warmup_mb": round(rss_growth, 1),
                   "second_half_slope_mb_per_min": round(growth_mb_per_min(samples), 2)},
        "idle_before": asdict(before),
        "idle_after": asdict(after),
        "samples": [asdict(s) for s in samples],
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch_threads": torch_threads,
                    "load_average": os.getloadavg()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-growth-mb", type=float, default=48.0)
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the server (0: default)")
    parser.add_argument("--faults", action="store_true", help="inject engine faults into every other client's steps")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run_soak(args.minutes * 60, args.sessions, seed=args.seed, max_growth_mb=args.max_growth_mb,
                      sample_every_s=5.0 if args.minutes >= 2 else 2.0, torch_threads=args.torch_threads or None,
                      faults=args.faults)
    summary = {k: result[k] for k in ("ok", "checks", "totals", "faults_injected", "memory", "idle_before",
                                      "idle_after")}
    print(json.dumps(summary, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
