"""One websocket connection: handshake, the event loop of its session, and closing.

Handshake: the first ``session.update`` (within ``first_message_timeout_s``) opens the
session; other events sent before it are held as their text (up to
``max_pending_input_bytes``) and run right after ``session.created`` (a stock OpenAI client
may pipeline appends), each let go as it runs: neither they nor the opening event stay
referenced for the session's life.  A handshake failure sends one ``error`` and closes the
socket; after that, errors never close it.

Slot accounting: whatever way the connection ends (``session.close``, idle timeout, a plain
websocket close, a client that stops reading, shutdown) the engine slot is released once and
the admission slot is given back only after that.

Limits: the caller's per-address and per-key counts (``limits.py``) are taken for the whole
life of the socket; client events beyond ``max_events_per_s`` are dropped with at most one
``event_rate_exceeded`` error a second.  A client that sends more than the websocket's
inbound queue holds before the handler reads it (``inbound.py``) is closed with
``input_backpressure``.  No message or event is kept referenced while the next is awaited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections import deque
from typing import Any, Mapping

from ..protocol import events as ev
from ..protocol import json_codec
from ..protocol.client_events import CLOSE_EVENTS, client_event_id, decode_event
from ..protocol.errors import ProtocolError
from ..protocol.held_bytes import ITEM_BYTES, held_bytes
from ..protocol.session_config import SessionConfig, parse_session_update, session_payload
from .close_codes import REFUSAL_CLOSE_CODES, REFUSAL_DEFAULT, SESSION_CLOSE_CODES, close_socket
from .engine_pool import DeviceEngine
from .inbound import ClientMessages, InboundOverflow
from .limits import EventRate
from .memory_bound import max_session_object_bytes
from .services import Services
from .session import Session
from .session_core import send_outbox

log = logging.getLogger(__name__)

_TIMEOUT = object()  # handshake receive outcomes other than a message
_SHUTDOWN = object()


class Connection:
    def __init__(self, websocket: Any, services: Services, *, url_model: str | None, autostart: bool,
                 client: tuple[str, str | None] | None = None) -> None:
        self.ws = websocket
        self.services = services
        self.settings = services.settings
        self.url_model = url_model
        self.autostart = autostart
        self.client = client  # (address, API key digest) counted against the per-client limits
        self._cleanup: concurrent.futures.Future | None = None
        self._engine: DeviceEngine | None = None  # where the session lives, once placed
        self._rate = EventRate(self.settings.max_events_per_s, self.settings.max_input_bytes_per_s,
                               self.settings.max_event_bytes)
        self._held: deque[str] = deque()  # events sent before session.update, as their text

    async def run(self) -> None:
        assert self.client is not None, "run() needs the caller (only refuse_unsupported() goes without)"
        refusal = self.services.admit_client(*self.client)
        if refusal is not None:
            extra = {"retry_after_s": refusal.retry_after_s} if refusal.retry_after_s is not None else {}
            await self._refuse(ProtocolError(refusal.code, refusal.message, retryable=True, **extra))
            return
        try:
            await self._run()
        finally:
            self.services.release_client(*self.client)

    async def _run(self) -> None:
        first = await self._handshake()
        if first is None:
            return
        eid = client_event_id(first)
        try:
            config = self._configure(first)
        except ProtocolError as exc:
            first = None
            await self._refuse(exc, eid)
            return
        first = None  # the opening event (up to max_event_bytes) is not held while the session opens
        session = await self._open(config, eid)
        if session is None:
            return
        sender = asyncio.ensure_future(send_outbox(self.ws, session, self.services.metrics))
        try:
            reason = self._run_held(session) or await self._serve(session)
            await self._finish(session, reason, sender)
        finally:
            # Reached by cancellation too: Quart cancels the handler when the client disconnects.
            self._release(session, "disconnect")
            sender.cancel()

    async def refuse_unsupported(self) -> None:
        """``duplex=0`` asks for the turn-based API, which this server does not have."""
        await self._refuse(ProtocolError("unsupported", "Realtime API is not available"))

    # Handshake --------------------------------------------------------------------------------
    async def _handshake(self) -> Mapping[str, Any] | None:
        """The opening ``session.update`` (other events before it wait in ``_held``), or None
        once the socket is refused."""
        if self.autostart:
            return {"type": "session.update", "session": {}}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.first_message_timeout_s
        held_size = 0
        first = True
        while True:
            try:
                message = await self._receive_before(deadline)
            except InboundOverflow as exc:
                await self._refuse(exc.client_error())
                return None
            if message is _SHUTDOWN:
                self.services.metrics.inc("connections_refused", "shutdown")
                await self._refuse(ProtocolError("server_shutting_down", "the server is shutting down", retryable=True))
                return None
            if message is _TIMEOUT:
                await self._refuse(ProtocolError("config_timeout", "Timeout waiting for session.update"))
                return None
            if not self._rate.allow(_size(message)):
                message = None  # not held while the error is written
                await self._rate_limited(None)
                continue
            try:
                event = decode_event(message, self.settings.max_event_bytes)
            except ProtocolError as exc:
                refuse = first and isinstance(message, str) and exc.code in ("invalid_json", "bad_event")
                message = None
                if refuse:
                    await self._refuse(exc)
                    return None
                await self._send_direct(exc)  # binary or oversize: say so, keep waiting
                continue
            first = False
            kind = event["type"]
            if kind == "session.update":
                return event
            if kind == "session.resume":
                await self._refuse(ProtocolError("unsupported_session_resume", "session resume is not supported"),
                                   client_event_id(event))
                return None
            if kind in CLOSE_EVENTS:
                await self._send_json({"type": "session.closed", "event_id": ev.new_event_id(), "session_id": None,
                                       "reason": "client_close", "event": {"type": kind}})
                await self._close_socket(1000, "client_close")
                return None
            # Held as the text it came as, decoded again when it runs: what it costs is its size
            # (a decoded event of many small values takes many times its text).
            eid, event = client_event_id(event), None
            size = held_bytes(message) + ITEM_BYTES
            if held_size + size > self.settings.max_pending_input_bytes:
                message = None
                await self._send_direct(ProtocolError("input_backpressure", "too many events before session.update"),
                                        eid)
                continue
            self._held.append(message)
            held_size += size
            message = None

    async def _receive_before(self, deadline: float) -> Any:
        """The next message, or ``_TIMEOUT`` at ``deadline``, or ``_SHUTDOWN`` once draining."""
        receive = asyncio.ensure_future(self.ws.receive())
        shutdown = asyncio.ensure_future(self.services.shutdown_started.wait())
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            done, _ = await asyncio.wait((receive, shutdown), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (receive, shutdown):
                if not task.done():
                    task.cancel()
        if receive in done:
            return receive.result()
        return _SHUTDOWN if shutdown in done else _TIMEOUT

    def _configure(self, event: Mapping[str, Any]) -> SessionConfig:
        """The opening ``session.update`` -> the session's configuration (or ``ProtocolError``)."""
        defaults = SessionConfig(model=self.url_model or "", idle_timeout_s=self.settings.idle_timeout_s)
        return parse_session_update(session_payload(event), defaults, is_open=False, input_rate_locked=False,
                                    max_instructions_chars=self.settings.max_instructions_chars,
                                    max_session_bytes=max_session_object_bytes(self.settings))

    async def _open(self, config: SessionConfig, eid: str | None) -> Session | None:
        services = self.services
        session_id = ev.new_session_id()
        try:
            self._engine = await services.open_session(session_id, config.spec())
        except ProtocolError as exc:
            await self._refuse(exc, eid)
            return None
        engine = self._engine
        if not config.model:
            config = dataclasses.replace(config, model=services.model_name)
        session = Session(session_id, config, port=engine.port, settings=self.settings,
                          metrics=services.metrics, caps=services.caps)
        services.add_session(session)
        if services.draining:  # the drain began while the slot was being prepared
            session.request_stop("shutdown")
        log.info("session %s opened on %s (voice=%s)", session_id, engine.label, config.voice)
        session.emit({"type": "session.created", "session": session.public()}, journal=False)
        session.emit({"type": "session.updated", "session": session.public()})
        return session

    # The open session -------------------------------------------------------------------------
    def _run_held(self, session: Session) -> str | None:
        """Run the events held before the session opened, letting each go as it runs."""
        held = self._held
        while held:
            reason = self._take(session, held.popleft())
            if reason is not None:
                held.clear()
                return reason
        return None

    async def _serve(self, session: Session) -> str:
        """Read client events until one closes the session; returns the close reason."""
        messages = ClientMessages(self.ws, session, lambda: session.config.idle_timeout_s)
        try:
            while True:
                message = await messages.next()
                if messages.ended is not None:
                    return messages.ended
                if not self._rate.allow(_size(message)):
                    message = None  # not held while the error is written
                    await self._rate_limited(session)
                    continue
                reason = self._take(session, message)
                message = None  # not held while the next one is awaited
                if reason is not None:
                    return reason
        finally:
            messages.close()

    def _take(self, session: Session, message: Any) -> str | None:
        """One client message within the rate limits; returns a close reason if it ends the session."""
        try:
            event = decode_event(message, self.settings.max_event_bytes)
        except ProtocolError as exc:
            session.emit_error(exc)
            return None
        return session.handle(event)

    # Closing ----------------------------------------------------------------------------------
    def _release(self, session: Session, reason: str) -> concurrent.futures.Future:
        """Stop the session and free its engine slot (once); admission follows the engine."""
        if self._cleanup is None:
            assert self._engine is not None  # a session exists only once placed on an engine
            self._cleanup = self.services.close_session(session, self._engine, "realtime", reason)
        return self._cleanup

    async def _finish(self, session: Session, reason: str, sender: asyncio.Future) -> None:
        """Orderly close: free the slot, then ``session.closed``, flush, close frame."""
        timeout = self.settings.close_timeout_s
        await self.services.wait_closed(session.id, self._release(session, reason))  # then (reference) the event
        session.emit({"type": "session.closed", "session_id": session.id, "reason": reason,
                      "event": {"type": "session.close", "reason": session.client_reason or reason}}, force=True)
        try:
            await asyncio.wait_for(session.outbox.drained(), timeout)
        except asyncio.TimeoutError:
            log.info("session %s: client did not read its last events; closing anyway", session.id)
        sender.cancel()
        await self._close_socket(SESSION_CLOSE_CODES.get(reason, 1000), reason)

    # Sending outside a session (handshake) ----------------------------------------------------
    async def _send_json(self, payload: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(self.ws.send(json_codec.dumps(payload)),
                                   self.settings.close_timeout_s)
        except Exception:  # noqa: BLE001 - the client is gone or not reading; nothing to tell it
            pass

    async def _rate_limited(self, session: Session | None) -> None:
        """An event over the event or byte rate was dropped; say so at most once a second."""
        self.services.metrics.inc("events_dropped")
        if not self._rate.should_report():
            return
        settings = self.settings
        error = ProtocolError("event_rate_exceeded", f"more than {settings.max_events_per_s:g} events or "
                              f"{settings.max_input_bytes_per_s} bytes per second: {self._rate.take_dropped()} "
                              "event(s) dropped", retryable=True)
        if session is not None:
            session.emit_error(error)
        else:
            await self._send_direct(error)

    async def _send_direct(self, error: ProtocolError, client_id: str | None = None) -> None:
        self.services.metrics.inc("errors", error.code)
        await self._send_json({"type": "error", "event_id": ev.new_event_id(), "error": error.payload(client_id)})

    async def _refuse(self, error: ProtocolError, client_id: str | None = None) -> None:
        """A handshake failure: one error event, then close the socket (1008; 1013 = try again
        later, 1001 = going away)."""
        await self._send_direct(error, client_id)
        await self._close_socket(REFUSAL_CLOSE_CODES.get(error.code, REFUSAL_DEFAULT), error.code)

    async def _close_socket(self, code: int, reason: str) -> None:
        await close_socket(self.ws, code, reason, self.settings.close_timeout_s)


def _size(message: Any) -> int:
    """Length of a websocket message (characters of text: the cheap, close-enough measure)."""
    return len(message) if isinstance(message, (str, bytes)) else 0
