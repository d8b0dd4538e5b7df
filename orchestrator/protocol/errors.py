"""Protocol errors: codes, their error types, and the exception the handlers raise.

The code -> type map follows the reference (``REALTIME_ERROR_TYPES_BY_CODE``); codes not in
it are ``invalid_request_error``.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_CHARS = 1000  # an error's message: client values in it are cut (engines.interface.shown)

RATE_LIMIT_CODES = frozenset({"resource_exhausted", "input_backpressure", "output_backpressure",
                              "session_limit_exceeded", "open_rate_limited", "event_rate_exceeded"})
SERVER_ERROR_CODES = frozenset({
    "internal_error", "engine_error", "engine_unavailable", "commit_aborted", "server_vad_unavailable",
    "runtime_append_failed", "runtime_append_task_failed", "runtime_signal_failed", "runtime_abort_failed",
    "runtime_input_failed", "runtime_touch_failed", "runtime_data_plane_stream_failed",
    "runtime_data_plane_text_without_audio", "engine_stalled", "server_shutting_down",
})
AUTH_CODES = frozenset({"invalid_api_key", "origin_not_allowed"})


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
