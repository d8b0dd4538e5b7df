"""Protocol errors: codes, their error types, and the exception the handlers raise.

The code -> type map follows the reference (``REALTIME_ERROR_TYPES_BY_CODE``); codes not in
it are ``invalid_request_error``.

What the server itself got wrong reaches a client as a stable code and a message of ours with
an error id (``withheld``); the detail (exception text, library messages, device memory
figures, paths) goes only to the log, under the same id (``engine_failure``).
"""

from __future__ import annotations

import logging
import secrets
import sys
from typing import Any

MAX_MESSAGE_CHARS = 1000  # an error's message: client values in it are cut (engines.interface.shown)

RATE_LIMIT_CODES = frozenset({"resource_exhausted", "input_backpressure", "output_backpressure",
                              "session_limit_exceeded", "open_rate_limited", "event_rate_exceeded",
                              "connection_limit_exceeded"})
SERVER_ERROR_CODES = frozenset({
    "internal_error", "engine_error", "engine_unavailable", "commit_aborted", "server_vad_unavailable",
    "runtime_append_failed", "runtime_append_task_failed", "runtime_signal_failed", "runtime_abort_failed",
    "runtime_input_failed", "runtime_touch_failed", "runtime_data_plane_stream_failed",
    "runtime_data_plane_text_without_audio", "engine_stalled", "server_shutting_down",
})
AUTH_CODES = frozenset({"invalid_api_key", "origin_not_allowed"})



# The message of a refusal for capacity (no free slot): the reference's words, and the limit.
CAPACITY_EXHAUSTED = "duplex_session_capacity_exhausted"


def capacity_exhausted(limit: int) -> "ProtocolError":
    return ProtocolError("resource_exhausted", f"{CAPACITY_EXHAUSTED}: limit={limit}", retryable=True)

def error_type(code: str) -> str:
    if code in RATE_LIMIT_CODES:
        return "rate_limit_error"
    if code in SERVER_ERROR_CODES or (code.startswith("context_") and code.endswith("_failed")):
        return "server_error"
    if code in AUTH_CODES:
        return "authentication_error"
    return "invalid_request_error"


class ProtocolError(Exception):
    """A client-visible error: becomes one ``error`` event.

    ``param`` names the offending field; ``extra`` holds further keys of ``error`` (e.g.
    ``retryable``).
    """

    def __init__(self, code: str, message: str, *, param: str | None = None, **extra: Any) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.extra = extra

    def payload(self, client_event_id: str | None = None) -> dict[str, Any]:
        """The ``error`` object of the envelope."""
        body: dict[str, Any] = {"type": error_type(self.code), "code": self.code, "message": self.message}
        if client_event_id is not None:
            body["event_id"] = client_event_id
        if self.param is not None:
            body["param"] = self.param
        body.update(self.extra)
        return body


def new_error_id() -> str:
    """An id for one failure, in the client's message and in the log line with its detail."""
    return "err_" + secrets.token_hex(6)


def withheld(what: str, error_id: str) -> str:
    """A client's message for a failure whose detail is in the log under ``error_id``."""
    return f"{what} (error id {error_id}; the details are in the server's log)"


def is_out_of_memory(exc: BaseException) -> bool:
    """A device (or host) allocation that failed: torch's OutOfMemoryError, or MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # only where torch is loaded: the engine's side
    return torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ()))


def is_typed_refusal(exc: BaseException) -> bool:
    """An engine's error worded for the client (an unknown voice, no free slot: an
    ``EngineError`` whose code is not ``engine_error``), not a failure of the engine."""
    from engines.interface import EngineError

    return isinstance(exc, EngineError) and exc.code != "engine_error"


def failure_reason(exc: BaseException) -> str:
    """How an engine failure is counted (``personaplex_open_failures_total{reason}``)."""
    return "out_of_memory" if is_out_of_memory(exc) else "engine_error"


def counted_failure(exc: BaseException) -> str | None:
    """The reason an open's failure in the engine is counted under, or None for a refusal
    that is no failure (an unknown voice, no free slot).  A typed refusal that names a
    ``reason`` (``lockstep.joins.JoinTurnTimeout``) is counted under it: the client was
    told to retry, the operator sees how often."""
    if is_typed_refusal(exc):
        return getattr(exc, "reason", None)
    return failure_reason(exc)


def engine_failure(exc: BaseException, what: str, log: logging.Logger) -> "ProtocolError":
    """The client's error for an engine call that raised ``exc`` (``what``: the call, for the
    message).  The engine's typed errors for the client (an unknown voice, no free slot: an
    ``EngineError`` whose code is not ``engine_error``) pass as they are; an allocation that
    failed is ``resource_exhausted`` and retryable; anything else is ``engine_error``.  Only
    the typed ones carry the exception's text; the others are logged with an id that their
    message names."""
    from engines.interface import EngineError

    if is_typed_refusal(exc):
        code = exc.code  # type: ignore[attr-defined]
        return ProtocolError(code, str(exc), param="voice" if code == "invalid_voice" else None)
    error_id = new_error_id()
    if is_out_of_memory(exc):
        log.error("%s: out of memory [%s]: %s", what, error_id, exc)
        return ProtocolError("resource_exhausted", withheld(f"{what} failed: the server has no memory for it now; "
                                                            "try again shortly", error_id), retryable=True)
    if isinstance(exc, EngineError):  # the engine's own words: no traceback needed
        log.error("%s failed [%s]: %s", what, error_id, exc)
    else:
        log.error("%s failed [%s]", what, error_id, exc_info=exc)
    return ProtocolError("engine_error", withheld(f"{what} failed", error_id))
