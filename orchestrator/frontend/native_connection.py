"""One ``/api/chat`` websocket (spec/native-protocol.md): the query opens the session, the
handshake ``0x00`` goes out once the voice and persona prompt is in, then binary messages
both ways until either side ends it.

Clients of this protocol (NVIDIA's web client, LiveKit's plugin, the moshi clients) wait for
the handshake before they send audio; audio that arrives earlier waits in the socket and is
fed after the prompt, never before it.

What NVIDIA's server never does and this one does (its clients ignore the content of kind
``0x05`` but show a closed socket): a refusal (server full, per-client limits, a bad query,
an unknown voice, draining) is one ``0x05`` message with ``code: reason`` and a close, 1013
when trying again later may work, 1001 while shutting down, 1008 for the client's own
mistakes; ``PERSONAPLEX_REFUSE_WHEN_FULL=http`` makes "full" an HTTP 503 before the upgrade
instead (``routes.py``).  A server-side end of a live session (idle timeout, shutdown,
malformed audio, a client that stops reading, an engine failure) is a ``0x05`` and a close
with the code of its reason.  Messages the protocol does not allow from a client (empty,
unknown kind, text frames, oversize, over the rate limits) are dropped, counted in
``personaplex_native_messages_dropped_total`` and logged; the session goes on.

Slot accounting is the Realtime route's: whatever way the connection ends, the engine slot
is released once and the admission slot given back after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Mapping
from typing import Any

from ..protocol import events as ev
from ..protocol import native
from ..protocol.errors import ProtocolError
from .close_codes import REFUSAL_CLOSE_CODES, REFUSAL_DEFAULT, SESSION_CLOSE_CODES, close_socket
from .engine_pool import DeviceEngine
from .inbound import ClientMessages
from .limits import EventRate
from .native_session import PROTOCOL, NativeSession
from .session_core import send_outbox
from .services import Services

log = logging.getLogger(__name__)

_LOG_DROPS_EVERY_S = 1.0
# Why a session ended, said to the client when the server ended it without an error of its own.
_END_MESSAGES = {"timeout": "idle_timeout: no message from the client for {idle:g} s",
                 "shutdown": "server_shutting_down: the server is shutting down; connect again"}


class NativeConnection:
    def __init__(self, websocket: Any, services: Services, *, client: tuple[str, str | None]) -> None:
        self.ws = websocket
        self.services = services
        self.settings = services.settings
        self.client = client  # (address, API key digest) counted against the per-client limits
        self._engine: DeviceEngine | None = None
        self._cleanup: concurrent.futures.Future | None = None
        self._rate = EventRate(self.settings.max_events_per_s, self.settings.max_input_bytes_per_s,
                               self.settings.max_native_message_bytes)
        self._dropped = 0
        self._last_drop_log = float("-inf")

    async def run(self, query: Mapping[str, str]) -> None:
        refusal = self.services.admit_client(*self.client)
        if refusal is not None:
            await self._refuse(ProtocolError(refusal.code, refusal.message, retryable=True))
            return
        try:
            await self._run(query)
        finally:
            self.services.release_client(*self.client)

    async def _run(self, query: Mapping[str, str]) -> None:
        session = await self._open(query)
        if session is None:
            return
        sender = asyncio.ensure_future(send_outbox(self.ws, session, self.services.metrics))
        try:
            reason = await self._serve(session)
            await self._finish(session, reason, sender)
        finally:
            # Reached by cancellation too: Quart cancels the handler when the client disconnects.
            self._release(session, "disconnect")
            sender.cancel()

    async def _open(self, query: Mapping[str, str]) -> NativeSession | None:
        services = self.services
        try:
            spec = native.parse_query(query, self.settings.max_instructions_chars)
        except ProtocolError as exc:
            await self._refuse(exc)
            return None
        session_id = ev.new_session_id()
        try:
            self._engine = engine = await services.open_session(session_id, spec)
        except ProtocolError as exc:
            await self._refuse(exc)
            return None
        try:
            session = NativeSession(session_id, port=engine.port, settings=self.settings,
                                    metrics=services.metrics, codec=services.codec())
        except BaseException:  # e.g. no thread left for the stream's decoder: give the slot back
            engine.close(session_id)
            raise
        services.add_session(session)
        if services.draining:  # the drain began while the slot was being prepared
            session.request_stop("shutdown")
        log.info("native session %s opened on %s (voice=%s)", session_id, engine.label, spec.voice)
        session.send_handshake()  # the prompt is in: the client may start talking
        return session

    # The open session -------------------------------------------------------------------------
    async def _serve(self, session: NativeSession) -> str:
        """Read client messages until the session ends; returns the close reason."""
        messages = ClientMessages(self.ws, session, lambda: self.settings.idle_timeout_s)
        try:
            while True:
                message = await messages.next()
                if messages.ended is not None:
                    return messages.ended
                self._take(session, message)
                message = None  # not held while the next one is awaited
        finally:
            messages.close()

    def _take(self, session: NativeSession, message: Any) -> None:
        size = len(message) if isinstance(message, (str, bytes)) else 0
        if not self._rate.allow(size):
            self._drop(session, "rate", f"more than {self.settings.max_events_per_s:g} messages or "
                       f"{self.settings.max_input_bytes_per_s} bytes per second")
            return
        if isinstance(message, str):
            self._drop(session, "text_frame", "text frames are not part of this protocol (binary only)")
            return
        if size > self.settings.max_native_message_bytes:
            self._drop(session, "oversize", f"a message of {size} bytes (limit {self.settings.max_native_message_bytes})")
            return
        try:
            kind, payload = native.split(message)
        except ProtocolError as exc:
            self._drop(session, exc.code.removesuffix("_message"), exc.message)
            return
        if kind == native.AUDIO:
            if payload:
                session.feed(payload)
        elif kind not in (native.CONTROL, native.PING):  # those two: defined by the web client, unused
            self._drop(session, "unexpected_kind", f"kind {kind} is sent by servers, not clients")

    def _drop(self, session: NativeSession, reason: str, why: str) -> None:
        """A message the protocol does not allow: counted and logged (at most once a second
        per socket), answered with a 0x05 at most once a second; the session goes on."""
        self.services.metrics.inc("native_messages_dropped", reason)
        self._dropped += 1
        now = time.monotonic()
        if now - self._last_drop_log >= _LOG_DROPS_EVERY_S:
            self._last_drop_log = now
            log.info("native session %s: dropped a message (%s; %d dropped on this socket)", session.id, why,
                     self._dropped)
            session.emit_error(ProtocolError("message_dropped", why))

    # Closing ----------------------------------------------------------------------------------
    def _release(self, session: NativeSession, reason: str) -> concurrent.futures.Future:
        """Stop the session and free its engine slot (once); admission follows the engine."""
        if self._cleanup is None:
            assert self._engine is not None
            self._cleanup = self.services.close_session(session, self._engine, PROTOCOL, reason)
        return self._cleanup

    async def _finish(self, session: NativeSession, reason: str, sender: asyncio.Future) -> None:
        """A server-side end: free the slot, say why (0x05), flush, close frame."""
        timeout = self.settings.close_timeout_s
        session.request_stop(reason)  # nothing more is queued (encodes still in flight included)
        await self.services.wait_closed(session.id, self._release(session, reason))
        end = _END_MESSAGES.get(reason)
        if end is not None:
            session.outbox.put(native.error_message(end.format(idle=self.settings.idle_timeout_s)), force=True)
        try:
            await asyncio.wait_for(session.outbox.drained(), timeout)
        except asyncio.TimeoutError:
            log.info("native session %s: client did not read its last messages; closing anyway", session.id)
        sender.cancel()
        await close_socket(self.ws, SESSION_CLOSE_CODES.get(reason, 1000), reason, timeout)

    async def _refuse(self, error: ProtocolError) -> None:
        """No session: one 0x05 with the reason, then the close (its code says whether to retry)."""
        self.services.metrics.inc("errors", error.code)
        timeout = self.settings.close_timeout_s
        try:
            await asyncio.wait_for(self.ws.send(native.error_message(f"{error.code}: {error.message}")), timeout)
        except Exception:  # noqa: BLE001 - the client is gone or not reading
            pass
        await close_socket(self.ws, REFUSAL_CLOSE_CODES.get(error.code, REFUSAL_DEFAULT), error.code, timeout)
