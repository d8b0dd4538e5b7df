"""One duplex conversation over an open websocket: the client side of the protocol.

``open`` sends ``session.update`` and waits for ``session.created``; ``stream`` sends 80 ms
frames while a reader task collects audio, text and errors; ``drain`` waits for the answers
to every sent frame (lockstep: one output frame per input frame); ``close`` sends
``session.close`` and waits for ``session.closed``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed

from engines.config import FRAME_SAMPLES

from ..protocol.audio import AudioError, decode_base64, float_to_pcm16, pcm16_base64

log = logging.getLogger(__name__)

AUDIO_EVENTS = frozenset({"response.output_audio.delta", "response.audio.delta"})
_FRAME_ID = "frame-"  # event_id prefix of our appends
TEXT_EVENTS = frozenset({"response.output_audio_transcript.delta", "response.text.delta",
                         "response.output_text.delta"})


class ServerRefused(Exception):
    """The server ended the conversation: a refused open, or the socket closed on us."""


@dataclass
class Progress:
    """What has happened so far; the reporter reads it, the CLI writes it out."""

    started: float = field(default_factory=time.monotonic)
    session_id: str | None = None
    frames_sent: int = 0
    frames_rejected: int = 0  # appends the server refused (e.g. input_backpressure): never answered
    frames_received: int = 0
    pcm: list[np.ndarray] = field(default_factory=list)  # int16 chunks as received
    text: str = ""
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    closed_reason: str | None = None

    @property
    def unanswered(self) -> int:
        return self.frames_sent - self.frames_rejected - self.frames_received

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def audio(self) -> np.ndarray:
        return np.concatenate(self.pcm) if self.pcm else np.zeros(0, dtype="<i2")


def error_of(event: dict[str, Any]) -> dict[str, Any]:
    """The error object of an ``error`` event (current envelope or the legacy flat one)."""
    error = event.get("error")
    if isinstance(error, dict):
        return error
    return {"code": event.get("code", "unknown"), "message": str(error), "type": "invalid_request_error"}


class Conversation:
    def __init__(self, ws: Any, *, on_text: Callable[[str], None] = lambda text: None,
                 on_audio: Callable[[np.ndarray], None] = lambda pcm16: None,
                 on_error: Callable[[dict[str, Any]], None] = lambda error: None) -> None:
        self.ws = ws
        self.progress = Progress()
        self._on_text, self._on_audio, self._on_error = on_text, on_audio, on_error
        self._sent_at: dict[int, float] = {}  # frame index -> send time, until answered (in order)
        self._epoch = 0
        self._answered = asyncio.Event()  # set on each received frame (wakes the window)
        self._closed = asyncio.Event()  # session.closed seen or the socket is gone
        self._reader: asyncio.Task | None = None

    # Opening ----------------------------------------------------------------------------------
    async def open(self, session: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self._send({"type": "session.update", "session": session})
        try:
            event = await asyncio.wait_for(self._created(), timeout_s)
        except asyncio.TimeoutError:
            raise ServerRefused(f"no session.created within {timeout_s:g} s") from None
        except ConnectionClosed as exc:
            raise ServerRefused(f"the server closed the connection before the session opened ({exc})") from None
        self.progress.session_id = event["session"].get("id")
        self._epoch = event["session"].get("epoch", 0)
        self._reader = asyncio.ensure_future(self._read())
        return event["session"]

    async def _created(self) -> dict[str, Any]:
        while True:
            message = await self.ws.recv()
            event = json.loads(message) if isinstance(message, str) else {}
            if event.get("type") == "session.created":
                return event
            if event.get("type") == "error":
                error = error_of(event)
                raise ServerRefused(f"the server refused the session: {error.get('code')} "
                                    f"({error.get('type')}): {error.get('message')}")

    # Streaming --------------------------------------------------------------------------------
    async def stream(self, frames: AsyncIterator[np.ndarray], *, window: int | None, stall_s: float) -> None:
        """Send every frame; with ``window``, never more than that many unanswered frames
        (sending faster than real time without piling input up in the server)."""
        async for frame in frames:
            if window is not None:
                await self._wait_for(lambda: self.progress.unanswered < window, stall_s,
                                     "the server stopped answering frames")
            if self._closed.is_set():
                raise ServerRefused(self._closed_message())
            index = self.progress.frames_sent
            self._sent_at[index] = time.monotonic()
            self.progress.frames_sent += 1
            # The event id comes back in an error about this append: then it will not be answered.
            await self._send({"type": "input_audio_buffer.append", "event_id": f"{_FRAME_ID}{index}",
                              "audio": pcm16_base64(float_to_pcm16(frame))})

    async def drain(self, stall_s: float) -> None:
        """Wait until every sent frame is answered (no progress for ``stall_s``: give up)."""
        await self._wait_for(lambda: self.progress.unanswered <= 0, stall_s,
                             "the server stopped answering before the last frame")

    async def close(self, timeout_s: float) -> None:
        if not self._closed.is_set():
            await self._send({"type": "session.close"})
            try:
                await asyncio.wait_for(self._closed.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("no session.closed within %.1f s; closing the socket", timeout_s)
        await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _wait_for(self, done: Callable[[], bool], stall_s: float, what: str) -> None:
        while not done():
            if self._closed.is_set():
                raise ServerRefused(self._closed_message())
            self._answered.clear()
            try:
                await asyncio.wait_for(self._answered.wait(), stall_s)
            except asyncio.TimeoutError:
                raise ServerRefused(f"{what} (nothing for {stall_s:g} s; "
                                    f"{self.progress.frames_received} of {self.progress.frames_sent} frames answered)") from None

    async def _send(self, event: dict[str, Any]) -> None:
        try:
            await self.ws.send(json.dumps(event, separators=(",", ":")))
        except Exception as exc:  # noqa: BLE001 - any transport failure ends the conversation
            self._closed.set()
            raise ServerRefused(self._closed_message() if self.progress.closed_reason else
                                f"the connection failed while sending: {exc}") from None

    def _closed_message(self) -> str:
        return f"the server closed the session ({self.progress.closed_reason or 'connection lost'})"

    # Receiving --------------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if isinstance(message, str):
                    self._handle(json.loads(message))
        except Exception as exc:  # noqa: BLE001 - a dropped connection: the waiters report it
            log.debug("reader stopped: %s", exc)
        finally:
            if self.progress.closed_reason is None:
                code = getattr(self.ws, "close_code", None)
                reason = getattr(self.ws, "close_reason", None)
                self.progress.closed_reason = f"socket closed, code {code}" + (f": {reason}" if reason else "")
            self._closed.set()
            self._answered.set()

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in AUDIO_EVENTS:
            self._audio(event)
        elif kind in TEXT_EVENTS and isinstance(event.get("delta"), str):
            self.progress.text += event["delta"]
            self._on_text(event["delta"])
        elif kind == "error":
            error = error_of(event)
            self.progress.errors.append(error)
            event_id = str(error.get("event_id", ""))
            if event_id.startswith(_FRAME_ID) and event_id[len(_FRAME_ID):].isdigit():
                self.progress.frames_rejected += 1
                self._sent_at.pop(int(event_id[len(_FRAME_ID):]), None)
                self._answered.set()
            self._on_error(error)
        elif kind == "session.closed":
            self.progress.closed_reason = str(event.get("reason"))
            self._closed.set()
            self._answered.set()

    def _audio(self, event: dict[str, Any]) -> None:
        try:
            raw = decode_base64(event.get("delta") or "")
        except AudioError:
            self.progress.errors.append({"code": "invalid_audio_base64", "message": "an audio delta is not base64"})
            return
        pcm16 = np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2")
        epoch = (event.get("metadata") or {}).get("epoch", self._epoch)
        if epoch != self._epoch:
            # The server restarted the model context (after an engine error) and dropped the
            # frames it had queued: frame numbers no longer pair up, so stop timing them.
            self._epoch = epoch
            self._sent_at = {}
        self.progress.pcm.append(pcm16)
        frames = len(pcm16) // FRAME_SAMPLES
        self.progress.frames_received += frames
        # Lockstep: each output frame is the model's step on the oldest unanswered input frame;
        # the round trip is timed on the delta's last frame.
        sent = None
        for _ in range(min(frames, len(self._sent_at))):
            sent = self._sent_at.pop(next(iter(self._sent_at)))
        if sent is not None:
            self.progress.latencies_ms.append(1000.0 * (time.monotonic() - sent))
        self._on_audio(pcm16)
        self._answered.set()
