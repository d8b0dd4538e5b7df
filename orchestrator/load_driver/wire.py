"""The wire protocol as the driver speaks it: URLs, the events it sends, and strict parsing of
the events it reads (audio packets above all).

Everything here is a pure function of its arguments, so the packet rules can be tested without
a socket.  Event shapes follow ``../shared/spec/realtime-duplex.md`` §3.1, §3.2, §4.2 and §7.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from engines.config import FRAME_MS, FRAME_PERIOD_S, FRAME_SAMPLES  # noqa: F401 - the driver's names for them
from engines.config import SAMPLE_RATE as SAMPLE_RATE_HZ

PCM16_BYTES = 2

# The GA name and the legacy one; servers emit the first, clients must accept both.
AUDIO_DELTA_TYPES = frozenset({"response.output_audio.delta", "response.audio.delta"})
TEXT_DELTA_TYPES = frozenset({"response.output_audio_transcript.delta", "response.text.delta",
                              "response.output_text.delta"})

# A frame whose RMS is below this is sent with is_speech=false (the reference's rule).
IS_SPEECH_RMS = 1e-4

# The capability values every PersonaPlex duplex session must advertise (spec §2, §7.2).
LIFECYCLE_CAPABILITIES: dict[str, Any] = {
    "implementation_level": "model_native_duplex",
    "chunk_period_ms": 80,
    "supports_multi_session": True,
    "supports_multi_session_same_replica": True,
    "supports_barge_in": False,
}
# The subset the load mode insists on before it streams.
LOAD_CAPABILITIES: dict[str, Any] = {"chunk_period_ms": 80, "supports_multi_session_same_replica": True}


class InvalidAudioPacket(ValueError):
    """An audio delta that breaks the packet rules; ``code`` is one fixed diagnostic string
    (safe to export: it never carries wire data)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def realtime_url(base_url: str, model: str) -> str:
    """``base_url`` with ``duplex=1``, ``model`` and ``autostart=0`` in its query.

    ``autostart=0`` makes the server wait for our ``session.update`` (with autostart a
    reference server would open a default session and drop our voice and persona)."""
    parts = urlsplit(base_url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.update(duplex="1", model=model, autostart="0")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


def redacted_url(url: str) -> str:
    """The URL without user info or query values, for log lines (never for results)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    query = "&".join(f"{key}=..." for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def session_update(*, model: str, voice: str, persona: str) -> dict[str, Any]:
    """The reference driver's opening ``session.update``: pcm_f32le in, pcm16 out, no server
    VAD.  The input rate travels on every append, not here."""
    return {
        "type": "session.update",
        "session": {
            "model": model,
            "modalities": ["audio", "text"],
            "input_audio_format": "pcm_f32le",
            "output_audio_format": "pcm16",
            "voice": voice,
            "instructions": persona,
            "turn_detection": None,
            "extra_body": {"auto_response": True},
        },
    }


def frame_event(frame: np.ndarray, seq: int) -> dict[str, Any]:
    """One ``input_audio_buffer.append`` carrying input frame ``seq`` (0-based).

    Exactly the reference driver's keys: 1920 float32 LE samples (a short last frame is
    zero-padded), the format and rate on the event, and the timing hints."""
    samples = np.zeros(FRAME_SAMPLES, dtype="<f4")
    samples[: len(frame)] = frame[:FRAME_SAMPLES]
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
    return {
        "type": "input_audio_buffer.append",
        "audio": base64.b64encode(samples.tobytes()).decode("ascii"),
        "format": "pcm_f32le",
        "sample_rate_hz": SAMPLE_RATE_HZ,
        "duration_ms": FRAME_MS,
        "audio_end_ms": (seq + 1) * FRAME_MS,
        "is_speech": rms >= IS_SPEECH_RMS,
    }


def session_close() -> dict[str, Any]:
    return {"type": "session.close"}


def encode(event: Mapping[str, Any]) -> str:
    """An event as the compact JSON text the driver sends."""
    return json.dumps(event, separators=(",", ":"))



# Reading server events --------------------------------------------------------------------------

def session_id_of(created: Mapping[str, Any]) -> str | None:
    """The server-allocated id of ``session.created``: ``session.id``, then
    ``session.session_id``, then a top-level ``session_id``."""
    session = created.get("session")
    if isinstance(session, Mapping):
        for key in ("id", "session_id"):
            value = session.get(key)
            if isinstance(value, str) and value:
                return value
    value = created.get("session_id")
    return value if isinstance(value, str) and value else None


def capabilities_of(created: Mapping[str, Any]) -> dict[str, Any] | None:
    session = created.get("session")
    caps = session.get("capabilities") if isinstance(session, Mapping) else None
    return dict(caps) if isinstance(caps, Mapping) else None


def capability_mismatches(caps: Mapping[str, Any] | None, expected: Mapping[str, Any]) -> list[str]:
    """The expected capability keys whose values differ (all of them when ``caps`` is None)."""
    if caps is None:
        return sorted(expected)
    return sorted(key for key, value in expected.items() if caps.get(key) != value)


def error_code_of(event: Mapping[str, Any]) -> str:
    """``error.code`` of an ``error`` event, else the legacy flat ``code``, else "unknown"."""
    body = event.get("error")
    if isinstance(body, Mapping) and isinstance(body.get("code"), str):
        return body["code"]
    code = event.get("code")
    return code if isinstance(code, str) else "unknown"


def audio_packet_pcm(event: Mapping[str, Any]) -> bytes:
    """The PCM16 bytes of one audio delta, or ``InvalidAudioPacket``.

    Rules (spec §7.2): ``delta`` is a string of strict base64; a non-empty packet has an even
    byte count, ``sample_rate_hz`` 24000 and a non-empty ``response_id``.  An empty delta is
    legal and carries no audio."""
    encoded = event.get("delta")
    if not isinstance(encoded, str):
        raise InvalidAudioPacket("missing_audio_delta")
    try:
        pcm = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidAudioPacket("invalid_audio_base64") from None
    if not pcm:
        return pcm
    if len(pcm) % PCM16_BYTES:
        raise InvalidAudioPacket("unaligned_pcm16_packet")
    rate = event.get("sample_rate_hz")
    if isinstance(rate, bool) or rate != SAMPLE_RATE_HZ:
        raise InvalidAudioPacket("invalid_audio_sample_rate")
    response_id = event.get("response_id")
    if not isinstance(response_id, str) or not response_id:
        raise InvalidAudioPacket("missing_audio_response_id")
    return pcm


def is_audio_delta(event: Mapping[str, Any]) -> bool:
    return event.get("type") in AUDIO_DELTA_TYPES


def visible_text(event: Mapping[str, Any]) -> bool:
    """A text delta with visible characters (whitespace-only padding deltas do not count as
    the first text)."""
    delta = event.get("delta")
    return event.get("type") in TEXT_DELTA_TYPES and isinstance(delta, str) and bool(delta.strip())


def proves_scheduler_data_plane(event: Mapping[str, Any]) -> bool:
    """True if the delta's ``metadata.vllm_omni`` names vLLM-Omni's scheduler data plane.

    Only a vLLM-Omni server sends this block; ours does not claim another server's identity."""
    metadata = event.get("metadata")
    block = metadata.get("vllm_omni") if isinstance(metadata, Mapping) else None
    return (isinstance(block, Mapping) and block.get("runtime_impl") == "scheduler_data_plane"
            and block.get("uses_model_runner_scheduler") is True and block.get("runner_kv_backed") is True)


def silence_fed_frames(event: Mapping[str, Any], frames: int) -> int | None:
    """How many of an audio delta's ``frames`` the server says it made from silence it fed
    itself (after the client's input stalled or ended), or None when the delta does not say.

    personaplex-serve puts ``metadata.timing.silence_input_frames`` (a count) on every delta;
    a delta with only the boolean ``metadata.timing.silence_input`` counts as all or none."""
    metadata = event.get("metadata")
    timing = metadata.get("timing") if isinstance(metadata, Mapping) else None
    if not isinstance(timing, Mapping):
        return None
    count = timing.get("silence_input_frames")
    if isinstance(count, int) and not isinstance(count, bool):
        return min(max(count, 0), frames)
    flag = timing.get("silence_input")
    if isinstance(flag, bool):
        return frames if flag else 0
    return None


def metadata_session_id(event: Mapping[str, Any]) -> str | None:
    metadata = event.get("metadata")
    value = metadata.get("session_id") if isinstance(metadata, Mapping) else None
    return value if isinstance(value, str) else None
