"""Keep reading a websocket's incoming messages after the app is done with it.

hypercorn hands each incoming message to the app through a small bounded queue
(``max_app_queue_size``, 10) and its connection task waits on that queue.  Quart reads it
until its handler returns, then stops.  A client that keeps sending after the server closed
the websocket (one that reads nothing never sees the close frame) fills the queue, and the
connection task then waits forever: an asyncio task, and up to ten messages of up to 16 MiB,
leaked per such client (found by tests/test_orchestrator_fuzz_ws.py).

``DrainAfterClose`` wraps the app's ASGI callable: when a websocket handler returns before the
server said the client disconnected, a small task keeps taking (and dropping) messages until
it does, or ``DRAIN_LIMIT_S`` has passed.  hypercorn closes the connection as soon as the app
returns, so that is normally a few milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

DRAIN_LIMIT_S = 60.0

# The drainer tasks, kept referenced until they finish (asyncio keeps only weak references).
_DRAINERS: set[asyncio.Task] = set()


class DrainAfterClose:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "websocket":
            await self.inner(scope, receive, send)
            return
        disconnected = False

        async def tracked() -> dict:
            nonlocal disconnected
            message = await receive()
            if message.get("type") == "websocket.disconnect":
                disconnected = True
            return message

        try:
            await self.inner(scope, tracked, send)
        finally:
            if not disconnected:
                task = asyncio.ensure_future(_drain(receive))
                _DRAINERS.add(task)
                task.add_done_callback(_DRAINERS.discard)


async def _drain(receive: Any) -> None:
    async def until_disconnect() -> None:
        while (await receive()).get("type") != "websocket.disconnect":
            pass

    try:
        await asyncio.wait_for(until_disconnect(), DRAIN_LIMIT_S)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    except Exception:  # the server side of the socket is gone: nothing left to drain
        log.debug("websocket drain ended", exc_info=True)
