"""How a server-side end of a websocket is told to the client: the close code of each close
reason, shared by the Realtime and the native route, and closing itself."""

from __future__ import annotations

import asyncio
from typing import Any

# Close code per session close reason; anything else ends normally (1000), as the reference does.
SESSION_CLOSE_CODES = {"output_backpressure": 1008, "engine_error": 1011, "transport_error": 1011,
                       "shutdown": 1001, "bad_audio": 1007, "input_backpressure": 1008}
# Refusals before a session that are not the client's fault: 1013 = try again later (full,
# limits, the model still loading or stalled), 1001 = going away, 1011 = the open failed in
# the server; the client's own mistakes get 1008 (policy violation).
REFUSAL_CLOSE_CODES = {"resource_exhausted": 1013, "session_limit_exceeded": 1013, "open_rate_limited": 1013,
                       "engine_stalled": 1013, "engine_unavailable": 1013, "server_shutting_down": 1001,
                       "engine_error": 1011}
REFUSAL_DEFAULT = 1008
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455


async def close_socket(ws: Any, code: int, reason: str, timeout_s: float) -> None:
    """Send the close frame (the reason cut to what a close frame holds); a client that is
    gone or not reading is not waited for past ``timeout_s``."""
    reason_bytes = reason.encode("utf-8")[:MAX_CLOSE_REASON_BYTES]
    try:
        await asyncio.wait_for(ws.close(code, reason_bytes.decode("utf-8", "ignore")), timeout_s)
    except Exception:  # noqa: BLE001 - nothing more to tell a client that is gone
        pass
