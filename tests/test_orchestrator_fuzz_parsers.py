"""Property-based fuzzing (hypothesis) of everything that reads client input: the websocket
message decoder, the append and session.update parsers, the session's event dispatcher (with
model output interleaved), and the audio decoders.

The property is always the same contract: a typed ``ProtocolError``/``AudioError`` with a
known code, or a valid result; never another exception, and never a server event our own
strict encoder could not send.  Examples per test: ``PERSONAPLEX_TEST_FUZZ_EXAMPLES``
(default 150, derandomized so CI is reproducible; set it high and
``PERSONAPLEX_TEST_FUZZ_RANDOM=1`` for a deeper, random run).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.config import FRAME_SAMPLES
from orchestrator.frontend.session import Session
from orchestrator.engine_port import FrameFailure, FrameResult
from orchestrator.metrics import Metrics
from orchestrator.protocol.audio import (
    INPUT_CODECS,
    AudioError,
    InputStream,
    canonical_codec,
    check_rate,
    decode_base64,
    float_to_pcm16,
    pcm16_base64,
    to_float32,
)
from orchestrator.protocol.client_events import client_event_id, decode_event, parse_append
from orchestrator.protocol.errors import ProtocolError, error_type
from orchestrator.protocol.events import capabilities, session_object
from orchestrator.protocol.session_config import (
    SessionConfig,
    parse_session_update,
    session_payload,
)
from orchestrator.settings import Settings

EXAMPLES = int(os.environ.get("PERSONAPLEX_TEST_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("PERSONAPLEX_TEST_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], database=None)
ERROR_TYPES = {"invalid_request_error", "rate_limit_error", "server_error", "authentication_error"}

# Strategies ------------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
deep = st.integers(1, 60).map(lambda n: json.loads("[" * n + "]" * n))


def either(*valid: Any) -> st.SearchStrategy:
    """A plausible value half the time, anything at all otherwise."""
    return st.sampled_from(valid) | json_values


spellings = either("pcm16", "audio/pcm", "pcm_f32le", "f32le", "g711_ulaw", "ulaw", "audio/pcma", "wav", "opus",
                   " PCM16 ", "")
rates = either(8000, 16000, 24000, 44100, 48000, 192000, 7999, 192001, 24000.0, 24000.5, True, "24000", -1, 0)
formats = spellings | st.fixed_dictionaries({}, optional={"type": spellings, "format": spellings, "rate": rates,
                                                          "sample_rate_hz": rates})
session_objects = st.fixed_dictionaries({}, optional={
    "model": either("personaplex", "nvidia/personaplex-7b-v1", ""),
    "voice": either("NATF2.pt", "VARF0.pt", "NATM1.pt", "../x.pt", ".pt", "x", "a/b.pt", ""),
    "instructions": either("", "You are a pirate.", "  ", "x" * 7000),
    "input_audio_format": spellings, "output_audio_format": spellings, "response_format": spellings,
    "sample_rate_hz": rates, "sample_rate": rates,
    "audio": json_values | st.fixed_dictionaries({}, optional={
        "input": json_values | st.fixed_dictionaries({}, optional={"format": formats, "sample_rate_hz": rates,
                                                                   "turn_detection": json_values}),
        "output": json_values | st.fixed_dictionaries({}, optional={"format": formats, "voice": spellings,
                                                                    "sample_rate_hz": rates})}),
    "turn_detection": either(None, {"type": "server_vad"}, {"type": "semantic_vad"},
                             {"type": "server_vad", "interrupt_response": False}),
    "extra_body": json_values | st.fixed_dictionaries({}, optional={
        "seed": either(0, 7, -1, 2**64, 1.5), "auto_response": json_values,
        "personaplex_model_path": json_values}),
    "temperature": either(0, 0.7, 1, -0.1, 1e308), "idle_timeout_s": either(0.5, 300, 0, -1, 1e300),
    "modalities": either(["audio", "text"], ["audio"], [1], "audio"), "output_modalities": json_values,
    "tools": json_values, "metadata": json_values | deep, "type": either("realtime"),
})
audio_b64 = (st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
             | st.sampled_from(["", "not base64!!", "AAAA", "AAA", "////", "A" * 7, "=AAA"]) | st.text(max_size=16))
EVENT_TYPES = ("input_audio_buffer.append", "session.update", "response.cancel", "output_audio_buffer.clear",
               "input.cancel", "input_audio_buffer.clear", "input_audio_buffer.commit", "input.commit",
               "session.heartbeat", "session.event_ack", "response.create", "playback.ack", "audio.playback_ack",
               "session.resume", "input_text.append", "barge_in", "conversation.item.create",
               "conversation.item.retrieve", "conversation.item.truncate", "session.close", "close")
client_events = st.fixed_dictionaries({"type": st.sampled_from(EVENT_TYPES) | st.text(min_size=1, max_size=12)},
                                      optional={
    "audio": audio_b64, "delta": audio_b64, "format": spellings, "input_audio_format": spellings,
    "sample_rate_hz": rates, "sample_rate": rates, "event_id": either("evt_1") | st.text(max_size=8),
    "response_id": json_values, "item_id": json_values, "server_event_seq": either(0, 5, -1, 1.0, True),
    "played_ms": either(0, 80, -1, 2.5, 1e20), "reason": json_values, "session": session_objects,
    "response": json_values | st.fixed_dictionaries({}, optional={"instructions": scalars, "voice": scalars}),
})


# The websocket message decoder ---------------------------------------------------------------------
@FUZZ
@given(message=st.text(max_size=200) | st.binary(max_size=50) | st.none()
       | json_values.map(json.dumps) | client_events.map(json.dumps)
       | st.tuples(client_events.map(json.dumps), st.integers(0, 300)).map(lambda t: t[0][: t[1]])  # truncated
       | st.integers(1, 3000).map(lambda n: '{"type":"x","a":' + "[" * n + "]" * n + "}")
       | st.sampled_from(['{"type":"x","a":NaN}', '{"type":"x","a":-Infinity}', '{"type":"x","a":1e400}',
                          '{"type":"x","a":' + "9" * 5000 + "}", '{"type":""}', '{"type":null}', "\ud800"]),
       limit=st.integers(1, 400))
def test_decode_event_gives_an_event_or_a_typed_error(message, limit):
    try:
        event = decode_event(message, limit)
    except ProtocolError as exc:
        assert exc.code in ("bad_event", "invalid_json", "event_too_large")
        return
    assert isinstance(event, dict) and isinstance(event["type"], str) and event["type"]
    assert isinstance(message, str) and len(message.encode("utf-8", "surrogatepass")) <= limit
    json.dumps(event, allow_nan=False)  # nothing non-finite gets in
    assert client_event_id(event) is None or isinstance(client_event_id(event), str)


@FUZZ
@given(event=client_events)
def test_parse_append(event):
    try:
        request = parse_append(event)
    except ProtocolError as exc:
        assert exc.code in ("bad_event", "unsupported_audio_format") and error_type(exc.code) in ERROR_TYPES
        return
    assert isinstance(request.audio, str)
    assert request.codec is None or request.codec in INPUT_CODECS
    assert request.rate is None or (isinstance(request.rate, int) and 8000 <= request.rate <= 192000)


# session.update ------------------------------------------------------------------------------------
@FUZZ
@given(payload=session_objects | json_values, wrapped=st.booleans(), is_open=st.booleans(), locked=st.booleans())
def test_session_update_is_valid_or_refused_and_never_changes_the_fixed_fields(payload, wrapped, is_open, locked):
    event = {"type": "session.update", "session": payload} if wrapped else {"type": "session.update", **(
        payload if isinstance(payload, dict) else {"session": payload})}
    current = SessionConfig(model="personaplex", temperature=0.0)
    try:
        config = parse_session_update(session_payload(event), current, is_open=is_open, input_rate_locked=locked,
                                      max_instructions_chars=6000)
    except ProtocolError as exc:
        assert exc.code and error_type(exc.code) in ERROR_TYPES
        assert len(exc.message) < 20000
        return
    if is_open:
        assert (config.model, config.voice, config.persona, config.temperature, config.seed) == (
            current.model, current.voice, current.persona, current.temperature, current.seed)
    if locked:
        assert config.input_rate == current.input_rate
    assert config.input_codec in INPUT_CODECS and 8000 <= config.input_rate <= 192000
    assert len(config.instructions) <= 6000
    public = session_object(session_id="duplex-x", state="open", epoch=0, config=config, caps=capabilities(2),
                            active_response_id=None)
    json.dumps(public, allow_nan=False)  # what the client gets back is always sendable
    config.spec()  # and what the engine gets is a valid SessionSpec


# The session's event dispatcher, with model output interleaved -----------------------------------
class StubScheduler:
    """Records what a session asks of the scheduler."""

    def __init__(self) -> None:
        self.queued = 0
        self.restarts: list[int] = []

    def push(self, key: str, epoch: int, frames: np.ndarray) -> None:
        assert frames.dtype == np.float32 and frames.ndim == 2 and frames.shape[1] == FRAME_SAMPLES
        assert np.isfinite(frames).all()
        self.queued += len(frames)

    def restart(self, key: str, epoch: int) -> None:
        self.restarts.append(epoch)

    def drop_pending(self, key: str) -> None:
        self.queued = 0

    def pending(self, key: str) -> int:
        return self.queued


actions = st.lists(st.one_of(
    client_events.map(lambda e: ("event", e)),
    st.tuples(st.just("frame"), st.integers(-1, 1), st.text(max_size=3)),
    st.tuples(st.just("failure"), st.integers(-1, 0), st.booleans()),
), max_size=25)


@FUZZ
@given(script=actions)
def test_session_handles_any_event_sequence(script):
    settings_ = Settings(max_pending_input_bytes=64 * 1920 * 4, frames_per_delta=2)

    async def play() -> list[dict[str, Any]]:
        scheduler = StubScheduler()
        session = Session("duplex-fuzz", SessionConfig(model="m"), port=scheduler, settings=settings_,
                          metrics=Metrics(), caps=capabilities(2))
        for step in script:
            if step[0] == "event":
                reason = session.handle(step[1])
                if reason is not None:
                    assert isinstance(reason, str) and reason
                    break
            elif step[0] == "frame":
                pcm = np.zeros(FRAME_SAMPLES, dtype=np.int16)
                session.on_result(FrameResult("duplex-fuzz", session.epoch + step[1], pcm, step[2], 5, False,
                                              1, 1.0, 1, 0.0))
            else:
                session.on_result(FrameFailure("duplex-fuzz", session.epoch + step[1], "boom", fatal=step[2]))
        session.begin_close()
        assert scheduler.restarts == sorted(set(scheduler.restarts)), "epochs only move forward"
        return [json.loads(text) for text, *_ in session.outbox._items]

    events = asyncio.run(play())
    _check_server_events(events)


def _check_server_events(events: list[dict[str, Any]]) -> None:
    """What a client would read: objects with a type, typed errors, and responses that
    open before they stream and stream nothing once done."""
    opened, done = set(), set()
    for event in events:
        assert isinstance(event, dict) and isinstance(event["type"], str)
        kind, rid = event["type"], event.get("response_id")
        if kind == "error":
            assert event["error"]["type"] in ERROR_TYPES and event["error"]["code"]
        elif kind == "response.created":
            opened.add(event["response"]["id"])
        elif kind == "response.done":
            assert event["response"]["id"] in opened and event["response"]["id"] not in done
            assert event["response"]["status"] in ("completed", "cancelled", "failed")
            done.add(event["response"]["id"])
        elif rid is not None and kind.startswith("response.output_audio"):
            assert rid in opened and rid not in done, f"{kind} for a response that is not open"
        if "delta" in event:
            assert isinstance(event["delta"], str)


# Audio decoders ----------------------------------------------------------------------------------
@FUZZ
@given(data=st.text(max_size=64) | audio_b64)
def test_decode_base64_is_strict(data):
    try:
        raw = decode_base64(data)
    except AudioError as exc:
        assert exc.code == "bad_audio"
        return
    assert base64.b64encode(raw).decode() == data


@FUZZ
@given(raw=st.binary(max_size=256), codec=st.sampled_from(sorted(INPUT_CODECS)))
def test_to_float32_decodes_whole_finite_samples(raw, codec):
    try:
        samples = to_float32(raw, codec)
    except AudioError as exc:
        assert exc.code == "bad_event"
        width = {"pcm16": 2, "pcm_f32le": 4}.get(codec, 1)
        assert len(raw) % width or (codec == "pcm_f32le" and not np.isfinite(np.frombuffer(
            raw, "<f4")).all())
        return
    assert samples.dtype == np.float32 and np.isfinite(samples).all()
    assert len(samples) == len(raw) // {"pcm16": 2, "pcm_f32le": 4}.get(codec, 1)
    if codec == "pcm_f32le":
        assert samples.tobytes() == raw  # passed through bit for bit
    else:
        assert np.abs(samples).max(initial=0) <= 1.0


@FUZZ
@given(value=json_values | st.floats() | st.sampled_from([float("nan"), float("inf"), 2**80]))
def test_check_rate_and_codec_names(value):
    try:
        rate = check_rate(value)
    except AudioError as exc:
        assert exc.code == "bad_event"
    else:
        assert isinstance(rate, int) and 8000 <= rate <= 192000 and rate == value
    name = canonical_codec(value)
    assert name is None or name in ("pcm16", "pcm_f32le", "g711_ulaw", "g711_alaw", "wav")


@FUZZ
@given(rate=st.sampled_from([8000, 11025, 16000, 22050, 24000, 44100, 48000, 96000]),
       cuts=st.lists(st.integers(0, 6000), max_size=8), clear_at=st.integers(-1, 8))
def test_input_stream_frames_any_chunking(rate, cuts, clear_at):
    stream = InputStream(rate)
    total_in, total_out = 0, 0
    rng = np.random.default_rng(len(cuts))
    for i, n in enumerate(cuts):
        if i == clear_at:
            stream.clear()
            total_in = total_out = 0
        bound = stream.frames_after(n)
        frames = stream.push((rng.standard_normal(n) * 0.1).astype(np.float32))
        assert frames.ndim == 2 and frames.shape[1] == FRAME_SAMPLES and frames.dtype == np.float32
        assert len(frames) <= bound, "frames_after must bound what push yields (input backpressure relies on it)"
        total_in += n
        total_out += len(frames)
    if rate == 24000:  # no resampler: every sample is in a frame or in the partial one
        assert total_out == total_in // FRAME_SAMPLES
        residue = stream.pad_to_frame()
        assert (residue is None) == (total_in % FRAME_SAMPLES == 0)
    else:
        assert total_out * FRAME_SAMPLES <= total_in * 24000 / rate + FRAME_SAMPLES


@FUZZ
@given(values=st.lists(st.floats(width=32), max_size=50))
def test_pcm16_output_is_always_valid(values):
    pcm = float_to_pcm16(np.array(values, dtype=np.float32))
    assert pcm.dtype == np.dtype("<i2") and len(pcm) == len(values)
    raw = base64.b64decode(pcm16_base64(pcm), validate=True)
    assert np.array_equal(np.frombuffer(raw, "<i2"), pcm)
