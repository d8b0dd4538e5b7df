"""What the server's front end costs: CPU per session-second and per message on its event loop.

Starts ``hypercorn orchestrator:app`` (the tiny demo model unless PERSONAPLEX_CHECKPOINT says
otherwise), drives it with the load driver from another process, and reads the CPU time of
each of the server's threads from ``/proc`` before and after.  The event loop's thread (the
process's main thread: websockets, JSON, base64, audio conversion, event building) is kept
apart from the engine thread (the model) and the rest, so the figure is the front end's alone,
whatever the model costs.  Per frame a session moves three messages (one append in, one audio
delta and one transcript delta out).  That figure sizes the number of front-end workers a GPU
needs (issue 15).  Linux only (``/proc``).

    python -m tests.e2e.online_serving.frontend_cost --sessions 16 --frames 500 --output cost.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from tests.orch_support import answers_ready, free_port

REPO = Path(__file__).resolve().parents[3]
MESSAGES_PER_FRAME = 3  # append in; audio delta and transcript delta out
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of ``pid``, by role: the main thread is the
    event loop, ``ppengine*`` (the OS name the scheduler gives its thread) the engine; anything
    else is summed as ``other``."""
    roles = {"loop": 0.0, "engine": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        role = "loop" if int(task.name) == pid else "engine" if name.startswith("ppengine") else "other"
        roles[role] += seconds
    return roles


def worker_pid(master: int, timeout_s: float = 30.0) -> int:
    """hypercorn serves from a child process of the one we start (beside multiprocessing's
    resource tracker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{master}/task/{master}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        time.sleep(0.2)
    raise RuntimeError("hypercorn started no worker process")


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        if answers_ready(f"http://127.0.0.1:{port}"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout_s:g} s")


def measure(sessions: int, frames: int, wav: Path, ready_timeout_s: float) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PERSONAPLEX_MAX_SESSIONS": str(sessions), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "wb")
        server = subprocess.Popen([sys.executable, "-m", "hypercorn", "orchestrator:app", "--bind",
                                   f"127.0.0.1:{port}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(port, server, ready_timeout_s)
            pid = worker_pid(server.pid)
            model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
            before = thread_cpu_s(pid)
            started = time.monotonic()
            driver = subprocess.run(
                [sys.executable, "-m", "orchestrator.load_driver", "--model", model, "--input-wav", str(wav),
                 "--url", f"ws://127.0.0.1:{port}/v1/realtime?duplex=1", "--sessions", str(sessions),
                 "--load-frames", str(frames), "--tail-s", str(frames * 0.08), "--processes", "1",
                 "--max-stream-lag-ms", "60000", "--max-gap-ms", "60000", "--output-dir", str(Path(tmp) / "load"),
                 "-q"], cwd=REPO, env=env, capture_output=True, text=True)
            wall = time.monotonic() - started
            after = thread_cpu_s(pid)
            result = json.loads((Path(tmp) / "load" / "load-result.json").read_text())
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    if driver.returncode not in (0, 1):
        raise RuntimeError(f"the load driver failed: {driver.stderr.strip()[-500:]}")
    cpu = {role: after[role] - before[role] for role in after}
    # Normalised by what actually moved (a server that fell behind answered fewer frames).
    frames_in = sum(row["input_frames"] for row in result["sessions"])
    frames_out = sum(row["output_frames"] or 0 for row in result["sessions"])
    messages = frames_in + 2 * frames_out
    per_message = cpu["loop"] / messages if messages else None
    per_frame = None if per_message is None else per_message * MESSAGES_PER_FRAME
    return {
        "sessions": sessions, "frames": frames, "wall_s": wall, "cpu_s": cpu,
        "sessions_passed": result["passed_sessions"], "frames_in": frames_in, "frames_out": frames_out,
        "loop_us_per_message": None if per_message is None else 1e6 * per_message,
        "loop_us_per_frame": None if per_frame is None else 1e6 * per_frame,
        # a session moves 12.5 frames a second
        "loop_ms_per_session_second": None if per_frame is None else 1e3 * per_frame * 12.5,
        "loop_cores_per_128_sessions": None if per_frame is None else per_frame * 12.5 * 128,
    }


def _git_revision() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.online_serving.frontend_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 16], metavar="N",
                        help="session counts to measure, one server start each (default: 8 16)")
    parser.add_argument("--frames", type=int, default=500, metavar="F", help="80 ms frames per session (default: 500)")
    parser.add_argument("--input-wav", type=Path, default=REPO / "tests" / "data" / "input_assistant.wav")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--output", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        print("error: needs Linux /proc", file=sys.stderr)
        return 2
    if not args.input_wav.is_file():
        print(f"error: --input-wav {args.input_wav}: no such file", file=sys.stderr)
        return 2
    if any(n < 1 for n in args.sessions) or args.frames < 1:
        print("error: --sessions and --frames must be >= 1", file=sys.stderr)
        return 2
    rows = [measure(n, args.frames, args.input_wav.resolve(), args.ready_timeout_s) for n in args.sessions]
    print(f"{'sessions':>8} {'frames':>6} {'loop CPU s':>10} {'engine CPU s':>12} {'ms/session-s':>12} "
          f"{'us/frame':>8} {'us/message':>10} {'cores @128':>10}")
    for r in rows:
        print(f"{r['sessions']:>8} {r['frames']:>6} {r['cpu_s']['loop']:>10.2f} {r['cpu_s']['engine']:>12.2f} "
              f"{r['loop_ms_per_session_second']:>12.2f} {r['loop_us_per_frame']:>8.0f} "
              f"{r['loop_us_per_message']:>10.0f} {r['loop_cores_per_128_sessions']:>10.2f}"
              f"   ({r['frames_out']} of {r['frames_in']} frames answered, {r['sessions_passed']} sessions passed)")
    if args.output:
        record = {"command": " ".join([sys.executable, "-m", "tests.e2e.online_serving.frontend_cost",
                                       *(argv if argv is not None else sys.argv[1:])]),
                  "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "git_revision": _git_revision(), "host": socket.gethostname(), "cpus": os.cpu_count(), "rows": rows}
        args.output.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
