"""``session.update`` -> a validated ``SessionConfig``.

Both shapes are read: the reference's flat fields (``input_audio_format``, ``sample_rate_hz``,
``voice``, ``instructions``, ``extra_body``...) and the OpenAI GA shape (``session.type``,
``session.audio.input.format = {"type": "audio/pcm", "rate": 24000}``,
``session.audio.output.voice``...).  Flat fields win where both are present.

Voice, persona, model and sampling are fixed when the session opens (the model context is
built from them); re-sending the same values is fine, changing them is refused with the
reference's codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from engines.config import DEFAULT_PERSONA, DEFAULT_VOICE, SAMPLE_RATE
from engines.interface import MAX_TEMPERATURE, SamplingParams, SessionSpec, is_text, shown

from . import json_codec
from .audio import INPUT_CODECS, OUTPUT_CODECS, AudioError, canonical_codec, check_rate
from .errors import ProtocolError
from .held_bytes import held_bytes

SERVER_OWNED_EXTRA_BODY_KEYS = (
    "personaplex_prefill_slots", "personaplex_model_path", "personaplex_voice_prompt", "personaplex_persona",
)
# Client session fields copied verbatim into the public session object (reference behaviour).
ECHOED_FIELDS = (
    "input_audio_format", "output_audio_format", "sample_rate_hz", "turn_detection",
    "input_audio_transcription", "tracing", "tools", "tool_choice", "metadata", "include", "prompt",
    "input_audio_noise_reduction",
)
DEFAULT_MODALITIES = ("text", "audio")
# The session object is echoed back in every session.updated: deeper nesting than any real
# client sends is refused here, so our own encoder can never hit its recursion limit.
MAX_SESSION_DEPTH = 32
# What a decoded JSON value takes besides its text: the object header, its slot in its list or
# object (a one-character string is ~60 bytes), rounded up.
VALUE_BYTES = 128
# A client may keep an idle session open this long at most: a silent socket holds a slot
# (the server default, PERSONAPLEX_IDLE_TIMEOUT_S, is 300 s).
MAX_IDLE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class SessionConfig:
    model: str
    voice: str = DEFAULT_VOICE
    instructions: str = ""  # the raw client value; the engine substitutes the default if empty
    input_codec: str = "pcm_f32le"
    input_rate: int = SAMPLE_RATE
    output_codec: str = "pcm16"
    temperature: float | None = None  # None: the engine's default sampling
    seed: int | None = None
    idle_timeout_s: float = 300.0
    modalities: tuple[str, ...] = DEFAULT_MODALITIES
    output_modalities: tuple[str, ...] = DEFAULT_MODALITIES
    turn_detection: Any = None
    audio: Any = None  # the client's ``audio`` object, echoed
    echoed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def persona(self) -> str:
        return self.instructions if self.instructions.strip() else DEFAULT_PERSONA

    def sampling(self) -> SamplingParams:
        if self.temperature is None:
            return SamplingParams()
        if self.temperature == 0:
            return SamplingParams(greedy=True)
        return SamplingParams(temp_audio=self.temperature, temp_text=self.temperature)

    def spec(self) -> SessionSpec:
        return SessionSpec(voice=self.voice, persona=self.instructions, sampling=self.sampling(), seed=self.seed)


def session_payload(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """The session object of a ``session.update`` (the event itself if it has none)."""
    session = event.get("session")
    if isinstance(session, Mapping):
        return session
    return {k: v for k, v in event.items() if k not in ("type", "event_id", "session")}


def parse_session_update(
    payload: Mapping[str, Any],
    current: SessionConfig,
    *,
    is_open: bool,
    input_rate_locked: bool,
    max_instructions_chars: int | None = None,
    max_session_bytes: int | None = None,
) -> SessionConfig:
    """Apply ``payload`` to ``current``; raises ``ProtocolError`` without changing anything.

    ``is_open``: the session exists, so voice, persona, model and sampling are immutable.
    ``input_rate_locked``: audio was received, so the input rate can no longer change.
    ``max_instructions_chars``: the longest persona accepted (each persona token costs one
    prefill step of the engine thread that every session shares).
    ``max_session_bytes``: what the client's fields of the session may cost the server to hold
    and to echo in every ``session.updated`` (``client_fields_bytes``); more is
    ``session_too_large``.
    """
    if _depth(payload, MAX_SESSION_DEPTH) > MAX_SESSION_DEPTH:
        raise ProtocolError("bad_event", f"the session object is nested deeper than {MAX_SESSION_DEPTH} levels",
                            param="session")
    audio = payload.get("audio")
    if audio is not None and not isinstance(audio, Mapping):
        raise ProtocolError("bad_event", "session.audio must be an object", param="session.audio")
    audio_in = _section(audio, "input")
    audio_out = _section(audio, "output")
    changes: dict[str, Any] = {}

    if "model" in payload and payload["model"] is not None:
        model = _string(payload, "model")
        if is_open and model != current.model:
            raise ProtocolError("model_update_unsupported", "the model of an open session cannot change", param="model")
        changes["model"] = model

    voice = payload.get("voice", audio_out.get("voice"))
    if "voice" in payload or "voice" in audio_out:
        voice = _check_voice(voice)
        if is_open and voice != current.voice:
            raise ProtocolError("voice_update_unsupported", "the voice of an open session cannot change", param="voice")
        changes["voice"] = voice

    if "instructions" in payload:
        instructions = payload["instructions"] if payload["instructions"] is not None else ""
        if not isinstance(instructions, str):
            raise ProtocolError("bad_event", "instructions must be a string", param="instructions")
        if not is_text(instructions):
            raise ProtocolError("bad_event", "instructions must be valid Unicode text: it holds a lone surrogate "
                                "(\\ud800-\\udfff without its pair)", param="instructions")
        if max_instructions_chars is not None and len(instructions) > max_instructions_chars:
            raise ProtocolError("instructions_too_long", f"instructions (the persona) may have at most "
                                f"{max_instructions_chars} characters, got {len(instructions)}", param="instructions")
        new = replace(current, instructions=instructions)
        if is_open and new.persona != current.persona:
            raise ProtocolError("persona_update_unsupported", "the persona (instructions) of an open session cannot change",
                                param="instructions")
        changes["instructions"] = instructions

    codec, rate = _input_format(payload, audio_in)
    if codec is not None:
        changes["input_codec"] = codec
    if rate is not None:
        if input_rate_locked and rate != current.input_rate:
            raise ProtocolError("bad_event", "sample_rate_hz changed within a session", param="sample_rate_hz")
        changes["input_rate"] = rate
    _check_output_format(payload, audio_out)

    if "turn_detection" in payload or "turn_detection" in audio_in:
        changes["turn_detection"] = _check_turn_detection(payload.get("turn_detection", audio_in.get("turn_detection")))

    extra_body = payload.get("extra_body")
    if extra_body is not None:
        if not isinstance(extra_body, Mapping):
            raise ProtocolError("bad_event", "extra_body must be an object", param="extra_body")
        owned = [key for key in SERVER_OWNED_EXTRA_BODY_KEYS if key in extra_body]
        if owned:
            raise ProtocolError("invalid_duplex_runtime_config",
                                f"PersonaPlex runtime configuration is server-owned: {', '.join(owned)}",
                                param="extra_body")
        if extra_body.get("seed") is not None:
            seed = extra_body["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ProtocolError("bad_event", "extra_body.seed must be a non-negative integer", param="extra_body.seed")
            changes["seed"] = seed

    if payload.get("temperature") is not None:
        temperature = payload["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 <= temperature <= MAX_TEMPERATURE:
            raise ProtocolError("bad_event", f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]",
                                param="temperature")
        changes["temperature"] = float(temperature)
    if is_open and (changes.get("temperature", current.temperature) != current.temperature
                    or changes.get("seed", current.seed) != current.seed):
        raise ProtocolError("sampling_update_unsupported", "the sampling settings of an open session cannot change",
                            param="temperature")

    if payload.get("idle_timeout_s") is not None:
        idle = payload["idle_timeout_s"]
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 < idle <= MAX_IDLE_TIMEOUT_S:
            raise ProtocolError("bad_event", f"idle_timeout_s must be a number in (0, {MAX_IDLE_TIMEOUT_S:g}]",
                                param="idle_timeout_s")
        changes["idle_timeout_s"] = float(idle)

    for name in ("modalities", "output_modalities"):
        if payload.get(name) is not None:
            value = payload[name]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ProtocolError("bad_event", f"{name} must be a list of strings", param=name)
            changes[name] = tuple(value)

    if audio is not None:
        changes["audio"] = audio
    echoed = dict(current.echoed)
    echoed.update({k: payload[k] for k in ECHOED_FIELDS if k in payload})
    changes["echoed"] = echoed
    updated = replace(current, **changes)
    if max_session_bytes is not None:
        size = client_fields_bytes(updated)
        if size > max_session_bytes:
            raise ProtocolError("session_too_large", f"the session's own fields (instructions, metadata, tools and "
                                f"the other fields echoed in session.updated) would take {size} bytes; at most "
                                f"{max_session_bytes} are kept (text beyond ASCII counts 4 bytes a character)",
                                param="session")
    return updated


def client_fields_bytes(config: SessionConfig) -> int:
    """What the fields a client chose cost the server: their text as it is echoed
    (``protocol.held_bytes``), and ``VALUE_BYTES`` a value for the objects they are held as
    (one value per comma, those in strings too, and one).  The rest of the session object is
    the server's, a few KB."""
    fields = [config.model, config.voice, config.instructions, config.turn_detection, config.audio, config.echoed]
    text = json_codec.dumps(fields)
    return held_bytes(text) + VALUE_BYTES * (text.count(",") + 1)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of lists and objects in ``value``, counted no further than ``limit + 1``."""
    if not isinstance(value, (Mapping, list)) or limit < 0:
        return 0
    children = value.values() if isinstance(value, Mapping) else value
    nested = [child for child in children if isinstance(child, (Mapping, list))]  # scalars end here
    return 1 + max((_depth(child, limit - 1) for child in nested), default=0)


def _section(audio: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    if audio is None:
        return {}
    section = audio.get(name)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ProtocolError("bad_event", f"session.audio.{name} must be an object", param=f"session.audio.{name}")
    return section


def _string(payload: Mapping[str, Any], key: str) -> str:
    value = payload[key]
    if not isinstance(value, str):
        raise ProtocolError("bad_event", f"{key} must be a string", param=key)
    return value


def _check_voice(voice: Any) -> str:
    if voice is None or voice == "":
        return DEFAULT_VOICE
    if not isinstance(voice, str) or "/" in voice or "\\" in voice or voice.startswith(".") \
            or not voice.endswith(".pt") or len(voice) <= 3:
        raise ProtocolError("invalid_voice", f"voice must be the file name of a voice prompt (e.g. {DEFAULT_VOICE!r}), "
                            f"got {shown(voice)}", param="voice")
    return voice


def _rate(value: Any, param: str) -> int:
    try:
        return check_rate(value)
    except AudioError as exc:
        raise ProtocolError(exc.code, str(exc), param=param) from None


def _format_object(fmt: Any, param: str) -> tuple[Any, int | None]:
    """A format is a string or ``{type|format, rate|sample_rate_hz|sample_rate}``."""
    if isinstance(fmt, Mapping):
        name = fmt.get("type", fmt.get("format"))
        raw_rate = next((fmt[k] for k in ("rate", "sample_rate_hz", "sample_rate") if fmt.get(k) is not None), None)
        return name, (_rate(raw_rate, param) if raw_rate is not None else None)
    return fmt, None


def _input_format(payload: Mapping[str, Any], audio_in: Mapping[str, Any]) -> tuple[str | None, int | None]:
    name, rate = None, None
    if audio_in.get("format") is not None:  # its rate counts even beside a legacy format name
        name, rate = _format_object(audio_in["format"], "session.audio.input.format")
    if payload.get("input_audio_format") is not None:
        name = payload["input_audio_format"]
    codec = None
    if name is not None:
        codec = canonical_codec(name)
        if codec not in INPUT_CODECS:
            raise ProtocolError("unsupported_audio_format", f"Unsupported input_audio_format: {name}",
                                param="input_audio_format")
    for source, keys in ((payload, ("sample_rate_hz", "sample_rate")), (audio_in, ("sample_rate_hz", "sample_rate"))):
        explicit = next((source[k] for k in keys if source.get(k) is not None), None)
        if explicit is not None:
            rate = _rate(explicit, "sample_rate_hz")
            break
    return codec, rate


def _check_output_format(payload: Mapping[str, Any], audio_out: Mapping[str, Any]) -> None:
    name, rate = None, None
    if audio_out.get("format") is not None:  # its rate counts even beside a legacy format name
        name, rate = _format_object(audio_out["format"], "session.audio.output.format")
    for key in ("output_audio_format", "response_format"):
        if payload.get(key) is not None:
            name = payload[key]
            break
    if name is not None and canonical_codec(name) not in OUTPUT_CODECS:
        raise ProtocolError("unsupported_audio_format", f"Unsupported output_audio_format: {name} "
                            "(this server sends pcm16)", param="output_audio_format")
    explicit = next((audio_out[k] for k in ("sample_rate_hz", "sample_rate") if audio_out.get(k) is not None), None)
    if explicit is not None:
        rate = _rate(explicit, "session.audio.output.sample_rate_hz")
    if rate is not None and rate != SAMPLE_RATE:
        raise ProtocolError("unsupported_audio_format", f"output audio is {SAMPLE_RATE} Hz, got a request for {rate}",
                            param="session.audio.output.format")


def _check_turn_detection(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, Mapping) and value.get("type") == "server_vad" and value.get("interrupt_response", True):
        return dict(value)  # accepted for compatibility; turn taking stays model-native
    raise ProtocolError("unsupported_turn_detection",
                        "turn detection is model-native: use null (or server_vad with interrupt_response=true)",
                        param="turn_detection")
