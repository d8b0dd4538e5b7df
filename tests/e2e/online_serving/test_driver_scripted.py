"""The driver against a scripted server whose answers the tests control.

Every assertion is on values the script fixes (frame counts, codes, ids, which check fails),
never on how fast this machine is; the runs are real-time paced but a few frames long.
"""

from __future__ import annotations

import base64
import json
import wave
from pathlib import Path

import numpy as np
import pytest

from .personaplex_realtime_duplex import EXIT_NOT_OK, EXIT_OK, EXIT_USAGE, main
from orchestrator.load_driver import report
from .scripted_server import CAPABILITIES, FRAME, ScriptedServer, write_tone_wav

FRAMES = 6  # input frames per load session in these tests (0.48 s)
TOP_LEVEL_FIELDS = {
    "schema_version", "mode", "model", "requested_sessions", "passed_sessions", "ok", "input", "frame_period_s",
    "drain_s", "cleanup_timeout_s", "client_pacing_warning_threshold_ms", "client_pacing_warning_sessions",
    "max_client_rtf", "max_stream_rtf", "max_lag_drift_ms", "acceptance", "shared_response_ids", "sessions",
    "reported_server", "measurement_origin", "interval_definition", "stream_timing_definition",
    # added by this driver (the reference's fields above are unchanged)
    "processes", "start_spread_ms", "client_bottleneck_threshold_ms", "max_stream_lag_ms", "max_gap_ms", "hold_stream_lag_p99_ms",
    "hold_max_gap_ms", "stream_lag_ms", "max_output_gap_ms", "client_send_lateness_ms", "client_bottleneck",
    "holding_sessions", "stream_lag_definition", "server_fed_definition", "protocol"}
ROW_FIELDS = {
    "index", "session_id", "ok", "error", "acceptance_check", "server_error_count", "server_error_codes",
    "protocol_violations", "input_frames", "output_samples", "frame_deficit", "response_ids",
    "client_first_audio_after_stream_start_ms", "client_first_text_after_stream_start_ms", "client_stream_rtf",
    "client_audio_packet_interval_ms", "client_send_lateness_ms", "client_pacing_warning", "audio_underrun_s",
    "audio_underrun_event_count", "audio_continuity_ok", "server_stream_rtf", "stream_lag_drift_ms", "stream_lag_ms",
    "playout_stall_ms", "playout_stalled", "steady_playout_stall_ms", "steady_playout_stalled", "output_frames",
    "voiced_frames", "silent_frames", "frame_coverage_ratio", "audio_rms", "audio_chunks", "audio_samples",
    "scheduler_data_plane", "input_timeline", "audio_packet_timeline", "invalid_audio_packets",
    # added by this driver
    "worker", "max_output_gap_ms", "holds_real_time", "client_grid_restarts", "server_fed_frames", "server_fed_frames_source"}


@pytest.fixture(scope="module")
def tone_wav(tmp_path_factory) -> Path:
    """0.4 s of a 24 kHz tone (with the default test tail of 0.2 s: 8 frames)."""
    return write_tone_wav(tmp_path_factory.mktemp("driver-input") / "tone.wav", 0.4)


def run_cli(server: ScriptedServer, wav: Path, out: Path, *extra: str) -> int:
    return main(["--model", "scripted", "--input-wav", str(wav), "--url", server.url, "--output-dir", str(out),
                 "--tail-s", "0.2", "--drain-s", "0.3", "--timeout-s", "20", "--cleanup-timeout-s", "1", "-q",
                 *extra])


def run_load(server: ScriptedServer, wav: Path, out: Path, sessions: int, *extra: str,
             frames: int = FRAMES) -> tuple[int, dict]:
    code = run_cli(server, wav, out, "--sessions", str(sessions), "--load-frames", str(frames), *extra)
    return code, json.loads((out / "load-result.json").read_text())


# Load mode -------------------------------------------------------------------------------------

def test_load_two_clean_sessions(tone_wav, tmp_path):
    with ScriptedServer() as server:
        code, result = run_load(server, tone_wav, tmp_path, 2, "--server-revision", "abc123",
                                "--server-hardware", "scripted")
    assert code == EXIT_OK
    assert set(result) == TOP_LEVEL_FIELDS
    assert result["ok"] is True and result["passed_sessions"] == 2 and result["requested_sessions"] == 2
    assert result["mode"] == "paced_multi_session" and result["schema_version"] == 1
    assert result["protocol"] == "realtime"
    assert result["input"]["load_frames"] == FRAMES and result["input"]["tail_s"] == 0.2
    assert result["reported_server"] == {"revision": "abc123", "hardware": "scripted"}
    assert result["shared_response_ids"] == [] and result["acceptance"]["require_scheduler_data_plane"] is False
    ids = {log.session_id for log in server.sessions}
    for row in result["sessions"]:
        assert set(row) == ROW_FIELDS
        assert row["ok"] is True and row["error"] is None and row["acceptance_check"] is None
        assert row["session_id"] in ids  # the server's id, not the label
        assert (row["input_frames"], row["output_frames"], row["frame_deficit"]) == (FRAMES, FRAMES, 0)
        assert row["output_samples"] == row["audio_samples"] == FRAMES * FRAME
        assert row["audio_chunks"] == FRAMES and row["voiced_frames"] == FRAMES and row["silent_frames"] == 0
        assert row["frame_coverage_ratio"] == 1.0
        assert row["audio_rms"] == pytest.approx(0.1 / np.sqrt(2), rel=1e-3)  # the script's tone
        assert len(row["response_ids"]) == 1
        assert row["scheduler_data_plane"] is False  # reported, not required
        assert row["client_audio_packet_interval_ms"]["count"] == FRAMES - 1
        assert row["client_send_lateness_ms"]["count"] == FRAMES
        assert row["stream_lag_ms"]["count"] == FRAMES
        assert row["client_first_audio_after_stream_start_ms"] >= 0
        assert row["client_first_text_after_stream_start_ms"] >= row["client_first_audio_after_stream_start_ms"]
        assert row["client_stream_rtf"] is not None and row["server_stream_rtf"] is not None
        assert [f["frame_index"] for f in row["input_timeline"]] == list(range(FRAMES))
        planned = [f["planned_at_s"] for f in row["input_timeline"]]
        assert np.allclose(np.diff(planned), 0.08)
        assert [p["samples"] for p in row["audio_packet_timeline"]] == [FRAME] * FRAMES
        assert row["invalid_audio_packets"] == [] and row["protocol_violations"] == []
    # one shared start: every session planned its first frame at the same instant
    assert len({row["input_timeline"][0]["planned_at_s"] for row in result["sessions"]}) == 1
    assert result["sessions"][0]["response_ids"] != result["sessions"][1]["response_ids"]


def test_load_sends_the_reference_events(tone_wav, tmp_path):
    with ScriptedServer() as server:
        code, _ = run_load(server, tone_wav, tmp_path, 1)
    assert code == EXIT_OK
    (log,) = server.sessions
    query = dict(part.split("=", 1) for part in log.path.split("?", 1)[1].split("&"))
    assert query == {"duplex": "1", "model": "scripted", "autostart": "0"}
    update = log.received[0]
    assert update["type"] == "session.update"
    assert update["session"]["input_audio_format"] == "pcm_f32le" and update["session"]["turn_detection"] is None
    appends = [e for e in log.received if e["type"] == "input_audio_buffer.append"]
    assert len(appends) == FRAMES
    for i, event in enumerate(appends):
        assert set(event) == {"type", "audio", "format", "sample_rate_hz", "duration_ms", "audio_end_ms", "is_speech"}
        assert (event["format"], event["sample_rate_hz"], event["duration_ms"]) == ("pcm_f32le", 24000, 80)
        assert event["audio_end_ms"] == (i + 1) * 80
        assert event["is_speech"] is (i < 5)  # 0.4 s of tone, then the silent tail
        assert len(base64.b64decode(event["audio"])) == FRAME * 4
    assert log.received[-1] == {"type": "session.close"}


def test_load_refused_session_is_a_failed_row_with_nulls(tone_wav, tmp_path):
    with ScriptedServer(capacity=1) as server:
        code, result = run_load(server, tone_wav, tmp_path, 2)
    assert code == EXIT_NOT_OK and server.refused == 1
    assert result["ok"] is False and result["passed_sessions"] == 1 and len(result["sessions"]) == 2
    refused = next(row for row in result["sessions"] if not row["ok"])
    admitted = next(row for row in result["sessions"] if row["ok"])
    assert admitted["frame_deficit"] == 0
    assert refused["error"] == "admission: ServerErrorEvent"
    assert refused["server_error_codes"] == ["resource_exhausted"] and refused["server_error_count"] == 1
    assert refused["session_id"] == f"personaplex-load-{refused['index']}"
    assert refused["input_frames"] == 0 and refused["input_timeline"] == []
    for key in ("client_first_audio_after_stream_start_ms", "client_stream_rtf", "server_stream_rtf",
                "audio_underrun_s", "playout_stall_ms", "client_pacing_warning", "frame_deficit", "output_frames",
                "voiced_frames", "audio_rms", "frame_coverage_ratio", "audio_chunks"):
        assert refused[key] is None, key  # missing, never 0
    assert refused["client_audio_packet_interval_ms"] == {"count": 0, "median": None, "p99": None, "max": None,
                                                          "argmax_index": None}


def test_load_malformed_packets_are_reported_with_codes(tone_wav, tmp_path):
    broken = {1: "bad_base64", 2: "odd_bytes", 3: "wrong_rate", 4: "no_response_id", 5: "no_delta"}
    with ScriptedServer(corrupt=broken) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, frames=8)
    (row,) = result["sessions"]
    assert code == EXIT_NOT_OK and row["ok"] is False
    assert row["acceptance_check"] == "audio_packets"
    assert [p["code"] for p in row["invalid_audio_packets"]] == [
        "invalid_audio_base64", "unaligned_pcm16_packet", "invalid_audio_sample_rate", "missing_audio_response_id",
        "missing_audio_delta"]
    assert row["output_samples"] == 3 * FRAME  # only deltas 0, 6 and 7 carried valid audio
    assert row["protocol_violations"] == []
    text = (tmp_path / "load-result.json").read_text()
    assert "!!!!" not in text  # no wire payload is exported


def test_load_legacy_event_and_five_frame_chunks(tone_wav, tmp_path):
    with ScriptedServer(audio_event="response.audio.delta", frames_per_delta=5) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, frames=7)
    (row,) = result["sessions"]
    # deltas of 1 and 5 frames; the 7th frame is still pending in the next chunk
    assert [p["samples"] for p in row["audio_packet_timeline"]] == [FRAME, 5 * FRAME]
    assert (row["output_frames"], row["frame_deficit"], row["audio_chunks"]) == (6, 1, 2)
    assert code == EXIT_OK and row["ok"] is True


def test_load_shared_response_ids_fail_both_sessions(tone_wav, tmp_path):
    with ScriptedServer(shared_response_id="resp_shared") as server:
        code, result = run_load(server, tone_wav, tmp_path, 2)
    assert code == EXIT_NOT_OK and result["shared_response_ids"] == ["resp_shared"]
    for row in result["sessions"]:
        assert row["ok"] is False and "concurrent sessions shared a response id" in row["error"]
        assert row["acceptance_check"] is None  # each session on its own passed


def test_load_second_response_fails_identity(tone_wav, tmp_path):
    with ScriptedServer(new_response_at_delta=3) as server:
        _, result = run_load(server, tone_wav, tmp_path, 1)
    (row,) = result["sessions"]
    assert row["acceptance_check"] == "response_identity" and len(row["response_ids"]) == 2
    assert row["error"].startswith("drain: AcceptanceError: response_identity")


def test_load_missing_audio(tone_wav, tmp_path):
    with ScriptedServer(send_audio=False) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1)
    (row,) = result["sessions"]
    assert code == EXIT_NOT_OK and row["acceptance_check"] == "pcm16_output"
    assert row["output_samples"] == 0 and row["audio_packet_timeline"] == []
    for key in ("client_first_audio_after_stream_start_ms", "client_stream_rtf", "server_stream_rtf",
                "audio_underrun_s", "audio_continuity_ok", "playout_stall_ms", "audio_rms"):
        assert row[key] is None, key
    assert (row["output_frames"], row["frame_deficit"]) == (0, FRAMES)  # counted, not missing


def test_load_slow_close_is_bounded_by_the_cleanup_budget(tone_wav, tmp_path):
    with ScriptedServer(close_delay_s=30.0) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, "--cleanup-timeout-s", "0.5")
    (row,) = result["sessions"]
    assert code == EXIT_NOT_OK and row["ok"] is False
    assert row["error"] == "cleanup: TimeoutError" and row["acceptance_check"] is None
    assert result["cleanup_timeout_s"] == 0.5


def test_load_server_error_stops_the_session(tone_wav, tmp_path):
    with ScriptedServer(error_at_frame=1) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1)
    (row,) = result["sessions"]
    assert code == EXIT_NOT_OK
    assert row["error"] in ("stream: ServerErrorEvent", "drain: ServerErrorEvent")
    assert row["server_error_codes"] == ["engine_error"] and row["server_error_count"] == 1


def test_load_binary_frame_is_a_protocol_violation(tone_wav, tmp_path):
    with ScriptedServer(binary_at_frame=1) as server:
        _, result = run_load(server, tone_wav, tmp_path, 1)
    (row,) = result["sessions"]
    assert row["ok"] is False and row["protocol_violations"] == ["binary_frame"]
    assert row["error"] in ("stream: ProtocolViolation", "drain: ProtocolViolation")


@pytest.mark.parametrize("metadata, require, check", [
    (False, False, None),  # our server: reported as false, not a failure
    (False, True, "scheduler_data_plane"),
    (True, True, None),  # a vLLM-Omni server proves its data plane
])
def test_scheduler_data_plane_is_configurable(tone_wav, tmp_path, metadata, require, check):
    flags = ("--require-scheduler-data-plane",) if require else ()
    with ScriptedServer(vllm_omni_metadata=metadata) as server:
        _, result = run_load(server, tone_wav, tmp_path, 1, *flags)
    (row,) = result["sessions"]
    assert row["scheduler_data_plane"] is metadata and row["acceptance_check"] == check
    assert result["acceptance"]["require_scheduler_data_plane"] is require


def test_delta_of_another_session_fails_session_identity(tone_wav, tmp_path):
    with ScriptedServer(foreign_metadata_session=True) as server:
        _, result = run_load(server, tone_wav, tmp_path, 1)
    assert result["sessions"][0]["acceptance_check"] == "session_identity"


def test_rtf_cap_fails_a_session(tone_wav, tmp_path):
    # Output arrives right after each send, so the client RTF is well above 0.01.
    with ScriptedServer() as server:
        _, result = run_load(server, tone_wav, tmp_path, 1, "--max-client-rtf", "0.01")
    (row,) = result["sessions"]
    assert row["ok"] is False and row["error"] == "client_stream_rtf exceeds 0.01"
    assert result["max_client_rtf"] == 0.01


def test_capabilities_without_multi_session_are_refused(tone_wav, tmp_path):
    with ScriptedServer(capabilities={"chunk_period_ms": 80, "supports_multi_session_same_replica": False}) as server:
        _, result = run_load(server, tone_wav, tmp_path, 1)
    (row,) = result["sessions"]
    assert row["error"] == "admission: CapabilityMismatch" and row["input_frames"] == 0
    assert server.sessions[0].received[-1] == {"type": "session.close"}  # closed politely anyway


def test_api_key_is_sent_but_never_exported(tone_wav, tmp_path, monkeypatch):
    secret = "sk-test-do-not-export-1234"
    monkeypatch.setenv("DRIVER_TEST_KEY", secret)
    with ScriptedServer() as server:
        code, _ = run_load(server, tone_wav, tmp_path, 1, "--api-key-env", "DRIVER_TEST_KEY")
    assert code == EXIT_OK
    assert server.sessions[0].headers.get("authorization") == f"Bearer {secret}"
    assert secret not in (tmp_path / "load-result.json").read_text()


def test_load_refuses_to_overwrite_a_result(tone_wav, tmp_path):
    (tmp_path / "load-result.json").write_text("previous evidence")
    with ScriptedServer() as server:
        code = run_cli(server, tone_wav, tmp_path, "--sessions", "1", "--load-frames", "2")
    assert code == EXIT_USAGE and server.sessions == []  # checked before any session opened
    assert (tmp_path / "load-result.json").read_text() == "previous evidence"
    # and the writer itself opens with mode "x"
    with pytest.raises(FileExistsError):
        report.write_json(tmp_path / "load-result.json", {"ok": True}, exclusive=True)


def test_plot_is_written(tone_wav, tmp_path):
    pytest.importorskip("matplotlib")
    with ScriptedServer() as server:
        code, _ = run_load(server, tone_wav, tmp_path, 2, "--plot")
    assert code == EXIT_OK
    assert (tmp_path / "load-timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Lifecycle mode --------------------------------------------------------------------------------

def test_lifecycle_passes_and_writes_its_files(tone_wav, tmp_path):
    with ScriptedServer(capacity=2) as server:
        code = run_cli(server, tone_wav, tmp_path, "--replacement-frames", "5")
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == EXIT_OK and result["ok"] is True and result["failure"] is None
    assert result["overflow_error_code"] == "resource_exhausted" and server.refused == 1
    assert result["capabilities"]["chunk_period_ms"] == 80
    ids = [result[name]["session_id"] for name in ("primary", "secondary", "replacement")]
    assert len(set(ids)) == 3
    assert result["primary"]["input_frames"] == 8  # 0.4 s + 0.2 s tail
    assert result["secondary"]["input_frames"] == 8 + 5
    assert result["secondary"]["continuation_frames_after_recycle"] == 5
    assert result["replacement"]["input_frames"] == 5 and result["replacement"]["frame_deficit"] == 0
    assert result["secondary"]["response_ids"] != result["replacement"]["response_ids"]
    personas = [log.received[0]["session"]["instructions"] for log in server.sessions]
    assert len(set(personas)) == 3  # primary, secondary and replacement personas differ
    for name in ("primary", "secondary", "replacement"):
        events = (tmp_path / f"{name}-events.jsonl").read_text().splitlines()
        assert json.loads(events[0])["type"] == "session.created"
        with wave.open(str(tmp_path / f"{name}-output.wav")) as wav:
            assert wav.getframerate() == 24000 and wav.getnframes() == result[name]["output_frames"] * FRAME


def test_lifecycle_fails_when_the_limit_is_not_enforced(tone_wav, tmp_path):
    with ScriptedServer(capacity=3) as server:
        code = run_cli(server, tone_wav, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == EXIT_NOT_OK and result["ok"] is False
    assert result["failure"]["step"] == "admission" and result["failure"]["check"] == "admission"
    assert result["primary"] is None  # never streamed
    assert (tmp_path / "primary-events.jsonl").exists()  # what was received is still saved


def test_lifecycle_with_a_larger_admission_limit(tone_wav, tmp_path):
    with ScriptedServer(capacity=3) as server:
        code = run_cli(server, tone_wav, tmp_path, "--admission-limit", "3", "--replacement-frames", "5")
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == EXIT_OK and result["overflow_error_code"] == "resource_exhausted"
    assert len(server.sessions) == 4  # primary, secondary, one filler, replacement


def test_lifecycle_takes_the_admission_limit_the_server_advertises(tone_wav, tmp_path):
    """Without --admission-limit the check uses the capabilities' max_sessions (personaplex-
    serve advertises it): a 3-slot server passes, with one filler session."""
    caps = dict(CAPABILITIES, max_sessions=3)
    with ScriptedServer(capacity=3, capabilities=caps) as server:
        code = run_cli(server, tone_wav, tmp_path, "--replacement-frames", "5")
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == EXIT_OK and result["admission_limit"] == 3, result.get("failure")
    assert len(server.sessions) == 4  # primary, secondary, one filler, replacement


def test_lifecycle_reports_a_server_error(tone_wav, tmp_path):
    with ScriptedServer(capacity=2, error_at_frame=2) as server:
        code = run_cli(server, tone_wav, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == EXIT_NOT_OK and result["failure"]["step"] == "stream"
    assert "ServerErrorEvent" in result["failure"]["message"]
    codes = {e["error"]["code"] for e in result["errors"]}
    assert codes == {"engine_error"}


# Command line ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ["--sessions", "0"], ["--sessions", "1025"], ["--load-frames", "0"], ["--drain-s", "nan"], ["--tail-s", "-1"],
    ["--timeout-s", "0"], ["--cleanup-timeout-s", "inf"], ["--max-stream-rtf", "0"], ["--max-lag-drift-ms", "-1"],
    ["--min-voiced-frames", "0"], ["--admission-limit", "1"], ["--api-key-env", "DRIVER_TEST_UNSET_VARIABLE"],
    ["--url", "http://127.0.0.1:8000/v1/realtime"], ["--processes", "0", "--sessions", "4"],
    ["--processes", "5", "--sessions", "4"], ["--processes", "2"], ["--processes", "two", "--sessions", "4"],
    ["--max-stream-lag-ms", "0"], ["--max-gap-ms", "-5"], ["--max-gap-ms", "nan"], ["--start-spread-ms", "81"],
    ["--start-spread-ms", "-1"],
])
def test_cli_rejects_bad_flags(tone_wav, tmp_path, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--input-wav", str(tone_wav), "--output-dir", str(tmp_path), *flags])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert flags[0] in err
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage dump
    assert not (tmp_path / "load-result.json").exists()


def test_cli_help_explains_the_data_plane_check(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--require-scheduler-data-plane" in text and "only reports" in text
    for flag in ("--sessions", "--load-frames", "--drain-s", "--cleanup-timeout-s", "--plot", "--server-revision",
                 "--server-hardware", "--max-client-rtf", "--max-stream-rtf", "--max-lag-drift-ms", "--tail-s"):
        assert flag in text
