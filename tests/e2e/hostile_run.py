"""A hostile run against a real server: the attacks of issue 18 one after another, each while a
witness session streams real speech at real time on the same front-end worker.

Starts ``hypercorn orchestrator:app`` (one worker, the tiny demo model unless
PERSONAPLEX_CHECKPOINT says otherwise).  Per attack it records what the server answered, the
witness's longest pause in audio, what the server counted of its own costs meanwhile (a
blocked event loop, a long engine piece, a stalled call: ``orch_support.server_costs``), the
slowest ``/health`` answer (polled every 50 ms from another thread) and the worker's resident
memory before and after; at the end, whether every
slot is free and the log clean.  Prints a table, writes JSON.  Not a test: the figures go in
docs/RELIABILITY.md.

    python -m tests.e2e.hostile_run --output hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Sequence

from tests.native_support import NativeClient, chat_url
from tests.orch_support import Client, Server, StreamingWitness, send_deflated_frame

REPO = Path(__file__).resolve().parents[2]
SESSIONS = 4  # the witness holds one
URL = "/v1/realtime?duplex=1"


async def refused_open(server: Server, session: dict) -> str:
    client = await Client.connect(server.ws + URL)
    await client.send({"type": "session.update", "session": session})
    error = await client.next("error", timeout=30)
    await client.wait_closed()
    return error["error"]["code"]


async def temperature_overflow(server: Server) -> str:
    codes = [await refused_open(server, {"temperature": 1e39}) for _ in range(SESSIONS + 1)]
    for _ in range(SESSIONS + 1):
        native = await NativeClient.connect(chat_url(server.ws, text_prompt="", text_temperature="1e39"))
        await native.wait_closed()
        codes.append(native.errors[0].split(":")[0] if native.errors else "none")
    return ", ".join(sorted(set(codes)))


async def millions_of_values(server: Server) -> str:
    heavy = '{"type":"session.heartbeat","pad":[' + ",".join(["[]"] * 5_000_000) + "]}"
    codes = []
    for _ in range(3):
        client = await Client.connect(server.ws + URL)
        await client.send(heavy)
        codes.append((await client.next("error", timeout=60))["error"]["code"])
        await client.ws.close()
    return f"{len(heavy) / 2**20:.0f} MiB x3: " + ", ".join(sorted(set(codes)))


async def deflate_bomb(server: Server) -> str:
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = bomb.compress(b'{"type":"x","pad":"' + b"A" * (15 << 20) + b'"}') + bomb.flush(zlib.Z_SYNC_FLUSH)
    loop = asyncio.get_running_loop()
    codes = [await loop.run_in_executor(None, send_deflated_frame, server, payload) for _ in range(5)]
    return f"{len(payload) // 1024} KiB -> 15 MiB x5: closed ({', '.join(str(c) for c in sorted(set(codes), key=str))})"


async def close_reasons(server: Server) -> str:
    for i in range(16):
        client = await Client.connect(server.ws + URL)
        await client.open()
        await client.send({"type": "session.close", "reason": f"engine_error {i}\n" + "x" * (1 << 20)})
        await client.next("session.closed")
        await client.wait_closed()
    status, metrics = server.get("/metrics")
    return f"16 x 1 MiB reasons: /metrics {len(metrics) / 1024:.1f} kB"


async def lone_surrogates(server: Server) -> str:
    client = await Client.connect(server.ws + URL)
    await client.send('{"type":"session.update","session":{"instructions":"\\ud800 hello \\udfff"}}')
    code = (await client.next("error"))["error"]["code"]
    await client.wait_closed()
    return code


async def long_static_names(server: Server) -> str:
    statuses = {server.get("/static/" + "a" * n)[0] for n in (255, 300, 1000, 4000)}
    return "HTTP " + ", ".join(map(str, sorted(statuses)))


async def long_voice_name(server: Server) -> str:
    client = await Client.connect(server.ws + URL)
    await client.send({"type": "session.update", "session": {"voice": "N" * 800_000 + ".pt"}})
    error = await client.next("error")
    await client.wait_closed()
    return f"{error['error']['code']}, reply {len(json.dumps(error))} bytes"


async def rebound_host(server: Server) -> str:
    port = int(server.http.rsplit(":", 1)[1])
    try:
        await Client.connect(f"ws://rebind.example:{port}{URL}", host="127.0.0.1", port=port,
                             additional_headers={"Origin": f"http://rebind.example:{port}"})
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return f"refused ({getattr(getattr(exc, 'response', None), 'status_code', type(exc).__name__)})"
    return "ACCEPTED"


async def long_persona(server: Server) -> str:
    client = await Client.connect(server.ws + URL)
    started = time.monotonic()
    await client.open(instructions="You are a patient and thorough teacher. " * 150)  # 6,000 characters
    opened = time.monotonic() - started
    await client.send({"type": "session.close"})
    await client.wait_closed()
    return f"6,000-character persona opened in {opened:.2f} s"


async def large_extra_body(server: Server) -> str:
    client = await Client.connect(server.ws + URL)
    await client.open(extra_body={"note": "x" * (10 << 20)})
    await client.send({"type": "session.close"})
    await client.wait_closed()
    return "10 MiB extra_body: session opened"


ATTACKS: list[tuple[str, Callable[[Server], Awaitable[str]]]] = [
    ("temperature 1e39, both routes", temperature_overflow),
    ("JSON of 5 M values", millions_of_values),
    ("permessage-deflate bomb", deflate_bomb),
    ("client-written close reasons", close_reasons),
    ("lone surrogates in a persona", lone_surrogates),
    ("long static file names", long_static_names),
    ("800 kB voice name", long_voice_name),
    ("DNS-rebound Host", rebound_host),
    ("6,000-character persona", long_persona),
    ("10 MiB extra_body", large_extra_body),
]


class HealthProbe:
    """Polls /health every 50 ms from a thread; the slowest answer since ``reset``."""

    def __init__(self, server: Server) -> None:
        self._url = server.http + "/health"
        self._slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                urllib.request.urlopen(self._url, timeout=30).read()
            except (urllib.error.URLError, OSError):
                pass
            self._slowest = max(self._slowest, time.monotonic() - started)
            self._stop.wait(0.05)

    def reset(self) -> float:
        slowest, self._slowest = self._slowest, 0.0
        return slowest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run_attacks(server: Server) -> list[dict[str, Any]]:
    worker = server.worker_pids()[0]
    health = HealthProbe(server)
    rows = []
    try:
        async with StreamingWitness(server, judge=False) as witness:  # it measures here, the rows judge
            for name, attack in ATTACKS:
                await asyncio.sleep(1.0)
                before = rss_mib(worker)
                costs_before = await asyncio.to_thread(witness.server_costs)
                health.reset()
                started = time.monotonic()
                try:
                    answer = await attack(server)
                except Exception as exc:  # noqa: BLE001 - an attack that breaks the run is a finding
                    answer = f"FAILED: {type(exc).__name__}: {str(exc)[:120]}"
                await asyncio.sleep(1.0)  # after-effects count too
                costs = await asyncio.to_thread(witness.server_costs)
                rows.append({"attack": name, "answer": answer, "seconds": round(time.monotonic() - started, 1),
                             "witness_longest_gap_ms": round(witness.longest_gap_s(started) * 1000, 1),
                             "server_costs": {k: costs[k] - costs_before[k] for k in costs if costs[k] > costs_before[k]},
                             "health_slowest_ms": round(health.reset() * 1000, 1),
                             "worker_rss_mib": [round(before, 1), round(rss_mib(worker), 1)]})
                print(f"{name:32s} {rows[-1]['witness_longest_gap_ms']:8.1f} {rows[-1]['health_slowest_ms']:8.1f} "
                      f"{before:7.0f} -> {rss_mib(worker):5.0f}  {answer}", flush=True)
    finally:
        health.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    print(f"{'attack':32s} {'gap ms':>8s} {'/health':>8s} {'RSS MiB before -> after':>22s}  answer")
    server = Server(max_sessions=SESSIONS, silence_grace_s=0, workers=1)
    try:
        rows = asyncio.run(run_attacks(server))
        server.wait_free_slots(SESSIONS, timeout=30)
        log = server.logs()
        clean = "Traceback" not in log and " ERROR " not in log
    finally:
        server.stop()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    result = {"command": " ".join([sys.executable, "-m", "tests.e2e.hostile_run", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": revision, "host": platform.node(), "attacks": rows,
              "all_slots_free_after": True, "log_clean": clean}
    print(f"every slot free afterwards; log clean: {clean}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
