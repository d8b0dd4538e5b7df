"""One raw websocket to the server that records every event with its arrival time.

The driver speaks the wire protocol directly (it must see handshake refusals, which a
convenience client would turn into exceptions), so this is a transport plus a recorder:
- a reader task appends every server event and the client's monotonic arrival time;
- frames that break the protocol (binary, non-JSON, a non-object, no string ``type``,
  ``delta: null``) are recorded as violations, never silently dropped;
- ``wait_for`` wakes on each new event instead of polling.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from typing import Any, Callable, Mapping

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from . import wire

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CONNECT_ACCEPTS_PROXY = "proxy" in inspect.signature(connect.__init__).parameters


class ServerErrorEvent(RuntimeError):
    """The server sent an ``error`` event where the driver needed progress."""


class ProtocolViolation(RuntimeError):
    """The server sent a frame that is not a JSON object event."""


class ConnectionLost(RuntimeError):
    """The socket closed before the step finished."""


class RealtimeProbe:
    def __init__(self, url: str, *, label: str, api_key: str | None = None, close_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.label = label
        self._api_key = api_key  # sent as a header only; never logged or exported
        self.close_timeout_s = close_timeout_s
        self.clock = clock
        self.events: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        self.violations: list[dict[str, Any]] = []
        self.audio_samples = 0  # valid PCM16 samples received so far (for cheap waits and progress)
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False

    # Connection ---------------------------------------------------------------------------------
    async def connect(self, timeout_s: float) -> None:
        kwargs: dict[str, Any] = {
            "max_size": MAX_MESSAGE_BYTES,
            "close_timeout": self.close_timeout_s,
            "open_timeout": timeout_s,
            # Base64 audio barely compresses; deflate would only cost CPU on both ends.
            "compression": None,
        }
        if _CONNECT_ACCEPTS_PROXY:
            kwargs["proxy"] = None  # connect directly; an operator's HTTP proxy is not the server
        if self._api_key:
            kwargs["additional_headers"] = {"Authorization": f"Bearer {self._api_key}"}
        self._ws = await connect(self.url, **kwargs)
        self._reader = asyncio.create_task(self._read(), name=f"read-{self.label}")

    async def close(self) -> None:
        """Close the websocket (bounded by ``close_timeout_s``) and stop reading."""
        try:
            if self._ws is not None:
                await self._ws.close()
        finally:
            if self._reader is not None:
                self._reader.cancel()
                try:
                    await self._reader
                except asyncio.CancelledError:
                    pass
            self._closed = True

    async def __aenter__(self) -> "RealtimeProbe":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for message in self._ws:
                self._record(message, self.clock())
        except ConnectionClosed:
            pass
        finally:
            self._closed = True
            self.close_code = self._ws.close_code
            self.close_reason = self._ws.close_reason
            self._wake.set()

    def _record(self, message: str | bytes, at: float) -> None:
        index = len(self.events)
        if isinstance(message, bytes):
            self._violation("binary_frame", index, at)
            return
        try:
            event = json.loads(message)
        except ValueError:
            self._violation("invalid_json", index, at)
            return
        if not isinstance(event, dict):
            self._violation("non_object_event", index, at)
            return
        if not isinstance(event.get("type"), str):
            self._violation("missing_event_type", index, at)
        elif "delta" in event and event["delta"] is None:
            self._violation("null_delta", index, at)
        if wire.is_audio_delta(event):
            try:
                self.audio_samples += len(wire.audio_packet_pcm(event)) // wire.PCM16_BYTES
            except wire.InvalidAudioPacket:
                pass  # judged, with its code, by packets.packet_log
        self.events.append(event)
        self.received_at.append(at)
        self._wake.set()

    def _violation(self, code: str, index: int, at: float) -> None:
        self.violations.append({"event_index": index, "received_at_s": at, "code": code})
        self._wake.set()

    async def send(self, event: Mapping[str, Any], timeout_s: float | None = None) -> None:
        if self._ws is None:
            raise ConnectionLost("not connected")
        text = json.dumps(event, separators=(",", ":"))
        if timeout_s is None:
            await self._ws.send(text)
        else:
            await asyncio.wait_for(self._ws.send(text), timeout_s)

    # Reading the record -------------------------------------------------------------------------
    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e.get("type") == kind)

    @property
    def output_frames(self) -> int:
        return self.audio_samples // wire.FRAME_SAMPLES

    def errors(self) -> list[dict[str, Any]]:
        return self.of_type("error")

    def error_codes(self) -> list[str]:
        return [wire.error_code_of(e) for e in self.errors()]

    def check(self) -> None:
        """Raise if the session can no longer make progress: an error event, a protocol
        violation, or a closed socket."""
        if self.errors():
            raise ServerErrorEvent(f"{self.label}: server error {self.error_codes()[0]}")
        if self.violations:
            raise ProtocolViolation(f"{self.label}: {self.violations[0]['code']}")
        if self._closed:
            raise ConnectionLost(f"{self.label}: connection closed (code {self.close_code})")

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str, *,
                       fail_fast: bool = True) -> None:
        """Wait until ``predicate()`` holds.  With ``fail_fast`` an error event, a violation or a
        closed socket ends the wait at once (``check``); otherwise only a close does."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if predicate():
                return
            if fail_fast:
                self.check()
            elif self._closed:
                raise ConnectionLost(f"{self.label}: connection closed while waiting for {what}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"{self.label}: no {what} within {timeout_s:g} s")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                pass

    async def wait_event(self, kind: str, timeout_s: float, *, fail_fast: bool = True) -> dict[str, Any]:
        """The first event of type ``kind`` (waiting for it if needed)."""
        await self.wait_for(lambda: self.count(kind) > 0, timeout_s, kind, fail_fast=fail_fast)
        return self.of_type(kind)[0]

    async def wait_closed(self, timeout_s: float) -> None:
        await self.wait_for(lambda: self._closed, timeout_s, "socket close", fail_fast=False)
