"""Client -> server events: framing checks, JSON decoding and the append payload.

Everything here is pure: it turns a websocket message into a dict (or a ``ProtocolError``),
and an append event into an ``AppendRequest``.  What the events *do* is ``Session``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import json_codec
from .audio import INPUT_CODECS, AudioError, canonical_codec, check_rate
from .errors import ProtocolError

CLOSE_EVENTS = frozenset({"session.close", "close", "close_session"})
# Values (array items and object members) in one event.  Parsing is on the event loop every
# session of the worker shares, and its cost is in the values, not the bytes: 15 MiB of
# ``[],[],...`` (5 M values) took 1.4 s and ~800 MiB to parse, 15 MiB of base64 audio ~10 ms.
# Every value but the first of a container follows a comma, so counting commas (~6 ms for
# 15 MiB, done only for events longer than the limit) bounds the values before parsing.  A
# real event has tens; a persona's commas count too, and it holds at most a few thousand.
MAX_EVENT_VALUES = 16384
MAX_EVENT_ID_CHARS = 256  # of a client's event_id, as echoed in errors


def decode_event(message: str | bytes | None, max_bytes: int) -> dict[str, Any]:
    """One websocket message -> one event object, or ``ProtocolError``.

    Codes: ``bad_event`` (binary frame, non-object JSON, missing ``type``),
    ``event_too_large``, ``event_too_complex`` (more than ``MAX_EVENT_VALUES`` values),
    ``invalid_json`` (also NaN, Infinity, out-of-range numbers, nesting
    deeper than 1024, integers beyond 64 bits and lone surrogates: ``json_codec``).
    """
    if not isinstance(message, str):
        raise ProtocolError("bad_event", "binary frames are not supported: send each event as one JSON text frame")
    size = len(message)
    if size > max_bytes or (size * 4 > max_bytes and len(message.encode("utf-8", "surrogatepass")) > max_bytes):
        raise ProtocolError("event_too_large", f"event exceeds the limit of {max_bytes} bytes")
    if size > MAX_EVENT_VALUES and message.count(",") >= MAX_EVENT_VALUES:
        raise ProtocolError("event_too_complex", f"an event may hold at most {MAX_EVENT_VALUES} JSON values "
                            "(array items and object members; commas inside strings count too)")
    try:
        event = json_codec.loads(message)
    except json_codec.InvalidJSON as exc:
        raise ProtocolError("invalid_json", f"event is not valid JSON: {exc}") from None
    if not isinstance(event, dict):
        raise ProtocolError("bad_event", f"event must be a JSON object, got {type(event).__name__}")
    if not isinstance(event.get("type"), str) or not event["type"]:
        raise ProtocolError("bad_event", "event must have a string 'type'", param="type")
    return event


def client_event_id(event: Mapping[str, Any]) -> str | None:
    """The client's ``event_id``, echoed in errors (only if it is a string; a long one cut)."""
    value = event.get("event_id")
    return value[:MAX_EVENT_ID_CHARS] if isinstance(value, str) else None


@dataclass(frozen=True)
class AppendRequest:
    audio: str  # base64, not yet decoded
    codec: str | None  # per-event override of the session's input codec
    rate: int | None  # per-event override of the session's input rate


def parse_append(event: Mapping[str, Any]) -> AppendRequest:
    audio = event.get("audio", event.get("delta"))
    if not isinstance(audio, str):
        raise ProtocolError("bad_event", "input_audio_buffer.append needs base64 'audio'", param="audio")
    name = event.get("format", event.get("input_audio_format"))
    codec = None
    if name is not None:
        codec = canonical_codec(name)
        if codec not in INPUT_CODECS:
            raise ProtocolError("unsupported_audio_format", f"Unsupported input_audio_format: {name}", param="format")
    raw_rate = event.get("sample_rate_hz", event.get("sample_rate"))
    rate = None
    if raw_rate is not None:
        try:
            rate = check_rate(raw_rate)
        except AudioError as exc:
            raise ProtocolError(exc.code, str(exc), param="sample_rate_hz") from None
    return AppendRequest(audio=audio, codec=codec, rate=rate)
