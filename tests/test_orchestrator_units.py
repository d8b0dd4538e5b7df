"""Pure unit tests of the orchestrator's protocol, audio, settings and metrics pieces."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from engines.config import DEFAULT_PERSONA, DEFAULT_VOICE
from orchestrator.metrics import Metrics
from orchestrator.protocol.audio import (AudioError, InputStream, canonical_codec, decode_base64, float_to_pcm16,
                                         pcm16_base64, to_float32)
from orchestrator.protocol.client_events import decode_event, parse_append
from orchestrator.protocol.errors import ProtocolError, error_type
from orchestrator.protocol.events import capabilities, response_terminal, session_object
from orchestrator.protocol.session_config import SessionConfig, parse_session_update
from orchestrator.settings import Settings, SettingsError


# Audio ---------------------------------------------------------------------------------------

def test_pcm_f32le_at_24k_is_byte_exact():
    rng = np.random.default_rng(0)
    samples = rng.standard_normal(1920 * 3 + 500).astype("<f4")
    raw = samples.tobytes()
    stream = InputStream(24000)
    decoded = to_float32(decode_base64(base64.b64encode(raw).decode()), "pcm_f32le")
    frames = np.concatenate([stream.push(decoded[:1000]), stream.push(decoded[1000:])])
    assert frames.shape == (3, 1920)
    assert frames.astype("<f4").tobytes() == raw[: 3 * 1920 * 4]


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=12))
@hsettings(max_examples=60, deadline=None)
def test_framing_does_not_depend_on_chunking(cuts):
    samples = np.arange(sum(cuts), dtype=np.float32)
    stream = InputStream(24000)
    pieces, start = [], 0
    for n in cuts:
        pieces.append(stream.push(samples[start:start + n]))
        start += n
    frames = np.concatenate(pieces) if pieces else np.zeros((0, 1920), np.float32)
    whole = len(samples) // 1920
    np.testing.assert_array_equal(frames.reshape(-1), samples[: whole * 1920])


def test_resampler_keeps_pitch_and_duration():
    rate = 16000
    t = np.arange(rate * 2) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    stream = InputStream(rate)
    frames = np.concatenate([stream.push(chunk) for chunk in np.array_split(tone, 13)])
    assert 24 <= len(frames) <= 25  # 2 s = 25 frames, minus the resampler's delay
    out = frames.reshape(-1)[4800:]  # skip the start-up transient
    spectrum = np.abs(np.fft.rfft(out))
    peak_hz = np.argmax(spectrum) * 24000 / len(out)
    assert abs(peak_hz - 440) < 5
    assert abs(np.sqrt(np.mean(out**2)) - 0.5 / np.sqrt(2)) < 0.02


def test_pcm16_and_g711_decoding():
    pcm = np.array([0, 16384, -32768, 32767], dtype="<i2")
    np.testing.assert_allclose(to_float32(pcm.tobytes(), "pcm16"), [0, 0.5, -1, 32767 / 32768])
    # ITU-T G.711 reference values.
    ulaw = to_float32(bytes([0x00, 0x80, 0xFF, 0x7F]), "g711_ulaw") * 32768
    np.testing.assert_array_equal(ulaw, [-32124, 32124, 0, 0])
    alaw = to_float32(bytes([0xD5, 0x55, 0x2A, 0xAA]), "g711_alaw") * 32768
    np.testing.assert_array_equal(alaw, [8, -8, -32256, 32256])


def test_audio_errors():
    with pytest.raises(AudioError) as err:
        decode_base64("abc$")
    assert err.value.code == "bad_audio"
    with pytest.raises(AudioError) as err:
        to_float32(b"\x00" * 6, "pcm_f32le")
    assert err.value.code == "bad_event"
    with pytest.raises(AudioError) as err:
        to_float32(np.array([np.inf], dtype="<f4").tobytes(), "pcm_f32le")
    assert "finite" in str(err.value)
    with pytest.raises(AudioError):
        to_float32(b"\x00", "pcm16")


def test_output_pcm16():
    pcm = float_to_pcm16(np.array([0.0, 1.5, -2.0, np.nan, 0.5], dtype=np.float32))
    np.testing.assert_array_equal(pcm, [0, 32767, -32767, 0, 16384])
    assert base64.b64decode(pcm16_base64(pcm)) == pcm.astype("<i2").tobytes()


def test_codec_spellings():
    assert canonical_codec("audio/pcm") == canonical_codec("s16le") == "pcm16"
    assert canonical_codec("F32LE") == "pcm_f32le"
    assert canonical_codec("audio/pcmu") == "g711_ulaw"
    assert canonical_codec("opus") is None and canonical_codec(7) is None


# Client events --------------------------------------------------------------------------------

@pytest.mark.parametrize("message,code", [
    (b"{}", "bad_event"), ("{x", "invalid_json"), ("[]", "bad_event"), ('{"type": 3}', "bad_event"),
    ('{"type": ""}', "bad_event"), ("x" * 101, "event_too_large"), ('{"type":"' + "é" * 50 + '"}', "event_too_large"),
])
def test_decode_event_errors(message, code):
    with pytest.raises(ProtocolError) as err:
        decode_event(message, max_bytes=100)
    assert err.value.code == code


def test_parse_append():
    req = parse_append({"type": "input_audio_buffer.append", "delta": "AAAA", "format": "audio/pcm", "sample_rate": 16000})
    assert (req.audio, req.codec, req.rate) == ("AAAA", "pcm16", 16000)
    for bad, code in (({"audio": 5}, "bad_event"), ({"audio": "", "format": "mp3"}, "unsupported_audio_format"),
                      ({"audio": "", "sample_rate_hz": 24000.5}, "bad_event"),
                      ({"audio": "", "sample_rate_hz": 200000}, "bad_event"),
                      ({"audio": "", "sample_rate_hz": True}, "bad_event")):
        with pytest.raises(ProtocolError) as err:
            parse_append(bad)
        assert err.value.code == code


# Session configuration --------------------------------------------------------------------------

BASE = SessionConfig(model="m")


def test_reference_flat_session():
    cfg = parse_session_update({"model": "nvidia/personaplex-7b-v1", "input_audio_format": "pcm_f32le",
                                "output_audio_format": "pcm16", "sample_rate_hz": 24000, "voice": "NATM1.pt",
                                "instructions": "Be brief.", "turn_detection": None, "temperature": 0,
                                "extra_body": {"auto_response": True, "seed": 7}, "session_id": "ignored"},
                               BASE, is_open=False, input_rate_locked=False)
    assert (cfg.model, cfg.voice, cfg.persona, cfg.input_codec, cfg.input_rate) == \
        ("nvidia/personaplex-7b-v1", "NATM1.pt", "Be brief.", "pcm_f32le", 24000)
    spec = cfg.spec()
    assert spec.sampling.greedy and spec.seed == 7


def test_openai_ga_session():
    cfg = parse_session_update({"type": "realtime", "instructions": "", "output_modalities": ["audio"],
                                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                                    "turn_detection": None},
                                          "output": {"format": {"type": "audio/pcm", "rate": 24000},
                                                     "voice": "VARF0.pt"}}},
                               BASE, is_open=False, input_rate_locked=False)
    assert (cfg.input_codec, cfg.input_rate, cfg.voice) == ("pcm16", 16000, "VARF0.pt")
    assert cfg.persona == DEFAULT_PERSONA and cfg.output_modalities == ("audio",)
    assert not cfg.spec().sampling.greedy  # no temperature: the engine's default sampling


def test_session_defaults():
    cfg = parse_session_update({}, BASE, is_open=False, input_rate_locked=False)
    assert (cfg.voice, cfg.input_codec, cfg.input_rate) == (DEFAULT_VOICE, "pcm_f32le", 24000)


@pytest.mark.parametrize("payload,code", [
    ({"voice": "../x.pt"}, "invalid_voice"), ({"voice": "alloy"}, "invalid_voice"), ({"voice": 3}, "invalid_voice"),
    ({"extra_body": {"personaplex_persona": "x"}}, "invalid_duplex_runtime_config"),
    ({"extra_body": []}, "bad_event"), ({"turn_detection": {"type": "semantic_vad"}}, "unsupported_turn_detection"),
    ({"turn_detection": {"type": "server_vad", "interrupt_response": False}}, "unsupported_turn_detection"),
    ({"input_audio_format": "mp3"}, "unsupported_audio_format"), ({"output_audio_format": "g711_ulaw"},
                                                                    "unsupported_audio_format"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "unsupported_audio_format"),
    ({"temperature": -1}, "bad_event"), ({"idle_timeout_s": 0}, "bad_event"), ({"instructions": 5}, "bad_event"),
    ({"audio": "x"}, "bad_event"),
])
def test_session_config_errors(payload, code):
    with pytest.raises(ProtocolError) as err:
        parse_session_update(payload, BASE, is_open=False, input_rate_locked=False)
    assert err.value.code == code


def test_updates_of_an_open_session():
    cfg = parse_session_update({"voice": "NATF2.pt", "instructions": "", "temperature": 0.5}, BASE, is_open=False,
                               input_rate_locked=False)
    same = parse_session_update({"voice": "NATF2.pt", "instructions": DEFAULT_PERSONA, "temperature": 0.5,
                                 "sample_rate_hz": 24000}, cfg, is_open=True, input_rate_locked=True)
    assert same.persona == cfg.persona
    for payload, code in (({"voice": "NATM1.pt"}, "voice_update_unsupported"),
                          ({"instructions": "Pirate."}, "persona_update_unsupported"),
                          ({"model": "other"}, "model_update_unsupported"),
                          ({"temperature": 0}, "sampling_update_unsupported"),
                          ({"sample_rate_hz": 16000}, "bad_event")):
        with pytest.raises(ProtocolError) as err:
            parse_session_update(payload, cfg, is_open=True, input_rate_locked=True)
        assert err.value.code == code
    # Before any audio the rate may still change.
    assert parse_session_update({"sample_rate_hz": 16000}, cfg, is_open=True, input_rate_locked=False).input_rate == 16000


# Events and errors ------------------------------------------------------------------------------

def test_error_types_and_envelope():
    assert error_type("resource_exhausted") == "rate_limit_error"
    assert error_type("engine_error") == "server_error" and error_type("context_reset_failed") == "server_error"
    assert error_type("invalid_voice") == "invalid_request_error"
    body = ProtocolError("bad_event", "nope", param="audio", retryable=False).payload("evt_1")
    assert body == {"type": "invalid_request_error", "code": "bad_event", "message": "nope", "event_id": "evt_1",
                    "param": "audio", "retryable": False}


def test_capabilities_and_session_object():
    caps = capabilities(2)
    assert caps["supports_multi_session"] and capabilities(1)["supports_multi_session"] is False
    obj = session_object(session_id="duplex-x", state="open", epoch=0, config=BASE, caps=caps, active_response_id=None)
    json.dumps(obj, allow_nan=False)
    assert obj["capabilities"] is caps and obj["audio"]["input"]["format"]["type"] == "audio/pcm_f32le"


def test_terminal_sequence_order():
    events = response_terminal(session_id="s", epoch=1, response_id="r", previous_item_id=None, status="cancelled",
                               reason="client_cancelled", transcript="hi", audio_duration_ms=160)
    assert [e["type"] for e in events] == [
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done", "rate_limits.updated"]
    assert events[5]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    no_text = response_terminal(session_id="s", epoch=1, response_id="r", previous_item_id=None, status="completed",
                                reason=None, transcript="", audio_duration_ms=0)
    assert "response.output_audio_transcript.done" not in [e["type"] for e in no_text]


# Settings, admission, metrics ------------------------------------------------------------------

def test_settings_from_env_and_toml(tmp_path):
    toml = tmp_path / "server.toml"
    toml.write_text('[personaplex]\nmax_sessions = 4\nbatch_window_ms = 10\napi_keys = ["a", "b"]\n')
    cfg = Settings.from_env({"PERSONAPLEX_CONFIG": str(toml), "PERSONAPLEX_MAX_SESSIONS": "6",
                             "PERSONAPLEX_SILENCE_GRACE_S": "0", "PERSONAPLEX_CHECKPOINT": "", "OTHER": "x"})
    assert (cfg.max_sessions, cfg.batch_window_ms, cfg.silence_grace_s, cfg.api_keys, cfg.checkpoint) == \
        (6, 10.0, 0.0, ("a", "b"), None)
    assert Settings.from_env({}).silence_grace_s == 3.0 and Settings().frames_per_delta == 1
    assert Settings(device="cpu").resolved_max_sessions("cpu") == 8


@pytest.mark.parametrize("env,needle", [
    ({"PERSONAPLEX_MAX_SESSIONS": "two"}, "PERSONAPLEX_MAX_SESSIONS"),
    ({"PERSONAPLEX_MAX_SESSIONS": "0"}, "PERSONAPLEX_MAX_SESSIONS"),
    ({"PERSONAPLEX_SILENCE_GRACE_S": "-1"}, "PERSONAPLEX_SILENCE_GRACE_S"),
    ({"PERSONAPLEX_BATCH_WINDOW_MS": "nan"}, "PERSONAPLEX_BATCH_WINDOW_MS"),
    ({"PERSONAPLEX_DEVICE": "tpu"}, "PERSONAPLEX_DEVICE"),
    ({"PERSONAPLEX_CHECKPOINT": "/does/not/exist"}, "PERSONAPLEX_CHECKPOINT"),
    ({"PERSONAPLEX_CONFIG": "/does/not/exist.toml"}, "PERSONAPLEX_CONFIG"),
    ({"PERSONAPLEX_OPUS_CODEC": "ffmpeg"}, "PERSONAPLEX_OPUS_CODEC must be one of auto, libopus, sphn"),
    ({"PERSONAPLEX_OPUS_LIBRARY": "/does/not/libopus.so.0"}, "libopus could not be loaded .*/does/not/libopus"),
    ({"PERSONAPLEX_OPUS_ENCODE_THREADS": "0"}, "PERSONAPLEX_OPUS_ENCODE_THREADS"),
])
def test_settings_errors_name_the_variable(env, needle):
    with pytest.raises(SettingsError, match=needle):
        Settings.from_env(env)


def test_settings_toml_unknown_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("max_sesions = 3\n")
    with pytest.raises(SettingsError, match="max_sesions"):
        Settings.from_env({"PERSONAPLEX_CONFIG": str(toml)})


def test_a_removed_setting_says_what_became_of_it(tmp_path, caplog):
    """PERSONAPLEX_ENGINE_HOST is gone: in the environment it is ignored with a line saying why,
    in a config file it stops the start with that line."""
    with caplog.at_level("WARNING", logger="orchestrator.settings"):
        settings = Settings.from_env({"PERSONAPLEX_ENGINE_HOST": "thread"})
    assert settings == Settings()
    assert "ignoring PERSONAPLEX_ENGINE_HOST: every engine runs in an engine process of its own" in caplog.text
    toml = tmp_path / "old.toml"
    toml.write_text('engine_host = "thread"\n')
    with pytest.raises(SettingsError, match="'engine_host' is gone: every engine runs in an engine process"):
        Settings.from_env({"PERSONAPLEX_CONFIG": str(toml)})


def test_metrics_exposition():
    metrics = Metrics()
    metrics.observe_tick(0.015, 3, silence_frames=1)
    metrics.inc("errors", 'bad"code')
    metrics.inc("sessions_refused")
    text = metrics.render()
    assert 'personaplex_tick_duration_seconds_bucket{le="0.02"} 1' in text
    assert 'personaplex_tick_duration_seconds_bucket{le="0.01"} 0' in text
    assert 'personaplex_batch_size_bucket{le="4.0"} 1' in text and "personaplex_batch_size_sum 3.0" in text
    assert 'personaplex_errors_total{code="bad\\"code"} 1' in text
    assert "personaplex_sessions_refused_total 1" in text and "personaplex_frames_out_total 3" in text
    assert 'personaplex_frames_in_total{source="silence"} 1' in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


# Session (no engine needed: results are fed by hand) -------------------------------------------

def test_session_drops_late_outputs_of_a_cancelled_epoch():
    import asyncio

    from orchestrator.frontend.session import Session
    from orchestrator.engine_port import FrameResult
    from orchestrator.lockstep.scheduler import TickScheduler
    from orchestrator.lockstep.tick_policy import WindowPolicy

    def result(epoch: int) -> FrameResult:
        return FrameResult("s", epoch, np.ones(1920, np.int16), "hi", 5, False, 1, 1.0, 1, 0.0)

    async def scenario():
        scheduler = TickScheduler(lambda: None, policy=WindowPolicy(0.02), silence_grace_s=0, warmup_frames=0,
                                  metrics=Metrics())  # never started: only its bookkeeping is used
        session = Session("s", SessionConfig(model="m"), port=scheduler, settings=Settings(),
                          metrics=Metrics(), caps=capabilities(2))
        session.on_result(result(0))
        opened = [json.loads(text)["type"] for text, *_ in session.outbox._items]
        assert opened[0] == "response.created" and opened[-2:] == [
            "response.output_audio.delta", "response.output_audio_transcript.delta"]
        session.handle({"type": "response.cancel"})
        assert session.epoch == 1
        queued = len(session.outbox._items)
        session.on_result(result(0))  # a tick that was in flight during the cancel
        assert len(session.outbox._items) == queued
        session.on_result(result(1))
        types = [json.loads(text)["type"] for text, *_ in list(session.outbox._items)[queued:]]
        assert types[0] == "response.created" and types[-1] == "response.output_audio_transcript.delta"

    asyncio.run(scenario())


def test_json_codec_is_strict_and_compact():
    from orchestrator.protocol import json_codec

    assert json_codec.loads('{"type":"x","n":[1,2.5,"a"]}') == {"type": "x", "n": [1, 2.5, "a"]}
    for text in ('{"n":NaN}', '{"n":Infinity}', '{"n":-Infinity}', '{"n":1e999}', '"\\ud800"', "[" * 1025 + "]" * 1025,
                 '{"a":1,}', "\ud800"):
        with pytest.raises(json_codec.InvalidJSON):
            json_codec.loads(text)
    assert json_codec.loads("[" * 1000 + "]" * 1000)  # as deep as the standard library went
    assert isinstance(json_codec.loads('{"n":18446744073709551616}')["n"], float)  # beyond 64 bits
    assert json_codec.dumps({"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'


def test_event_ids_are_unique_and_shaped_like_before():
    from orchestrator.protocol.events import new_event_id

    ids = [new_event_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(i.startswith("event_") and len(i) == len("event_") + 32 for i in ids)
    int(ids[0][len("event_"):], 16)  # hex, as a uuid4's was


def test_the_engine_thread_has_an_os_name():
    import threading
    from pathlib import Path

    from orchestrator.os_threads import name_os_thread

    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc here")
    seen: list[str] = []

    def run() -> None:
        name_os_thread("ppengine-cpu#1")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == ["ppengine-cpu#1"]


def test_the_gpu_count_comes_from_the_driver_without_torch_when_it_can(tmp_path, monkeypatch):
    """The engine host resolves devices with the CUDA driver's count (no torch import, ~3 s of
    every start); unsure answers (no driver, a CPU-only torch) leave it to torch."""
    import ctypes
    import importlib.util

    from orchestrator import settings as settings_module

    package = tmp_path / "torch"
    package.mkdir()
    found = importlib.util.spec_from_file_location("torch", package / "__init__.py",
                                                   submodule_search_locations=[str(package)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found if name == "torch" else None)

    class Driver:
        def __init__(self, path):
            assert path == "libcuda.so.1"

        def cuInit(self, flags):
            return 0

        def cuDeviceGetCount(self, count):
            count._obj.value = 3
            return 0

    monkeypatch.setattr(ctypes, "CDLL", Driver)
    (package / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    assert settings_module._driver_gpu_count() == 3
    (package / "version.py").write_text("cuda: Optional[str] = None\n")  # a CPU-only build
    assert settings_module._driver_gpu_count() is None

    def no_driver(path):
        raise OSError("libcuda.so.1: cannot open shared object file")

    (package / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert settings_module._driver_gpu_count() is None


def test_engine_failures_are_told_from_typed_refusals():
    """A full engine (NoFreeSlot) is a refusal worded for the client, not an open failure;
    the allocator's error is counted as out_of_memory, anything else as engine_error."""
    import torch

    from engines.interface import EngineError, InvalidSessionSpec, NoFreeSlot
    from orchestrator.protocol.errors import failure_reason, is_typed_refusal

    assert is_typed_refusal(NoFreeSlot("full")) and is_typed_refusal(InvalidSessionSpec("no such voice"))
    assert not is_typed_refusal(EngineError("lost a slot")) and not is_typed_refusal(RuntimeError("x"))
    assert failure_reason(torch.OutOfMemoryError("CUDA out of memory")) == "out_of_memory"
    assert failure_reason(RuntimeError("CUDA error")) == "engine_error"
