"""What hypercorn holds for a connection, bounded: the message it is assembling, the
transport of a connection it is closing, and how many connections a worker holds.

- **The message being assembled.**  hypercorn gathers a message's frames up to
  ``websocket_max_message_size`` *characters* (16 Mi by default) and closes the connection
  (1009) past it.  A text message with one character beyond U+FFFF is stored four bytes a
  character, so 16 Mi characters could take 64 MiB besides the buffer they are gathered in.
  ``bound_message_assembly`` makes hypercorn count a message as ``protocol.held_bytes`` does
  (four bytes a character once any piece of it is not ASCII), against the smaller of its own
  limit and ours (``max_event_bytes`` + ``MESSAGE_MARGIN``: an event a little over
  ``max_event_bytes`` still reaches the app, which answers ``event_too_large``).
- **A connection being closed.**  When the app is done with a websocket, hypercorn closes the
  transport and waits for it to flush, without a deadline: a client that reads nothing never
  takes the bytes, so the connection, its unsent frames and its tasks stayed for good (a
  client closed for ``output_backpressure`` kept ~140 MiB of a worker).
  ``bound_transport_close`` gives that wait ``close_timeout_s``, then aborts the transport
  (a TCP reset), which frees it.
- **Connections per worker.**  The same wrapper counts the connections a worker holds, from
  accept to the transport's end (``live_connections``): the routes refuse a websocket past
  ``max_connections_per_worker`` with that count, so a connection still closing counts too.

Each replaces one name of hypercorn 0.18 (``protocol.ws_stream.WebsocketBuffer``,
``asyncio.tcp_server.TCPServer.run`` and ``._close``) with a subclass or a wrapper of the
original (as ``ws_compression.py`` does); called when serving starts, in every worker.  A
hypercorn laid out otherwise is left as it is, with a warning: the bound of
docs/ORCHESTRATOR.md, "Host memory", then does not hold.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from ..protocol.held_bytes import WIDE_CHAR_BYTES

log = logging.getLogger(__name__)

MESSAGE_MARGIN = 1024 * 1024  # how far past max_event_bytes a message is still assembled

_state: dict[str, Any] = {"close_timeout_s": 5.0, "live": 0}


def live_connections() -> int:
    """Connections this worker holds now (0 if ``bound_transport_close`` could not apply)."""
    return _state["live"]


def largest_message(max_event_bytes: int) -> int:
    """The most a message being assembled, or handed to the app, is counted at."""
    return max_event_bytes + MESSAGE_MARGIN


def bound_message_assembly(max_event_bytes: int) -> bool:
    """Make hypercorn count the message it assembles as the worker holds it, and stop at
    ``largest_message``; False (and a warning) if this hypercorn is not laid out as expected."""
    try:
        from hypercorn.protocol import ws_stream
    except ImportError:  # not served by hypercorn: nothing to bound
        return False
    base = getattr(ws_stream, "WebsocketBuffer", None)
    too_large = getattr(ws_stream, "FrameTooLargeError", None)
    base = getattr(base, "unbounded", base)  # already replaced: replace again with the new limit
    if not (isinstance(base, type) and isinstance(too_large, type) and _has_fields(base, "length", "max_length")):
        log.warning("could not bound the websocket messages hypercorn assembles: hypercorn.protocol.ws_stream "
                    "is not laid out as expected")
        return False
    limit = largest_message(max_event_bytes)

    class CountedBuffer(base):  # type: ignore[misc, valid-type]
        unbounded = base

        def __init__(self, max_length: int) -> None:
            super().__init__(min(max_length, limit))
            self.wide = False

        def extend(self, event: Any) -> None:
            data = event.data
            if not self.wide and isinstance(data, str) and not data.isascii():
                self.wide = True
            super().extend(event)  # counts characters or bytes, raises past max_length
            if self.wide and WIDE_CHAR_BYTES * self.length > self.max_length:
                raise too_large()

        def clear(self) -> None:
            super().clear()
            self.wide = False

    ws_stream.WebsocketBuffer = CountedBuffer
    return True


def bound_transport_close(close_timeout_s: float) -> bool:
    """Abort a connection whose close has not flushed within ``close_timeout_s``, and count
    the connections held; False (and a warning) if this hypercorn is not laid out as expected."""
    try:
        from hypercorn.asyncio import tcp_server
    except ImportError:
        return False
    _state["close_timeout_s"] = close_timeout_s
    server = getattr(tcp_server, "TCPServer", None)
    run, close = getattr(server, "run", None), getattr(server, "_close", None)
    if getattr(run, "bounded", False):
        return True
    if not (inspect.iscoroutinefunction(run) and inspect.iscoroutinefunction(close)):
        log.warning("could not bound how long hypercorn closes a connection: hypercorn.asyncio.tcp_server "
                    "is not laid out as expected")
        return False

    async def counted_run(self: Any) -> None:
        _state["live"] += 1
        try:
            await run(self)
        finally:
            _state["live"] -= 1

    async def bounded_close(self: Any) -> None:
        transport = self.writer.transport
        timer = asyncio.get_running_loop().call_later(_state["close_timeout_s"], _abort, transport)
        try:
            await close(self)
        finally:
            timer.cancel()

    counted_run.bounded = True  # type: ignore[attr-defined]
    server.run = counted_run  # type: ignore[union-attr]
    server._close = bounded_close  # type: ignore[union-attr]
    return True


def _abort(transport: Any) -> None:
    log.info("connection %s: closed, but the client read nothing for %g s: aborted",
             transport.get_extra_info("peername"), _state["close_timeout_s"])
    transport.abort()


def _has_fields(cls: type, *names: str) -> bool:
    try:
        instance = cls(1)
    except Exception:  # noqa: BLE001 - a different constructor: a different layout
        return False
    return all(hasattr(instance, name) for name in names)
