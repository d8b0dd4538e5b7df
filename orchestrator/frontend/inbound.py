"""Client messages not yet read by a websocket's handler, bounded in bytes.

hypercorn hands each message it has assembled to the app through a queue of ten
(``max_app_queue_size``) and stops reading the socket while that is full; Quart's websocket
takes them from there into a queue of its own, without bound.  So a client that kept sending
while its handler was busy elsewhere (an open waiting for the engine, an error being written
to a client that reads nothing) made the worker hold all it sent: a flood reached 1.25 GiB.
Making Quart's queue wait when full would only move the pile to hypercorn's ten messages of up
to 16 MiB each.  The queue here never waits: it holds at most ``limit`` bytes (counted as
``protocol.held_bytes``, plus ``ITEM_BYTES`` a message; one message always fits an empty
queue), and a message that does not fit ends the connection: what is queued is dropped, so is
what comes later, and the handler's next ``receive`` raises ``InboundOverflow`` (the routes
close with ``input_backpressure``).  A handler that reads as it should never lets one event's
worth pile up.

Quart's hook for this is ``Quart.asgi_websocket_class`` (the class that runs a websocket's
ASGI messages); ``bounded_websocket_class`` builds one that gives each websocket this queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ..protocol.errors import ProtocolError
from ..protocol.held_bytes import ITEM_BYTES, held_bytes

if TYPE_CHECKING:
    from .session_core import SessionCore

log = logging.getLogger(__name__)

_warned: list[bool] = []


class InboundOverflow(Exception):
    """More client messages were waiting than the queue holds: the connection ends."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} bytes of client messages were waiting to be read")
        self.limit = limit

    def client_error(self) -> ProtocolError:
        """What the client is told, on either route, before the connection ends."""
        return ProtocolError("input_backpressure", f"{self}; send messages no faster than the server reads them")


class ClientMessages:
    """An open session's client messages in arrival order, for both routes' serve loops.
    ``next()`` gives the next one (which may itself be None: an empty message) until the
    session has stopped, the client has sent nothing for ``idle_timeout_s()`` (read at every
    wait: a session may change it), or more waited than the inbound queue holds (the client is
    told); then ``ended`` holds the close reason.  ``close()`` cancels the receive still pending."""

    def __init__(self, ws: Any, session: "SessionCore", idle_timeout_s: Callable[[], float]) -> None:
        self._ws = ws
        self._session = session
        self._idle_timeout_s = idle_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._receive: asyncio.Future | None = None
        self.ended: str | None = None

    async def next(self) -> Any:
        session = self._session
        while True:
            if self._receive is None:
                self._receive = asyncio.ensure_future(self._ws.receive())
            timeout = self._last + self._idle_timeout_s() - self._loop.time()
            if timeout <= 0:
                self.ended = "timeout"
                return None
            await asyncio.wait((self._receive, session.stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if session.stop.done():
                self.ended = session.stop.result()
                return None
            if self._receive.done():
                done, self._receive = self._receive, None
                try:
                    message = done.result()
                except InboundOverflow as exc:
                    session.emit_error(exc.client_error())
                    self.ended = "input_backpressure"
                    return None
                finally:
                    del done
                self._last = self._loop.time()
                return message

    def close(self) -> None:
        if self._receive is not None:
            self._receive.cancel()


class InboundQueue:
    """What Quart's websocket needs of its queue (``put`` by its receiving task, ``get`` by
    the handler's ``receive``), bounded in bytes and never waiting on ``put``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.overflowed = False
        self._items: deque[tuple[str | bytes, int]] = deque()
        self._ready = asyncio.Event()

    async def put(self, message: str | bytes) -> None:
        self.put_nowait(message)

    def put_nowait(self, message: str | bytes) -> None:
        if self.overflowed:
            return  # the connection is ending: dropped
        cost = held_bytes(message) + ITEM_BYTES
        if self._items and self.bytes + cost > self.limit:
            log.info("a websocket's client sent more than %d bytes its handler had not read yet: closing it",
                     self.limit)
            self.overflowed = True
            self._items.clear()
            self.bytes = 0
        else:
            self._items.append((message, cost))
            self.bytes += cost
        self._ready.set()

    async def get(self) -> str | bytes:
        while not self._items:
            if self.overflowed:
                raise InboundOverflow(self.limit)
            self._ready.clear()
            await self._ready.wait()
        message, cost = self._items.popleft()
        self.bytes -= cost
        return message


def bounded_websocket_class(limit: int) -> type:
    """Quart's websocket ASGI class with an ``InboundQueue`` of ``limit`` bytes."""
    from quart.asgi import ASGIWebsocketConnection

    class BoundedWebsocketConnection(ASGIWebsocketConnection):
        def __init__(self, app: Any, scope: Any) -> None:
            super().__init__(app, scope)
            # Quart's receiving task puts into, and the websocket's receive gets from, this
            # attribute (quart.asgi as of 0.22); it is read when the websocket is built.
            if not isinstance(getattr(self, "queue", None), asyncio.Queue) and not _warned:
                _warned.append(True)
                log.warning("quart.asgi.ASGIWebsocketConnection has no queue attribute: client messages "
                            "not yet read are not bounded")
            self.queue = InboundQueue(limit)  # type: ignore[assignment]

    return BoundedWebsocketConnection
