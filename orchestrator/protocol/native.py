"""The native PersonaPlex/Moshi websocket protocol (``/api/chat``, spec/native-protocol.md) as
data: the query that describes a session, and binary messages whose first byte is their kind.

Pure functions, no I/O: the connection that speaks it lives in the front end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from engines.config import DEFAULT_VOICE
from engines.interface import (MAX_TEMPERATURE, MAX_TOP_K, InvalidSessionSpec, SamplingParams, SessionSpec,
                               check_voice_name)

from .errors import ProtocolError

HANDSHAKE, AUDIO, TEXT, CONTROL, METADATA, ERROR, PING = range(7)
KINDS = frozenset(range(7))
HANDSHAKE_MESSAGE = bytes([HANDSHAKE])  # what NVIDIA's server sends: the kind alone
MAX_ERROR_BYTES = 1000  # an error message's reason, UTF-8


def parse_query(args: Mapping[str, str], max_persona_chars: int | None = None) -> SessionSpec:
    """The session a native client asks for.  ``text_prompt`` must be present (NVIDIA's
    server fails without it); empty means the default persona, as on the Realtime route
    (NVIDIA's server then runs no persona).  ``voice_prompt``: a voice file name, the
    server's default voice when absent.  ``seed``: -1 or absent = drawn by the server.
    Temperatures and top-k are honoured (NVIDIA's server ignores them); both temperatures 0
    = greedy.  Other keys (the stock client's ``pad_mult``, ``text_seed``, ``audio_seed``,
    ``repetition_penalty*``, ``worker_auth_id``, ``email``) are ignored, as NVIDIA's server does."""
    if "text_prompt" not in args:
        raise ProtocolError("missing_text_prompt", "the query needs text_prompt (the persona; it may be empty)",
                            param="text_prompt")
    persona = args["text_prompt"]
    if max_persona_chars is not None and len(persona) > max_persona_chars:
        raise ProtocolError("text_prompt_too_long", f"text_prompt may have at most {max_persona_chars} characters, got "
                            f"{len(persona)}", param="text_prompt")
    voice = args.get("voice_prompt") or DEFAULT_VOICE
    try:
        check_voice_name(voice)
    except InvalidSessionSpec as exc:
        raise ProtocolError("invalid_voice", str(exc)[:300], param="voice_prompt") from None
    defaults = SamplingParams()
    temp_text = _number(args, "text_temperature", defaults.temp_text)
    temp_audio = _number(args, "audio_temperature", defaults.temp_audio)
    sampling = SamplingParams(greedy=temp_text == 0 and temp_audio == 0, temp_text=temp_text, temp_audio=temp_audio,
                              topk_text=_count(args, "text_topk", defaults.topk_text),
                              topk_audio=_count(args, "audio_topk", defaults.topk_audio))
    seed = _integer(args, "seed", -1)
    if not -1 <= seed < 2**63:
        raise ProtocolError("bad_query", f"seed must be -1 (random) or an integer in [0, 2**63), got {seed}",
                            param="seed")
    return SessionSpec(voice=voice, persona=persona, sampling=sampling, seed=None if seed == -1 else seed)


def split(message: bytes) -> tuple[int, bytes]:
    """A client message's kind and payload; an empty message or an unknown kind is a
    ``ProtocolError`` (the caller logs, counts and drops it, as NVIDIA's server does)."""
    if not message:
        raise ProtocolError("empty_message", "an empty message (no kind byte)")
    kind = message[0]
    if kind not in KINDS:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind}")
    return kind, message[1:]


def audio_message(pages: bytes) -> bytes:
    return bytes([AUDIO]) + pages


def text_message(piece: str) -> bytes:
    return bytes([TEXT]) + piece.encode("utf-8")


def error_message(reason: str) -> bytes:
    """Kind 0x05 with a UTF-8 reason (cut on a character boundary)."""
    data = reason.encode("utf-8")[:MAX_ERROR_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return bytes([ERROR]) + data


def _text_of(args: Mapping[str, str], name: str) -> str | None:
    value = args.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _number(args: Mapping[str, str], name: str, default: float) -> float:
    text = _text_of(args, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_TEMPERATURE:  # also refuses NaN and the infinities
        raise ProtocolError("bad_query", f"{name} must be a number in [0, {MAX_TEMPERATURE:g}], got {text[:50]!r}",
                            param=name)
    return value


def _integer(args: Mapping[str, str], name: str, default: int) -> int:
    text = _text_of(args, name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ProtocolError("bad_query", f"{name} must be an integer, got {text[:50]!r}", param=name) from None


def _count(args: Mapping[str, str], name: str, default: int) -> int:
    value = _integer(args, name, default)
    if not 1 <= value <= MAX_TOP_K:
        raise ProtocolError("bad_query", f"{name} must be an integer in [1, {MAX_TOP_K}], got {str(value)[:50]}",
                            param=name)
    return value
