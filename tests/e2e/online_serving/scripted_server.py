"""A small scripted realtime duplex server for the driver's CPU tests.

It speaks just enough of the protocol (session.update -> session.created/updated, one output
frame per input frame, session.close -> session.closed) and misbehaves exactly as a test asks:
malformed packets, shared or changing response ids, no audio, a slow close, refusal at
capacity, legacy event names, server errors, binary frames.  Output audio is a fixed-amplitude
tone, so RMS and voiced-frame counts are known in advance.

It runs on its own event loop in a thread, so a test can call the driver's ``main()`` (which
owns ``asyncio.run``) or ``asyncio.run(run_load(...))`` against it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

RATE = 24_000
FRAME = 1_920
CAPABILITIES = {"implementation_level": "model_native_duplex", "chunk_period_ms": 80, "supports_multi_session": True,
                "supports_multi_session_same_replica": True, "supports_barge_in": False}


def tone_frame(amplitude: float, index: int) -> np.ndarray:
    """One 80 ms frame of a 300 Hz tone at ``amplitude`` (RMS = amplitude / sqrt(2))."""
    t = (np.arange(FRAME) + index * FRAME) / RATE
    return amplitude * np.sin(2 * np.pi * 300.0 * t)


def write_tone_wav(path: Path, seconds: float) -> Path:
    """A 24 kHz mono PCM16 WAV of a 200 Hz tone at 0.3 (the driver's input in these tests)."""
    t = np.arange(int(seconds * RATE)) / RATE
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes((0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype("<i2").tobytes())
    return Path(path)


def pcm16(samples: np.ndarray) -> bytes:
    return np.clip(np.rint(samples * 32767), -32768, 32767).astype("<i2").tobytes()


@dataclass
class Behaviour:
    capacity: int = 8  # concurrent sessions; one more is refused with resource_exhausted
    frames_per_delta: int = 1  # the first delta is always one frame, later ones this many
    amplitude: float = 0.1  # output tone amplitude (0 = digital silence)
    audio_event: str = "response.output_audio.delta"
    send_audio: bool = True
    corrupt: dict[int, str] = field(default_factory=dict)  # delta index -> how to break it
    shared_response_id: str | None = None  # every session uses this response id
    new_response_at_delta: int | None = None  # switch to a second response id from this delta on
    text_at_delta: int | None = 0  # the transcript delta after this audio delta says "hello"
    close_delay_s: float = 0.0  # wait this long before session.closed
    answer_close: bool = True
    error_at_frame: int | None = None  # send an error event after this input frame (0-based)
    binary_at_frame: int | None = None  # send a binary websocket frame after this input frame
    vllm_omni_metadata: bool = False
    foreign_metadata_session: bool = False  # metadata.session_id names another session
    delay_s: float = 0.0  # every output delta leaves this long after its input frame arrived
    drop_frames: frozenset[int] = frozenset()  # input frames (0-based) whose output is never sent
    # After the input stalls for silence_grace_s, feed this many frames of the server's own
    # silence (one per 80 ms), as a server that keeps a session clocked does.
    silence_frames: int = 0
    silence_grace_s: float = 0.3
    report_silence: bool = True  # say so in metadata.timing.silence_input_frames
    capabilities: dict[str, Any] = field(default_factory=lambda: dict(CAPABILITIES))


@dataclass
class SessionLog:
    session_id: str
    headers: dict[str, str]
    path: str
    received: list[dict[str, Any]] = field(default_factory=list)


class _Stream:
    """One session's output state, and its way out (at once, or ``delay_s`` late in order)."""

    def __init__(self, ws: ServerConnection, response_id: str, session_id: str, delay_s: float = 0.0) -> None:
        self.ws = ws
        self.response_id = response_id
        self.session_id = session_id
        self.delay_s = delay_s
        self.frames_in = 0
        self.frames_out = 0
        self.pending: list[np.ndarray] = []
        self.pending_silence = 0
        self.deltas = 0
        self._due: asyncio.Queue[tuple[float, str | bytes]] = asyncio.Queue()

    async def send(self, payload: str | bytes) -> None:
        if self.delay_s:
            self._due.put_nowait((asyncio.get_running_loop().time() + self.delay_s, payload))
        else:
            await self.ws.send(payload)

    async def send_when_due(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, payload = await self._due.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await self.ws.send(payload)


class ScriptedServer:
    def __init__(self, **behaviour: Any) -> None:
        self.behaviour = Behaviour(**behaviour)
        self.sessions: list[SessionLog] = []
        self.refused = 0
        self._live = 0
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._handlers: set[asyncio.Task] = set()
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime?duplex=1"

    def __enter__(self) -> "ScriptedServer":
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("scripted server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))
        assert self._thread is not None
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        async with serve(self._handle, "127.0.0.1", 0, max_size=2**24, compression=None) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            self._started.set()
            await self._stop
            for task in self._handlers:  # a handler may be sleeping in a slow close
                task.cancel()

    # One connection -------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle_connection(ws)
        except (ConnectionClosed, asyncio.CancelledError):
            pass
        finally:
            self._handlers.discard(task)

    async def _handle_connection(self, ws: ServerConnection) -> None:
        b = self.behaviour
        first = json.loads(await ws.recv())
        if self._live >= b.capacity:
            self.refused += 1
            await ws.send(json.dumps({"type": "error", "event_id": "event_refused", "error": {
                "type": "rate_limit_error", "code": "resource_exhausted",
                "message": f"duplex_session_capacity_exhausted: limit={b.capacity}"}}))
            await ws.close(1013, "resource_exhausted")
            return
        self._live += 1
        number = next(self._ids)
        session_id = f"duplex-{number:032x}"
        log = SessionLog(session_id, dict(ws.request.headers), ws.request.path, [first])
        self.sessions.append(log)
        try:
            await self._serve(ws, log, number)
        except ConnectionClosed:
            pass
        finally:
            self._live -= 1

    async def _serve(self, ws: ServerConnection, log: SessionLog, number: int) -> None:
        b = self.behaviour
        session = {"id": log.session_id, "object": "realtime.session", "capabilities": b.capabilities}
        await ws.send(json.dumps({"type": "session.created", "session": session}))
        await ws.send(json.dumps({"type": "session.updated", "session": session}))
        stream = _Stream(ws, b.shared_response_id or f"resp_{number:032x}", log.session_id, b.delay_s)
        sender = asyncio.create_task(stream.send_when_due()) if b.delay_s else None
        silence_left = b.silence_frames
        feeding = False
        try:
            while True:
                timeout = None
                if stream.frames_in and silence_left:
                    timeout = FRAME / RATE if feeding else b.silence_grace_s
                try:
                    message = await asyncio.wait_for(ws.recv(), timeout)
                except asyncio.TimeoutError:  # the input stalled: one frame of the server's own silence
                    feeding = True
                    silence_left -= 1
                    await self._output(stream, silence=True)
                    continue
                feeding = False
                if not await self._on_message(stream, log, message):
                    return
        finally:
            if sender is not None:
                sender.cancel()

    async def _on_message(self, stream: "_Stream", log: SessionLog, message: str | bytes) -> bool:
        """Answer one client message; False once the session is over."""
        b = self.behaviour
        event = json.loads(message)
        log.received.append(event)
        kind = event.get("type")
        if kind == "session.close":
            if b.close_delay_s:
                await asyncio.sleep(b.close_delay_s)
            if b.answer_close:
                await stream.ws.send(json.dumps({"type": "session.closed", "session_id": log.session_id,
                                                 "reason": "client_close"}))
                await stream.ws.close(1000, "client_close")
            return False
        if kind != "input_audio_buffer.append":
            return True
        samples = np.frombuffer(base64.b64decode(event["audio"]), dtype="<f4")
        assert samples.size == FRAME, "the driver sends whole 1920-sample frames"
        if stream.frames_in == 0:
            await stream.send(json.dumps({"type": "response.created", "response_id": stream.response_id,
                                          "response": {"id": stream.response_id, "status": "in_progress"}}))
        frame = stream.frames_in
        stream.frames_in += 1
        if frame not in b.drop_frames:
            await self._output(stream, silence=False)
        if b.error_at_frame == frame:
            await stream.send(json.dumps({"type": "error", "error": {"type": "server_error", "code": "engine_error",
                                                                    "message": "scripted failure"}}))
        if b.binary_at_frame == frame:
            await stream.send(b"\x00\x01")
        return True

    async def _output(self, stream: "_Stream", *, silence: bool) -> None:
        """One output frame; a delta (and its transcript delta) once enough are pending."""
        b = self.behaviour
        stream.pending.append(tone_frame(b.amplitude, stream.frames_out))
        stream.frames_out += 1
        stream.pending_silence += silence
        want = 1 if stream.deltas == 0 else b.frames_per_delta
        if not b.send_audio or len(stream.pending) < want:
            return
        rid = stream.response_id
        if b.new_response_at_delta is not None and stream.deltas >= b.new_response_at_delta:
            rid = stream.response_id + "_b"
        event = self._delta(rid, np.concatenate(stream.pending), stream.deltas, stream.session_id)
        if b.report_silence:
            event["metadata"]["timing"] = {"silence_input_frames": stream.pending_silence}
        await stream.send(json.dumps(event))
        text = "hello" if stream.deltas == b.text_at_delta else " "
        await stream.send(json.dumps({"type": "response.output_audio_transcript.delta", "response_id": rid,
                                      "delta": text}))
        stream.pending.clear()
        stream.pending_silence = 0
        stream.deltas += 1

    def _delta(self, response_id: str, samples: np.ndarray, index: int, session_id: str) -> dict[str, Any]:
        b = self.behaviour
        event: dict[str, Any] = {"type": b.audio_event, "response_id": response_id, "item_id": "item_" + response_id,
                                 "output_index": 0, "content_index": 0,
                                 "delta": base64.b64encode(pcm16(samples)).decode(), "format": "pcm16",
                                 "sample_rate_hz": RATE,
                                 "metadata": {"session_id": "duplex-someone-else" if b.foreign_metadata_session
                                              else session_id}}
        if b.vllm_omni_metadata:
            event["metadata"]["vllm_omni"] = {"runtime_impl": "scheduler_data_plane",
                                              "uses_model_runner_scheduler": True, "runner_kv_backed": True}
        how = b.corrupt.get(index)
        if how == "bad_base64":
            event["delta"] = event["delta"][:-4] + "!!!!"
        elif how == "odd_bytes":
            event["delta"] = base64.b64encode(pcm16(samples)[:-1]).decode()
        elif how == "wrong_rate":
            event["sample_rate_hz"] = 16000
        elif how == "no_response_id":
            event["response_id"] = ""
        elif how == "no_delta":
            del event["delta"]
        elif how == "empty":
            event["delta"] = ""
        return event


def main() -> None:
    """``python -m tests.e2e.online_serving.scripted_server [BEHAVIOUR_JSON]``: serve in this
    process (so a long test's server does not share the driver's interpreter), print
    ``port N`` once listening, stop when stdin closes."""
    import sys

    behaviour = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    with ScriptedServer(**behaviour) as server:
        print(f"port {server.port}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
