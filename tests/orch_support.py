"""Helpers for the orchestrator tests: a real ``hypercorn orchestrator:app`` subprocess on a
loopback port, a websocket client that records every event, and the shared speech asset."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np
import websockets

from engines.audio_io import read_audio

REPO = Path(__file__).resolve().parents[1]
SPEECH_WAV = Path(os.environ.get("PERSONAPLEX_TEST_SPEECH") or REPO / "tests" / "data" / "input_assistant.wav")
FRAME = 1920
RATE = 24000


@functools.lru_cache(maxsize=1)
def _speech_pcm() -> np.ndarray:
    return read_audio(SPEECH_WAV)


def speech(seconds: float | None = None, offset_s: float = 0.0) -> np.ndarray:
    """Real speech as float32 at 24 kHz (tests/data/input_assistant.wav)."""
    pcm = _speech_pcm()
    start = int(offset_s * RATE)
    end = len(pcm) if seconds is None else start + int(seconds * RATE)
    return pcm[start:end]


def speech_frames(n: int, offset_s: float = 1.0) -> np.ndarray:
    """``n`` whole 80 ms frames of speech, float32 [n, 1920]."""
    return speech(n * FRAME / RATE + 0.01, offset_s)[: n * FRAME].reshape(n, FRAME)


def f32_append(frame: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append",
            "audio": base64.b64encode(np.asarray(frame, dtype="<f4").tobytes()).decode(), **extra}


def pcm16_b64(samples: np.ndarray) -> str:
    return base64.b64encode(np.clip(np.rint(samples * 32767), -32768, 32767).astype("<i2").tobytes()).decode()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (for a process the test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers_ready(http: str) -> bool:
    """Whether the server at ``http`` (``http://HOST:PORT``) answers ``/ready`` with 200 now."""
    try:
        with urllib.request.urlopen(f"{http}/ready", timeout=5) as answer:
            return answer.status == 200
    except OSError:  # not listening yet, or 503
        return False


def delta_pcm(event: dict[str, Any]) -> np.ndarray:
    """The int16 samples of one ``response.output_audio.delta`` (strict base64)."""
    raw = base64.b64decode(event["delta"], validate=True)
    assert len(raw) % 2 == 0, "PCM16 delta with an odd byte count"
    return np.frombuffer(raw, dtype="<i2")


REFERENCE_SESSION = {
    "model": "nvidia/personaplex-7b-v1",
    "modalities": ["audio", "text"],
    "input_audio_format": "pcm_f32le",
    "output_audio_format": "pcm16",
    "sample_rate_hz": 24000,
    "audio": {"input": {"sample_rate_hz": 24000}, "output": {"sample_rate_hz": 24000}},
    "voice": "NATF2.pt",
    "instructions": "You are a concise and helpful assistant.",
    "turn_detection": None,
    "extra_body": {"auto_response": True},
}


def above_series(histogram: str, bound: float, labels: str = "") -> tuple[str, str]:
    """The two series whose difference counts the observations of ``histogram`` past
    ``bound`` (one of its bucket bounds): its count and that bucket."""
    return (f"{histogram}_count" + (f"{{{labels}}}" if labels else ""),
            f'{histogram}_bucket{{{labels + "," if labels else ""}le="{bound}"}}')


# Every server started in this test process, in order: a failing test's report shows the logs
# of the servers it started (``conftest.pytest_runtest_makereport``).
STARTED: list["Server"] = []


class Server:
    """``python -m hypercorn orchestrator:app`` on 127.0.0.1 (or ``host``), port chosen by the
    OS; clients always connect through 127.0.0.1."""

    def __init__(self, host: str = "127.0.0.1", *, workers: int = 1, launcher: str = "hypercorn",
                 wait_ready: bool = True, cli: Sequence[str] = (), **settings: Any) -> None:
        # ``launcher``: "hypercorn" (python -m hypercorn) or "personaplex" (orchestrator.serve,
        # hypercorn's command line with a master that replaces a dead worker).  ``wait_ready``:
        # return once /ready says 200 (False: once it listens, for servers that never get there).
        # ``cli``: more arguments for the launcher (personaplex-serve's setting flags).
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERSONAPLEX_") or k == "PERSONAPLEX_CACHE_DIR"}
        env.update({f"PERSONAPLEX_{k.upper()}": str(v) for k, v in settings.items()})
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.log: deque[str] = deque(maxlen=5000)
        STARTED.append(self)
        module = {"hypercorn": "hypercorn", "personaplex": "orchestrator.serve"}[launcher]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "orchestrator:app", "--bind", f"{host}:0", "--graceful-timeout", "2",
             "--workers", str(workers), *cli],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port: int | None = None
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if self.port is None and f"Running on http://{host}:" in line:
                    self.port = int(line.split(f"Running on http://{host}:")[1].split()[0])
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(60) or self.port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.logs())
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}"
        if wait_ready:
            self.wait_ready()

    def worker_pids(self) -> list[int]:
        """The pids of the front-end workers (hypercorn's children that answer /ready)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [int(pid) for pid in children if "spawn_main" in _cmdline(int(pid))]

    def logs(self) -> str:
        return "\n".join(self.log)

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as resp:
                body = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as err:
            body, status = err.read().decode(), err.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.logs())
            status, body = self.get("/ready")
            if status == 200:
                return body
            time.sleep(0.1)
        raise RuntimeError("server never became ready:\n" + self.logs())

    def wait_free_slots(self, n: int, timeout: float = 10.0) -> None:
        """Wait until ``n`` admission slots are free (earlier sessions' cleanup is async)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = self.get("/ready")
            if status == 200 and body["free_slots"] >= n:
                return
            time.sleep(0.05)
        raise AssertionError(f"free slots never reached {n}: {self.get('/ready')}")

    def metric(self, series: str) -> float:
        """The value of one series, e.g. ``personaplex_errors_total{code="bad_event"}`` (0 if absent)."""
        return self.metrics(series)[0]

    def metrics(self, *series: str) -> list[float]:
        """The values of several series from one scrape (0 for each absent): counts that are
        compared must come from the same moment."""
        status, text = self.get("/metrics")
        assert status == 200
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        return [values.get(name, 0.0) for name in series]

    def observations_above(self, histogram: str, bound: float, labels: str = "") -> float:
        """How many observations of ``histogram`` (its labels, e.g. ``kind="open"``) exceeded
        ``bound``, one of its bucket bounds (read from one scrape)."""
        count, within = self.metrics(*above_series(histogram, bound, labels))
        return count - within


    def assert_clean_log(self) -> None:
        """No exception escaped anywhere in the server while the tests ran."""
        text = self.logs()
        assert "Traceback" not in text and " ERROR " not in text, text[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# Clients of the scenario that ``run`` is executing: closed whatever way it ends.
_OPEN_CLIENTS: list["Client"] = []


def run(coro: Any) -> Any:
    """``asyncio.run`` a test scenario, then close every websocket it opened.

    A scenario that fails or skips half-way must not leave its sessions holding slots of
    the shared server (that would fail every later test on admission instead of its own).
    """

    async def guarded() -> Any:
        try:
            return await coro
        finally:
            clients, _OPEN_CLIENTS[:] = list(_OPEN_CLIENTS), []
            for client in clients:
                try:
                    await asyncio.wait_for(client.ws.close(), 5)
                except Exception:  # noqa: BLE001 - already closed or broken: nothing to free
                    pass

    return asyncio.run(guarded())


class Client:
    """A websocket client that records every server event (with its arrival time)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.times: list[float] = []
        self._cursor = 0
        self.close_code: int | None = None
        self.close_reason: str | None = None

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> "Client":
        kwargs.setdefault("max_size", 64 * 2**20)
        kwargs.setdefault("proxy", None)
        client = cls(await websockets.connect(url, **kwargs))
        _OPEN_CLIENTS.append(client)
        return client

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    async def _recv(self, timeout: float) -> dict[str, Any] | None:
        try:
            message = await asyncio.wait_for(self.ws.recv(), timeout)
        except websockets.ConnectionClosed as exc:
            self.close_code = exc.rcvd.code if exc.rcvd else None
            self.close_reason = exc.rcvd.reason if exc.rcvd else None
            return None
        assert isinstance(message, str), "the server sent a binary frame"
        event = json.loads(message)
        assert isinstance(event, dict) and isinstance(event.get("type"), str), f"not an event object: {message[:200]}"
        if "delta" in event:
            assert event["delta"] is not None, f"delta: null in {event['type']}"
        self.events.append(event)
        self.times.append(time.monotonic())
        return event

    async def next(self, predicate: Callable[[dict[str, Any]], bool] | str, timeout: float = 20.0) -> dict[str, Any]:
        """The next event (after the last one returned) that matches; reads as needed."""
        match = (lambda e: e["type"] == predicate) if isinstance(predicate, str) else predicate
        deadline = time.monotonic() + timeout
        while True:
            while self._cursor < len(self.events):
                event = self.events[self._cursor]
                self._cursor += 1
                if match(event):
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.close_code is not None:
                raise AssertionError(f"no matching event within {timeout} s (closed={self.close_code}); "
                                     f"last: {[e['type'] for e in self.events[-8:]]}")
            try:
                await self._recv(remaining)
            except asyncio.TimeoutError:
                pass

    async def drain(self, seconds: float) -> list[dict[str, Any]]:
        """Read whatever arrives within ``seconds``; returns those events."""
        start = len(self.events)
        deadline = time.monotonic() + seconds
        while self.close_code is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                if await self._recv(remaining) is None:
                    break
            except asyncio.TimeoutError:
                break
        return self.events[start:]

    async def wait_closed(self, timeout: float = 20.0) -> tuple[int | None, str | None]:
        deadline = time.monotonic() + timeout
        while self.close_code is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("the server did not close the socket")
            try:
                await self._recv(remaining)
            except asyncio.TimeoutError:
                continue
        return self.close_code, self.close_reason

    async def open(self, open_timeout_s: float = 20.0, **session: Any) -> dict[str, Any]:
        """Send the reference client's session.update (fields overridden by ``session``)."""
        payload = {**REFERENCE_SESSION, **session}
        await self.send({"type": "session.update", "session": {k: v for k, v in payload.items() if v is not ...}})
        created = await self.next(lambda e: e["type"] in ("session.created", "error"), timeout=open_timeout_s)
        assert created["type"] == "session.created", created
        await self.next("session.updated")
        return created["session"]

    def audio(self, response_id: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == "response.output_audio.delta"
                and (response_id is None or e["response_id"] == response_id)]

    async def wait_audio_frames(self, n: int, timeout: float = 60.0, response_id: str | None = None) -> np.ndarray:
        """Read until ``n`` output frames arrived; returns the concatenated int16 PCM."""
        deadline = time.monotonic() + timeout
        while sum(len(delta_pcm(e)) for e in self.audio(response_id)) < n * FRAME:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.close_code is not None:
                have = sum(len(delta_pcm(e)) for e in self.audio(response_id)) // FRAME
                raise AssertionError(f"got {have} of {n} output frames (closed={self.close_code})")
            try:
                await self._recv(remaining)
            except asyncio.TimeoutError:
                continue
        return np.concatenate([delta_pcm(e) for e in self.audio(response_id)])

    async def close(self) -> None:
        await self.ws.close()


async def works(client: Client) -> None:
    """Open a session, get two frames of audio back, close."""
    await client.open()
    for frame in speech_frames(2):
        await client.send(f32_append(frame))
    await client.wait_audio_frames(2)
    await client.send({"type": "session.close"})
    await client.wait_closed()


async def streams(server: "Server", frames: int) -> None:
    """A new greedy session on ``server`` gets ``frames`` frames of audio back, then closes."""
    client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
    await client.open(temperature=0)
    for frame in speech_frames(frames):
        await client.send(f32_append(frame))
    await client.wait_audio_frames(frames)
    await client.close()


# What the server's own work may cost the sessions while a witness streams, as the server
# measures it with the time its threads waited for a CPU left out (``orchestrator/own_clock.py``),
# so that busy processes beside the tests do not count:
# - a front-end worker's event loop held past LOOP_BLOCK_LIMIT_S (one of the bucket bounds of
#   ``personaplex_event_loop_blocked_seconds``).  Three frames: a loop held that long delays
#   every session of its worker by three frames, more than the 100 ms of lag a session may
#   have; the attacks of issue 18 held it for 2.3-4 s, a session's JSON takes milliseconds;
# - one piece of the engine's control work between ticks (a joining session's prefill, a
#   restart, a close) past ENGINE_PIECE_LIMIT_S (``personaplex_engine_job_own_seconds``): two
#   frames' worth of the 80 ms the live sessions share.  A prefill piece of the tiny model takes
#   under 20 ms on the 2-core dev VM; a whole long prompt in one piece took over a minute;
# - an engine call past the watchdog's deadline (``personaplex_tick_stalls_total``), for stalls
#   of a tick itself (wall clock: only gross ones, seconds).
LOOP_BLOCK_LIMIT_S = 0.25
ENGINE_PIECE_LIMIT_S = 0.16
ENGINE_JOB_KINDS = ("open", "restart", "close")
# How long the witness waits, once it stops sending, for its last sends to go out and for the
# output of what it sent: a count, so a slow host delays it and only a server that lost frames
# (or stopped reading) fails it.
WITNESS_CATCH_UP_S = 60.0


def server_costs(server: Any) -> dict[str, float]:
    """What ``server`` has counted so far of the costs above, by name (one scrape)."""
    pairs = {f"event-loop blocks past {LOOP_BLOCK_LIMIT_S} s":
             above_series("personaplex_event_loop_blocked_seconds", LOOP_BLOCK_LIMIT_S)}
    for kind in ENGINE_JOB_KINDS:
        pairs[f"engine {kind} pieces past {ENGINE_PIECE_LIMIT_S} s"] = above_series(
            "personaplex_engine_job_own_seconds", ENGINE_PIECE_LIMIT_S, f'kind="{kind}"')
    values = server.metrics(*(name for pair in pairs.values() for name in pair), "personaplex_tick_stalls_total")
    costs = {label: values[2 * i] - values[2 * i + 1] for i, label in enumerate(pairs)}
    costs["engine calls past the watchdog deadline"] = values[-1]
    return costs


class StreamingWitness:
    """A session streaming real speech at real time (one frame every 80 ms) from its own task
    while something else is done to the server (the ``async with`` body): its audio must keep
    coming.  On leaving it stops sending, waits for the answers to what it sent, and (``judge``)
    checks:

    - its socket and its reader lived through: a witness the server disconnected, or whose
      reader died, fails (with what ended it); so does one that could not send;
    - every frame it sent was answered with an output frame (counted, not timed);
    - the server counted none of the costs of ``server_costs`` while it streamed (a blocked
      event loop, a long piece of engine work, a stalled engine call), each measured by the
      server without the time its threads waited for a CPU.

    Its pauses between audio deltas (the time from the last one to the end counted too) are
    recorded, not judged: wall clock judges the machine as well (``longest_gap_s``).
    ``judge=False`` measures without failing (tests/e2e/hostile_run.py)."""

    def __init__(self, server: Server, *, catch_up_s: float = WITNESS_CATCH_UP_S, judge: bool = True) -> None:
        self.server = server
        self.catch_up_s = catch_up_s
        self.judge = judge
        self.arrivals: list[float] = []
        self.frames_sent = 0
        self.frames_answered = 0
        self.ended_at: float | None = None  # when it stopped sending (the last pause ends there)
        self._sending = True
        self._tasks: list[asyncio.Task] = []
        self.costs_before: dict[str, float] = {}

    def longest_gap_s(self, since: float = 0.0) -> float:
        """The longest pause between audio deltas that arrived after ``since`` (monotonic),
        the time from the last one to the end (or to now, while it streams) included."""
        times = [t for t in self.arrivals if t >= since]
        if not times:
            return float("nan")
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return float(np.diff([*times, max(end, times[-1])]).max())

    def server_costs(self) -> dict[str, float]:
        """The server's counts of ``server_costs`` now (all its workers and engines)."""
        return server_costs(self.server)

    async def __aenter__(self) -> "StreamingWitness":
        self.costs_before = await asyncio.to_thread(self.server_costs)
        self.client = await Client.connect(self.server.ws + "/v1/realtime?duplex=1")
        try:
            await self.client.open()
            messages = [json.dumps(f32_append(frame)) for frame in speech_frames(50)]
            self._tasks = [asyncio.create_task(self._pace(messages)), asyncio.create_task(self._read())]
            deadline = time.monotonic() + 30
            while len(self.arrivals) < 5:
                assert time.monotonic() < deadline, "the witness got no audio"
                assert not self._tasks[1].done(), self._reader_end()
                await asyncio.sleep(0.05)
        except BaseException:
            await self._stop_tasks()  # ``async with`` runs no __aexit__ for a failed __aenter__
            raise
        return self

    async def _pace(self, messages: list[str]) -> None:
        start = time.monotonic()
        for k in range(10**9):
            if not self._sending:
                return
            await self.client.ws.send(messages[k % len(messages)])
            self.frames_sent += 1
            await asyncio.sleep(max(0.0, start + (k + 1) * 0.08 - time.monotonic()))

    async def _read(self) -> None:
        async for message in self.client.ws:
            event = json.loads(message)
            if event["type"] == "response.output_audio.delta":
                self.arrivals.append(time.monotonic())
                self.frames_answered += len(delta_pcm(event)) // FRAME

    def _reader_end(self) -> str:
        """Why the reader stopped before the witness ended it."""
        reader = self._tasks[1]
        error = reader.exception() if not reader.cancelled() else None
        close = self.client.ws.close_code, self.client.ws.close_reason
        return f"the witness's reader ended early: {error!r}, close {close}, after {self.frames_answered} frames"

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if exc_info[0] is None:
                await self._finish()
        finally:
            await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.ws.close()

    async def _finish(self) -> None:
        pacer, reader = self._tasks
        await asyncio.sleep(1.0)  # the attack's after-effects show here too
        self._sending = False
        self.ended_at = time.monotonic()
        deadline = time.monotonic() + self.catch_up_s
        try:
            # Bounded: a server that stopped reading leaves a send waiting for buffer space.
            await asyncio.wait_for(asyncio.shield(pacer), self.catch_up_s)
        except asyncio.TimeoutError:
            assert not self.judge, f"the witness could not send for {self.catch_up_s} s (the server stopped reading)"
        except websockets.ConnectionClosed:
            pass  # the reader saw the close too: its end says why, below
        while self.frames_answered < self.frames_sent and not reader.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.judge:
            return
        costs = await asyncio.to_thread(self.server_costs)
        assert not reader.done(), self._reader_end()
        assert self.frames_answered >= self.frames_sent, \
            f"the witness sent {self.frames_sent} frames and got {self.frames_answered} back"
        grown = {name: costs[name] - self.costs_before.get(name, 0.0) for name in costs
                 if costs[name] > self.costs_before.get(name, 0.0)}
        assert not grown, f"while the witness streamed, the server counted {grown}"


def send_deflated_frame(server: Server, payload: bytes) -> int | None:
    """Open a websocket by hand, offering permessage-deflate (the server must decline), send
    one text frame with RSV1 set (compressed); the close code the server answers with (None:
    the connection ended without a close frame)."""
    host, port = server.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall((f"GET /v1/realtime?duplex=1 HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                      "Sec-WebSocket-Extensions: permessage-deflate\r\n\r\n").encode())
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(4096)
        head = response.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 101") and b"sec-websocket-extensions" not in head, head
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        sock.sendall(bytes([0xC1, 0x80 | 127]) + struct.pack(">Q", len(payload)) + mask + masked)  # FIN+RSV1, text
        data = response.split(b"\r\n\r\n", 1)[1]
        try:
            while True:
                if len(data) >= 2 and data[0] == 0x88:  # the close frame
                    return struct.unpack(">H", data[2:4])[0] if len(data) >= 4 else None
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
