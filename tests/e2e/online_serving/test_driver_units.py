"""Unit tests of the driver's pure parts, against values computed by hand."""

from __future__ import annotations

import asyncio
import base64
import json
import wave
from pathlib import Path

import numpy as np
import pytest

from orchestrator.load_driver import acceptance, metrics, wire
from orchestrator.load_driver.audio import InputAudio, frame_count, load_input, read_wav_float32, resample_linear
from orchestrator.load_driver.packets import AudioTally, packet_log
from orchestrator.load_driver.pacing import PacingGrid, send_paced

FRAME = 1920


# Distributions ---------------------------------------------------------------------------------

def test_percentile_is_linear_between_ranks():
    assert metrics.percentile_linear([1, 2, 3, 4, 5], 0.99) == pytest.approx(4.96)  # 4 + 0.96 * (5 - 4)
    assert metrics.percentile_linear([0, 100], 0.99) == pytest.approx(99.0)
    assert metrics.percentile_linear([5, 1, 3], 0.5) == 3  # sorted first
    assert metrics.percentile_linear([7], 0.99) == 7
    assert metrics.percentile_linear([], 0.5) is None
    with pytest.raises(ValueError):
        metrics.percentile_linear([1], 1.5)


def test_distribution_fields():
    d = metrics.distribution([10, 30, 20, 30])
    # sorted 10 20 30 30: median at rank 1.5 -> 25; p99 at rank 2.97 -> 30; first maximum at index 1
    assert d == {"count": 4, "median": 25.0, "p99": pytest.approx(30.0), "max": 30.0, "argmax_index": 1}
    assert metrics.distribution([]) == {"count": 0, "median": None, "p99": None, "max": None, "argmax_index": None}


def test_packet_intervals_and_send_lateness():
    assert metrics.packet_intervals_ms([1.0, 1.08, 1.3]) == pytest.approx([80.0, 220.0])
    sends = [(0.0, 0.001, 0.002), (0.08, 0.07, 0.075), (0.16, 0.26, 0.27)]
    assert metrics.send_lateness_ms(sends) == pytest.approx([1.0, 0.0, 100.0])  # early counts as 0
    assert metrics.pacing_warning(metrics.distribution([1.0, 0.0, 100.0])) is True  # p99 = 98 ms > 80
    assert metrics.pacing_warning(metrics.distribution([1.0, 0.0, 79.0])) is False
    assert metrics.pacing_warning(metrics.distribution([])) is None


def test_client_stream_rtf_and_first_after():
    # 2 s of audio, last packet 1.5 s after the first send started
    assert metrics.client_stream_rtf([1.0, 2.0], [24000, 24000], 0.5) == pytest.approx(0.75)
    assert metrics.client_stream_rtf([], [], 0.5) is None
    assert metrics.client_stream_rtf([1.0], [1920], None) is None
    assert metrics.first_after_ms(1.25, 1.0) == pytest.approx(250.0)
    assert metrics.first_after_ms(0.9, 1.0) == pytest.approx(-100.0)
    assert metrics.first_after_ms(None, 1.0) is None


# Playback simulations --------------------------------------------------------------------------

ARRIVALS = [0.0, 0.08, 0.30, 0.32]  # one 80 ms frame each; a 140 ms hole before the third
SAMPLES = [FRAME] * 4


def test_continuity_counts_the_gaps():
    c = metrics.continuity(ARRIVALS, SAMPLES)
    # packet 2: 0.30 s elapsed, 0.16 s received -> 0.14 s short; packet 3: 0.32 - 0.24 = 0.08 s short
    assert c.max_underrun_s == pytest.approx(0.14)
    assert c.underrun_event_count == 2
    assert c.is_continuous is False  # 0.14 > 0.1
    steady = metrics.continuity([0.0, 0.08, 0.16, 0.24], SAMPLES)
    assert (steady.max_underrun_s, steady.underrun_event_count, steady.is_continuous) == (0.0, 0, True)
    assert metrics.continuity([], []) is None


def test_playout_stall_strict_and_steady():
    # strict: starts at 0.12; packet 2 is due at 0.12 + 0.16 = 0.28 but arrives at 0.30 -> 20 ms
    assert metrics.playout_stall_ms(ARRIVALS, SAMPLES, 0) == pytest.approx(20.0)
    # steady: starts at 0.08 + 0.12 = 0.20; every packet is in time
    assert metrics.playout_stall_ms(ARRIVALS, SAMPLES, 1) == pytest.approx(0.0)
    # start_packet past the end uses the last packet
    assert metrics.playout_stall_ms([0.0], [FRAME], 1) == 0.0
    assert metrics.playout_stall_ms([], [], 0) is None


def test_playout_stall_accumulates():
    # start 0.12; packet 1 due 0.20, arrives 0.50 (stall 0.30); packet 2 due 0.12+0.30+0.16 = 0.58, arrives 0.70
    assert metrics.playout_stall_ms([0.0, 0.5, 0.7], [FRAME] * 3, 0) == pytest.approx(300.0 + 120.0)


# Stream timing ---------------------------------------------------------------------------------

def test_stream_timing_slope_drift_and_lag():
    # Input frame k completes sending at 0.08 k; its reference is 0.08 k + 0.08.  Output frame k
    # arrives at 0.09 k + 0.13: 50 ms late at first, 10 ms more per frame.
    sends = [(0.08 * k, 0.08 * k, 0.08 * k) for k in range(10)]
    arrivals = [0.09 * k + 0.13 for k in range(10)]
    t = metrics.stream_timing(arrivals, [FRAME] * 10, sends)
    assert t["server_stream_rtf"] == pytest.approx(0.09 / 0.08)  # window k = 1..8
    assert t["stream_lag_drift_ms"] == pytest.approx(0.125 * 7 * 0.08 * 1000)  # 70 ms over the window
    lag = t["stream_lag_ms"]
    assert lag["count"] == 10 and lag["median"] == pytest.approx(95.0) and lag["max"] == pytest.approx(140.0)
    assert lag["p99"] == pytest.approx(139.1) and lag["argmax_index"] == 9
    # the strict player starts at 0.25 and needs packet k by 0.25 + 0.08 k; it arrives at 0.13 + 0.09 k,
    # which is late only from k = 13 on
    assert (t["playout_stall_ms"], t["playout_stalled"], t["steady_playout_stalled"]) == (0.0, False, False)


def test_stream_timing_uses_last_frame_of_each_packet():
    completed, edges = metrics.frame_completions([1.0, 2.0], [FRAME, 5 * FRAME], input_frames=6)
    assert completed == [1.0, 2.0, 2.0, 2.0, 2.0, 2.0] and edges == [0, 5]
    # more output than input: frames beyond the input are not timed
    completed, edges = metrics.frame_completions([1.0], [3 * FRAME], input_frames=2)
    assert completed == [1.0, 1.0] and edges == [1]


def test_stream_timing_without_enough_points_is_null():
    t = metrics.stream_timing([], [], [(0.0, 0.0, 0.0)])
    assert t["server_stream_rtf"] is None and t["stream_lag_drift_ms"] is None
    assert t["playout_stall_ms"] is None and t["playout_stalled"] is None
    assert t["stream_lag_ms"]["count"] == 0


def test_stream_lags_gaps_and_frames_after():
    sends = [(0.08 * k, 0.08 * k, 0.08 * k + 0.01) for k in range(4)]
    # frames 0..3 arrive 30 ms after their reference (send completion + 80 ms), frame 3 in a
    # second packet with a surplus frame
    arrivals, samples = [0.12, 0.20, 0.28, 0.36], [FRAME, FRAME, FRAME, 2 * FRAME]
    assert metrics.stream_lags_ms(arrivals, samples, sends) == pytest.approx([30.0] * 4)
    assert metrics.longest_gap_ms(arrivals) == pytest.approx(80.0)
    assert metrics.longest_gap_ms([1.0]) is None
    # the surplus frame (index 4) completed at 0.36: after 0.3 it counts, after 0.4 it does not
    assert metrics.frames_completed_after(arrivals, samples, 4, after=0.3) == 1
    assert metrics.frames_completed_after(arrivals, samples, 4, after=0.4) == 0
    assert metrics.frames_completed_after(arrivals, samples, 0, after=0.0) == 5


def test_least_squares_slope():
    assert metrics.least_squares_slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2.0)
    assert metrics.least_squares_slope([1, 1], [0, 5]) is None
    assert metrics.least_squares_slope([1], [1]) is None


# Output audio statistics -----------------------------------------------------------------------

def _pcm16(*frames: np.ndarray) -> bytes:
    return np.concatenate(frames).astype("<i2").tobytes()


def _audio_stats(pcm16: bytes, *, input_frames: int, voiced_rms_threshold: float) -> dict:
    tally = AudioTally(voiced_rms_threshold)
    tally.add(pcm16)
    return tally.stats(input_frames)


def test_audio_stats_counts_voiced_frames():
    silent = np.zeros(FRAME, dtype=np.int16)
    loud = np.full(FRAME, 16384, dtype=np.int16)  # RMS 0.5
    quiet = np.full(FRAME, 16, dtype=np.int16)  # RMS 16 / 32768 = 4.9e-4, below 1e-3
    stats = _audio_stats(_pcm16(silent, loud, quiet), input_frames=4, voiced_rms_threshold=1e-3)
    assert stats["output_frames"] == 3 and stats["voiced_frames"] == 1 and stats["silent_frames"] == 2
    assert stats["frame_deficit"] == 1 and stats["frame_coverage_ratio"] == pytest.approx(0.75)
    assert stats["audio_rms"] == pytest.approx(np.sqrt((0.25 + (16 / 32768) ** 2) / 3))
    assert stats["whole_codec_frames"] is True and stats["audio_samples"] == 3 * FRAME
    partial = _audio_stats(_pcm16(loud, loud[:100]), input_frames=0, voiced_rms_threshold=1e-3)
    assert partial["whole_codec_frames"] is False and partial["output_frames"] == 1
    assert partial["frame_coverage_ratio"] is None  # no input: not a ratio of zero
    empty = _audio_stats(b"", input_frames=3, voiced_rms_threshold=1e-3)
    assert empty["audio_rms"] is None and empty["output_frames"] == 0 and empty["frame_deficit"] == 3


def test_audio_tally_fed_in_pieces_equals_the_whole():
    rng = np.random.default_rng(7)
    pcm = (rng.standard_normal(7 * FRAME + 333) * 3000 * rng.random(7 * FRAME + 333) ** 4).astype("<i2")
    pcm[FRAME: 2 * FRAME] = 0  # one silent frame
    # the reference, in plain numpy over the whole stream
    audio = pcm.astype(np.float64) / 32768.0
    frame_rms = np.sqrt(np.mean(audio[: 7 * FRAME].reshape(7, FRAME) ** 2, axis=1))
    whole = {"audio_samples": pcm.size, "audio_rms": float(np.sqrt(np.mean(audio ** 2))), "output_frames": 7,
             "voiced_frames": int(np.count_nonzero(frame_rms >= 0.01)),
             "silent_frames": int(np.count_nonzero(frame_rms < 0.01)), "frame_deficit": 1,
             "frame_coverage_ratio": 7 / 8, "whole_codec_frames": False}
    for trial in range(5):
        cuts = np.sort(rng.choice(np.arange(1, pcm.size), size=6, replace=False))
        tally = AudioTally(0.01)
        for piece in np.split(pcm, cuts):
            tally.add(piece.tobytes())
        assert tally.stats(8) == pytest.approx(whole)
    assert whole["voiced_frames"] < whole["output_frames"] == 7
    fed = AudioTally(0.01)
    fed.add(pcm.tobytes())
    assert fed.stats(6, server_fed_frames=2)["frame_deficit"] == 1  # 7 whole frames, 2 not answers


def test_silence_fed_frames_from_delta_metadata():
    assert wire.silence_fed_frames({"metadata": {"timing": {"silence_input_frames": 2}}}, 3) == 2
    assert wire.silence_fed_frames({"metadata": {"timing": {"silence_input_frames": 9}}}, 3) == 3  # clamped
    assert wire.silence_fed_frames({"metadata": {"timing": {"silence_input": True}}}, 3) == 3
    assert wire.silence_fed_frames({"metadata": {"timing": {"silence_input": False}}}, 3) == 0
    assert wire.silence_fed_frames({"metadata": {"timing": {"silence_input_frames": True}}}, 3) is None
    assert wire.silence_fed_frames({"metadata": {"timing": {}}}, 3) is None
    assert wire.silence_fed_frames({}, 3) is None


# Wire ------------------------------------------------------------------------------------------

def _delta(samples: int = FRAME, **fields) -> dict:
    event = {"type": "response.output_audio.delta", "response_id": "resp_1", "sample_rate_hz": 24000,
             "delta": base64.b64encode(b"\x01\x00" * samples).decode()}
    event.update(fields)
    return event


@pytest.mark.parametrize("fields, code", [
    ({"delta": None}, "missing_audio_delta"),
    ({"delta": 5}, "missing_audio_delta"),
    ({"delta": "AAA*"}, "invalid_audio_base64"),
    ({"delta": "AAAA\n"}, "invalid_audio_base64"),  # strict: no stray characters
    ({"delta": base64.b64encode(b"\x00\x00\x00").decode()}, "unaligned_pcm16_packet"),
    ({"sample_rate_hz": 16000}, "invalid_audio_sample_rate"),
    ({"sample_rate_hz": "24000"}, "invalid_audio_sample_rate"),
    ({"sample_rate_hz": True}, "invalid_audio_sample_rate"),
    ({"response_id": ""}, "missing_audio_response_id"),
    ({"response_id": None}, "missing_audio_response_id"),
])
def test_audio_packet_rules(fields, code):
    with pytest.raises(wire.InvalidAudioPacket) as err:
        wire.audio_packet_pcm(_delta(**fields))
    assert err.value.code == code


def test_audio_packet_accepts_good_legacy_and_empty_packets():
    assert len(wire.audio_packet_pcm(_delta())) == 2 * FRAME
    assert wire.is_audio_delta(_delta(type="response.audio.delta"))
    # an empty delta is legal and is not held to the rate and id rules
    assert wire.audio_packet_pcm({"type": "response.output_audio.delta", "delta": ""}) == b""


def test_frame_event_is_the_reference_shape():
    quiet = np.zeros(1000, dtype=np.float32)  # a short last frame is zero-padded
    event = wire.frame_event(quiet, 4)
    assert set(event) == {"type", "audio", "format", "sample_rate_hz", "duration_ms", "audio_end_ms", "is_speech"}
    samples = np.frombuffer(base64.b64decode(event["audio"]), dtype="<f4")
    assert samples.size == FRAME and not samples.any()
    assert (event["format"], event["sample_rate_hz"], event["duration_ms"], event["audio_end_ms"]) == \
        ("pcm_f32le", 24000, 80, 400)
    assert event["is_speech"] is False
    loud = wire.frame_event(np.full(FRAME, 0.5, dtype=np.float32), 0)
    assert loud["is_speech"] is True and np.frombuffer(base64.b64decode(loud["audio"]), "<f4")[0] == 0.5


def test_realtime_url_and_redaction():
    url = wire.realtime_url("ws://h:1/v1/realtime?duplex=0&token=abc", "m x")
    assert url == "ws://h:1/v1/realtime?duplex=1&token=abc&model=m+x&autostart=0"
    assert wire.redacted_url("ws://user:pw@h:1/v1/realtime?token=abc") == "ws://h:1/v1/realtime?token=..."


def test_reading_server_events():
    assert wire.session_id_of({"session": {"id": "a"}}) == "a"
    assert wire.session_id_of({"session": {"session_id": "b"}}) == "b"
    assert wire.session_id_of({"session": {}, "session_id": "c"}) == "c"
    assert wire.session_id_of({"session": {"id": ""}}) is None
    assert wire.error_code_of({"type": "error", "error": {"code": "resource_exhausted"}}) == "resource_exhausted"
    assert wire.error_code_of({"type": "error", "error": "text", "code": "unsupported"}) == "unsupported"
    assert wire.error_code_of({"type": "error"}) == "unknown"
    assert wire.capability_mismatches({"chunk_period_ms": 80, "supports_multi_session_same_replica": False},
                                      wire.LOAD_CAPABILITIES) == ["supports_multi_session_same_replica"]
    assert wire.capability_mismatches(None, wire.LOAD_CAPABILITIES) == sorted(wire.LOAD_CAPABILITIES)
    assert wire.visible_text({"type": "response.output_audio_transcript.delta", "delta": " hi"})
    assert not wire.visible_text({"type": "response.output_audio_transcript.delta", "delta": "  "})


# Packet log and acceptance ---------------------------------------------------------------------

def _tone_delta(frames: int, response_id: str = "resp_1", amplitude: int = 3000, **fields) -> dict:
    pcm = np.full(frames * FRAME, amplitude, dtype="<i2").tobytes()
    return _delta(delta=base64.b64encode(pcm).decode(), response_id=response_id, **fields)


def test_packet_log_keeps_invalid_packets_out_of_the_audio():
    events = [
        {"type": "session.created"},
        _tone_delta(1),
        {"type": "response.output_audio_transcript.delta", "delta": " "},
        {"type": "response.output_audio_transcript.delta", "delta": "hi"},
        _tone_delta(1, sample_rate_hz=16000),
        _tone_delta(2, type="response.audio.delta"),
        _delta(delta=""),
    ]
    times = [0.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    log = packet_log(events, times)
    assert log.arrivals == [1.0, 1.4] and log.samples == [FRAME, 2 * FRAME]
    assert log.invalid == [{"event_index": 4, "received_at_s": 1.3, "code": "invalid_audio_sample_rate"}]
    assert log.first_text_at == 1.2 and log.audio_events == 4 and log.rates == {24000, 16000}
    assert len(log.pcm16) == 3 * FRAME * 2
    assert packet_log(events, times, upto=2).arrivals == [1.0]  # the cutoff excludes later events


def _failure(events: list[dict], input_frames: int, session_id: str | None = None, **thresholds) -> str | None:
    log = packet_log(events, [float(i) for i in range(len(events))])
    _, failure = acceptance.evaluate(log, input_frames=input_frames, thresholds=acceptance.Thresholds(**thresholds),
                                     session_id=session_id)
    return None if failure is None else failure.check


def test_acceptance_checks_in_order():
    good = [_tone_delta(1), _tone_delta(5)]
    assert _failure(good, 6) is None
    assert _failure(good, 10) is None  # deficit 4 is allowed
    assert _failure(good, 11) == "frame_deficit"
    assert _failure(good, 5) == "frame_deficit"  # more output than input
    assert _failure(good + [_delta(delta="!!")], 6) == "audio_packets"
    assert _failure([], 6) == "pcm16_output"
    assert _failure([_tone_delta(6, amplitude=0)], 6) == "audio_rms"
    assert _failure([_tone_delta(6, sample_rate_hz=16000), _tone_delta(0, sample_rate_hz=22050)], 6) == \
        "audio_packets"
    assert _failure(good, 0) == "input_frames"
    assert _failure([_delta(samples=FRAME + 1, delta=base64.b64encode(b"\x10\x10" * (FRAME + 1)).decode())] +
                    [_tone_delta(1)], 2) == "whole_codec_frames"
    assert _failure([_tone_delta(6)], 6) == "audio_chunks"
    assert _failure(good, 6, min_voiced_frames=7) == "voiced_frames"
    assert _failure([_tone_delta(6, amplitude=20), _tone_delta(1, amplitude=20)], 7) == "voiced_frames"
    assert _failure(good, 6, require_scheduler_data_plane=True) == "scheduler_data_plane"
    proven = {"vllm_omni": {"runtime_impl": "scheduler_data_plane", "uses_model_runner_scheduler": True,
                            "runner_kv_backed": True}}
    assert _failure([_tone_delta(1, metadata=proven), _tone_delta(5)], 6, require_scheduler_data_plane=True) is None
    assert _failure([_tone_delta(1), _tone_delta(5, response_id="resp_2")], 6) == "response_identity"
    mine = {"session_id": "duplex-a"}
    assert _failure([_tone_delta(1, metadata=mine), _tone_delta(5, metadata=mine)], 6, "duplex-a") is None
    assert _failure([_tone_delta(1, metadata=mine), _tone_delta(5, metadata={"session_id": "duplex-b"})], 6,
                    "duplex-a") == "session_identity"


def test_surplus_frames_are_server_fed_only_after_the_input_ended():
    events = [_tone_delta(1), _tone_delta(5)]  # six frames; the last packet arrives at t = 1.0
    log = packet_log(events, [0.0, 1.0])
    # the input (5 frames) ended before the last packet: its surplus frame is server-fed silence
    stats, failure = acceptance.evaluate(log, input_frames=5, thresholds=acceptance.Thresholds(), input_ended_at=0.5)
    assert failure is None and stats["server_fed_frames"] == 1 and stats["server_fed_frames_source"] == "timing"
    assert stats["frame_deficit"] == 0
    # the input ended after it: the server answered ahead of the input, which is surplus output
    stats, failure = acceptance.evaluate(log, input_frames=5, thresholds=acceptance.Thresholds(), input_ended_at=1.5)
    assert failure.check == "frame_deficit" and stats["server_fed_frames"] == 0
    # the deltas' own count wins over timing
    said = packet_log([_tone_delta(1, metadata={"timing": {"silence_input_frames": 0}}), _tone_delta(5)], [0.0, 1.0])
    stats, failure = acceptance.evaluate(said, input_frames=5, thresholds=acceptance.Thresholds(),
                                         input_ended_at=0.5)
    assert stats["server_fed_frames_source"] == "metadata" and failure.check == "frame_deficit"


def test_sample_rate_check_sees_empty_packets_too():
    # an empty delta escapes the packet rules but still declares its rate
    assert _failure([_tone_delta(1), _tone_delta(5), _delta(delta="", sample_rate_hz=16000)], 6) == "sample_rate"


# Pacing ----------------------------------------------------------------------------------------

def test_pacing_grid_restarts_only_after_a_frame_late_completion():
    grid = PacingGrid(10.0, 0.08)
    assert grid.due(0) == 10.0
    grid.sent(0, 10.01)
    assert grid.due(1) == pytest.approx(10.08)
    grid.sent(1, 10.30)  # 0.14 s after slot 2 (10.16): more than one period late -> restart
    assert grid.due(2) == pytest.approx(10.38) and grid.due(3) == pytest.approx(10.46)
    assert grid.planned(2) == pytest.approx(10.16)  # lateness is still measured on the original grid
    grid.sent(2, 10.45)  # 0.01 s before slot 3: keep the grid
    assert grid.due(3) == pytest.approx(10.46)
    grid.sent(3, 10.60)  # 0.06 s after slot 4 (10.54): within a period, no restart, no burst beyond one frame
    assert grid.due(4) == pytest.approx(10.54)


def test_send_paced_records_planned_started_completed():
    now = [100.0]
    sent: list[int] = []

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    async def send(text: str) -> None:
        event = json.loads(text)
        sent.append(event["audio_end_ms"])
        now[0] += 0.3 if event["audio_end_ms"] == 160 else 0.001  # frame 1 blocks for 300 ms

    sends: list[tuple[float, float, float]] = []
    pcm = np.zeros(4 * FRAME + 10, dtype=np.float32)  # 5 frames, the last one short
    frames = InputAudio("input.wav", "0" * 64, pcm).frame_texts
    dues: list[float] = []
    count = asyncio.run(send_paced(send, frames, start=100.0, sends=sends, clock=lambda: now[0], sleep=sleep,
                                   dues=dues))
    assert count == 5 and sent == [80, 160, 240, 320, 400]
    planned = [s[0] for s in sends]
    assert planned == pytest.approx([100.0, 100.08, 100.16, 100.24, 100.32])
    # frame 1 started at 100.08 and completed at 100.38, 0.22 s after slot 2: the grid restarts at 100.46
    assert sends[1][1:] == pytest.approx((100.08, 100.38))
    assert sends[2][1] == pytest.approx(100.46)
    assert sends[3][1] == pytest.approx(100.54)
    lateness = metrics.send_lateness_ms(sends)
    assert lateness[0] == 0 and lateness[2] == pytest.approx(300.0)
    # the grid in force: frames 2.. are due on the restarted grid, one restart in all
    assert dues == pytest.approx([100.0, 100.08, 100.46, 100.54, 100.62])
    assert metrics.grid_restarts(sends, dues) == 1


def test_send_paced_honours_max_frames():
    async def sleep(seconds: float) -> None:
        pass

    async def send(text: str) -> None:
        pass

    sends: list = []
    frames = InputAudio("input.wav", "0" * 64, np.zeros(10 * FRAME, np.float32)).frame_texts
    assert asyncio.run(send_paced(send, frames, start=0.0, sends=sends, sleep=sleep,
                                  clock=lambda: 0.0, max_frames=3)) == 3
    assert len(sends) == 3


# Input audio -----------------------------------------------------------------------------------

def _write_wav(path: Path, data: np.ndarray, rate: int, channels: int = 1, width: int = 2) -> Path:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(data.tobytes())
    return path


def test_wav_is_mixed_to_mono_and_resampled_linearly(tmp_path):
    ramp = np.arange(0, 16000, 16, dtype="<i2")  # 1000 samples, a straight line
    stereo = np.stack([ramp, ramp // 2], axis=1).reshape(-1)
    pcm = read_wav_float32(_write_wav(tmp_path / "s.wav", stereo, 16000, channels=2))
    assert pcm.dtype == np.float32 and pcm.size == 1500  # round(1000 * 24000 / 16000)
    mono = (ramp.astype(np.float32) + (ramp // 2).astype(np.float32)) / 2 / 32768
    assert pcm[0] == pytest.approx(mono[0]) and pcm[-1] == pytest.approx(mono[-1])
    assert np.allclose(np.diff(pcm), np.diff(pcm)[0], atol=1e-6)  # still a straight line
    assert resample_linear(np.array([0.0, 1.0], np.float32), 1, 2).tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_wav_sample_widths(tmp_path):
    eight = read_wav_float32(_write_wav(tmp_path / "u8.wav", np.array([128, 255, 0], np.uint8), 24000, width=1))
    assert eight.tolist() == pytest.approx([0.0, 127 / 128, -1.0])
    thirty_two = read_wav_float32(_write_wav(tmp_path / "i32.wav", np.array([2**30], "<i4"), 24000, width=4))
    assert thirty_two.tolist() == pytest.approx([0.5])


def test_load_input_tail_truncation_and_checksum(tmp_path):
    path = _write_wav(tmp_path / "in.wav", np.full(2400, 1000, "<i2"), 24000)
    audio = load_input(path, tail_s=0.5)
    assert audio.pcm.size == 2400 + 12000 and not audio.pcm[2400:].any()
    assert audio.frames == frame_count(14400) == 8
    assert load_input(path, tail_s=0.5, max_frames=3).pcm.size == 3 * FRAME  # truncated, never looped
    assert load_input(path, tail_s=0.0, max_frames=100).pcm.size == 2400
    assert load_input(path, tail_s=0, expected_sha256=audio.sha256.upper()).sha256 == audio.sha256
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        load_input(path, tail_s=0, expected_sha256="0" * 64)
    (tmp_path / "bad.wav").write_bytes(b"not a wav")
    with pytest.raises(ValueError, match="not a PCM WAV"):
        load_input(tmp_path / "bad.wav", tail_s=0)


# --protocol native --------------------------------------------------------------------------
def test_native_wire_url_frames_and_packet_durations():
    from orchestrator.load_driver.native_wire import chat_url, frame_messages, opus_packet_samples, page_packets

    url = chat_url("wss://h.example:9/v1/realtime?duplex=1&model=m&api_key=k", voice="NATF2.pt", persona="Be brief.")
    assert url == "wss://h.example:9/api/chat?api_key=k&text_prompt=Be+brief.&voice_prompt=NATF2.pt"
    t = np.arange(3 * 1920, dtype=np.float32) / 24000
    messages = frame_messages((0.3 * np.sin(2 * np.pi * 220 * t)).reshape(3, 1920))
    assert all(m[0] == 1 for m in messages) and b"OpusHead" in messages[0] and b"OpusHead" not in messages[1]
    last_page = messages[2][1:]
    packets = page_packets(last_page)
    assert packets and sum(opus_packet_samples(p) for p in packets) == 1920  # 80 ms, whichever sphn
    assert page_packets(last_page[:-1]) is None and page_packets(b"RIFF") is None
    # TOC: config 3 (SILK 60 ms) code 0 = one frame; config 31 (CELT 20 ms) code 3 with 4 frames.
    assert opus_packet_samples(bytes([3 << 3])) == 1440
    assert opus_packet_samples(bytes([(31 << 3) | 3, 4])) == 4 * 480
    assert opus_packet_samples(bytes([(16 << 3) | 1])) == 2 * 60  # 2.5 ms twice
    assert opus_packet_samples(b"") == 0 and opus_packet_samples(bytes([(31 << 3) | 3])) == 0


def test_native_protocol_needs_the_load_mode():
    from orchestrator.load_driver.options import Options, OptionsError

    with pytest.raises(OptionsError, match="--protocol native needs --sessions"):
        Options(model="m", input_wav=Path("x.wav"), protocol="native").validate()
    with pytest.raises(OptionsError, match="--protocol must be one of"):
        Options(model="m", input_wav=Path("x.wav"), protocol="moshi", sessions=1).validate()
    Options(model="m", input_wav=Path("x.wav"), protocol="native", sessions=1).validate()
