"""One raw websocket to the server that records what it sends, at a flat cost per event.

The driver speaks the wire protocol directly (it must see handshake refusals, which a
convenience client would turn into exceptions), so this is a transport plus a recorder:
- a reader task takes every server event with the client's monotonic arrival time and
  updates counters, the error list and the audio packet log (``packets.PacketLog``) in
  constant time; nothing ever re-scans the history, so a check before every send stays cheap
  at frame 3000 (an earlier driver spent two thirds of its CPU there);
- the raw events are kept only when asked (the lifecycle mode writes them out); a load
  session keeps counts, the first event of each type, errors and the packet log;
- ``freeze_packets`` ends the window the acceptance checks see (events during cleanup still
  count as errors or violations, but add no audio);
- frames that break the protocol (binary, non-JSON, a non-object, no string ``type``,
  ``delta: null``) are recorded as violations, never silently dropped;
- ``wait_for`` wakes on each new event instead of polling.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import time
from collections import Counter
from typing import Any, Callable, Mapping

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from . import wire
from .packets import PacketLog

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_HAS_TIMEOUT_SCOPE = sys.version_info >= (3, 11)
_CONNECT_ACCEPTS_PROXY = "proxy" in inspect.signature(connect.__init__).parameters


class ServerErrorEvent(RuntimeError):
    """The server sent an ``error`` event where the driver needed progress."""


class ProtocolViolation(RuntimeError):
    """The server sent a frame that is not a JSON object event."""


class ConnectionLost(RuntimeError):
    """The socket closed before the step finished."""


class RealtimeProbe:
    def __init__(self, url: str, *, label: str, api_key: str | None = None, close_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, keep_events: bool = False,
                 voiced_rms_threshold: float = 1e-3) -> None:
        self.url = url
        self.label = label
        self._api_key = api_key  # sent as a header only; never logged or exported
        self.close_timeout_s = close_timeout_s
        self.clock = clock
        # Every event and its arrival, only with keep_events (the lifecycle mode writes them).
        self.events: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        self.keep_events = keep_events
        self.event_count = 0
        self.counts: Counter[str] = Counter()  # events by type
        self.first: dict[str, dict[str, Any]] = {}  # the first event of each type
        self.first_index: dict[str, int] = {}  # ... and its index among all events
        self.error_events: list[dict[str, Any]] = []
        self.violations: list[dict[str, Any]] = []
        self.packets = PacketLog(voiced_rms_threshold, keep_pcm=keep_events)
        self.packets_frozen = False
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
        index = self.event_count
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
        kind = event.get("type")
        if not isinstance(kind, str):
            self._violation("missing_event_type", index, at)
        elif "delta" in event and event["delta"] is None:
            self._violation("null_delta", index, at)
        self.event_count += 1
        if isinstance(kind, str):
            self.counts[kind] += 1
            if kind not in self.first:
                self.first[kind] = event
                self.first_index[kind] = index
            if kind == "error":
                self.error_events.append(event)
        if not self.packets_frozen:
            self.packets.add(event, at)
        if self.keep_events:
            self.events.append(event)
            self.received_at.append(at)
        self._wake.set()

    def _violation(self, code: str, index: int, at: float) -> None:
        self.violations.append({"event_index": index, "received_at_s": at, "code": code})
        self._wake.set()

    async def send(self, event: Mapping[str, Any], timeout_s: float | None = None) -> None:
        await self.send_text(wire.encode(event), timeout_s)

    async def send_text(self, text: str, timeout_s: float | None = None) -> None:
        """Send one already-encoded event (the paced frames are encoded once per run)."""
        if self._ws is None:
            raise ConnectionLost("not connected")
        if timeout_s is None:
            await self._ws.send(text)
        elif _HAS_TIMEOUT_SCOPE:  # no task per send, unlike wait_for before Python 3.12
            async with asyncio.timeout(timeout_s):
                await self._ws.send(text)
        else:
            await asyncio.wait_for(self._ws.send(text), timeout_s)

    def freeze_packets(self) -> None:
        """Stop adding to the packet log: what arrives from now on is outside the measured
        window (errors and violations are still recorded)."""
        self.packets_frozen = True

    async def settle(self) -> None:
        """Finish what the record needs after the window (nothing here: Realtime audio is
        tallied as it arrives)."""

    # Reading the record -------------------------------------------------------------------------
    def count(self, kind: str) -> int:
        return self.counts[kind]

    @property
    def output_frames(self) -> int:
        """Whole output frames received so far (valid audio only)."""
        return self.packets.output_samples // wire.FRAME_SAMPLES

    def errors(self) -> list[dict[str, Any]]:
        return self.error_events

    def error_codes(self) -> list[str]:
        return [wire.error_code_of(e) for e in self.error_events]

    def check(self) -> None:
        """Raise if the session can no longer make progress: an error event, a protocol
        violation, or a closed socket.  Constant time: it runs before every send."""
        if self.error_events:
            raise ServerErrorEvent(f"{self.label}: server error {wire.error_code_of(self.error_events[0])}")
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
        await self.wait_for(lambda: kind in self.first, timeout_s, kind, fail_fast=fail_fast)
        return self.first[kind]

    async def wait_first_of(self, kinds: tuple[str, ...], timeout_s: float, what: str) -> dict[str, Any]:
        """The first event of any type in ``kinds`` (an error answer included: no fail-fast)."""
        await self.wait_for(lambda: any(k in self.first for k in kinds), timeout_s, what, fail_fast=False)
        return self.first[min((k for k in kinds if k in self.first), key=self.first_index.__getitem__)]

    async def wait_closed(self, timeout_s: float) -> None:
        await self.wait_for(lambda: self._closed, timeout_s, "socket close", fail_fast=False)

