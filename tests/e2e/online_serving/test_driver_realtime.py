"""The load driver as a real-time instrument, against the scripted server: the stream lag and
output gap gate, frames the server fed from its own silence, and ``--processes``.

Each server behaviour fixes the answer (a delay, a dropped frame, a count of silence frames),
so every assertion is on values the script sets, not on this machine's speed; the delays are
large (hundreds of ms) against what a loaded 2-core box adds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .personaplex_realtime_duplex import EXIT_NOT_OK, EXIT_OK, main
from .scripted_server import ScriptedServer, write_tone_wav

FRAMES = 12  # input frames per session (0.96 s)


@pytest.fixture(scope="module")
def tone_wav(tmp_path_factory) -> Path:
    return write_tone_wav(tmp_path_factory.mktemp("realtime-input") / "tone.wav", 1.0)


def run_load(server: ScriptedServer, wav: Path, out: Path, sessions: int, *extra: str) -> tuple[int, dict]:
    code = main(["--model", "scripted", "--input-wav", str(wav), "--url", server.url, "--output-dir", str(out),
                 "--tail-s", "0", "--timeout-s", "20", "--cleanup-timeout-s", "2", "-q", "--sessions", str(sessions),
                 "--load-frames", str(FRAMES), *extra])
    return code, json.loads((out / "load-result.json").read_text())


# The gate --------------------------------------------------------------------------------------

def test_every_frame_500_ms_late_fails_the_lag_gate(tone_wav, tmp_path):
    with ScriptedServer(delay_s=0.5) as server:
        code, result = run_load(server, tone_wav, tmp_path, 2, "--drain-s", "1.0")
    assert code == EXIT_NOT_OK and not result["ok"] and result["passed_sessions"] == 0
    for row in result["sessions"]:
        assert row["frame_deficit"] == 0 and row["output_frames"] == FRAMES  # nothing missing: only late
        assert row["stream_lag_ms"]["p99"] > 400  # 500 ms late, less the 80 ms frame
        assert row["error"].startswith("stream_lag_ms p99") and "--max-stream-lag-ms 250" in row["error"]
        assert row["holds_real_time"] is False
    assert result["stream_lag_ms"]["median"] > 400 and result["holding_sessions"] == 0


def test_a_prompt_server_passes_and_holds(tone_wav, tmp_path):
    with ScriptedServer() as server:
        code, result = run_load(server, tone_wav, tmp_path, 2, "--drain-s", "0.4")
    assert code == EXIT_OK and result["ok"]
    for row in result["sessions"]:
        assert row["stream_lag_ms"]["p99"] < 100 and row["max_output_gap_ms"] < 200
        assert row["holds_real_time"] is True
    assert result["holding_sessions"] == 2 and result["processes"] == 1


def test_the_gate_limit_is_a_flag(tone_wav, tmp_path):
    with ScriptedServer(delay_s=0.5) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, "--drain-s", "1.0", "--max-stream-lag-ms", "900")
    assert code == EXIT_OK and result["max_stream_lag_ms"] == 900
    assert result["sessions"][0]["holds_real_time"] is False  # passes the gate, does not hold real time


def test_a_long_gap_between_output_packets_fails(tone_wav, tmp_path):
    # Eight frames a delta: a packet every 640 ms, and frames held up to 560 ms (the lag gate is
    # widened so that the gap is what fails).
    with ScriptedServer(frames_per_delta=8) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, "--drain-s", "0.5", "--max-stream-lag-ms", "2000",
                                "--max-frame-deficit", "8")
    row = result["sessions"][0]
    assert code == EXIT_NOT_OK
    assert row["max_output_gap_ms"] > 500 and row["error"].startswith("max_output_gap_ms")


# Frames the server fed from its own silence ----------------------------------------------------

@pytest.mark.parametrize("report, source", [(True, "metadata"), (False, "timing")])
def test_silence_fed_after_the_input_ends_is_not_a_deficit(tone_wav, tmp_path, report, source):
    with ScriptedServer(silence_frames=5, silence_grace_s=0.2, report_silence=report) as server:
        code, result = run_load(server, tone_wav, tmp_path, 2, "--drain-s", "1.2")
    assert code == EXIT_OK, [row["error"] for row in result["sessions"]]
    for row in result["sessions"]:
        assert row["output_frames"] == FRAMES + 5
        assert row["server_fed_frames"] == 5 and row["server_fed_frames_source"] == source
        assert row["frame_deficit"] == 0 and row["frame_coverage_ratio"] == 1.0


def test_a_missing_frame_is_a_deficit_even_when_silence_makes_up_the_count(tone_wav, tmp_path):
    # Frame 3 is never answered, one silence frame follows the input: as many frames out as in,
    # which a count alone would pass.
    with ScriptedServer(drop_frames=frozenset({3}), silence_frames=1, silence_grace_s=0.2) as server:
        code, result = run_load(server, tone_wav, tmp_path, 1, "--drain-s", "0.8", "--max-frame-deficit", "0")
    row = result["sessions"][0]
    assert row["output_frames"] == FRAMES and row["server_fed_frames"] == 1
    assert row["frame_deficit"] == 1
    assert code == EXIT_NOT_OK and row["acceptance_check"] == "frame_deficit"


# Several driver processes ------------------------------------------------------------------------

def _keys(value):
    """The shape of a JSON value: key sets of objects, recursively (the first element of a list
    of objects; a list of plain values is just a list, whatever it holds)."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value and isinstance(value[0], (dict, list)) else "list"
    return None


def test_four_processes_merge_into_the_one_process_schema(tone_wav, tmp_path):
    with ScriptedServer(capacity=16) as server:
        one_code, one = run_load(server, tone_wav, tmp_path / "one", 8, "--drain-s", "0.4", "--processes", "1")
        four_code, four = run_load(server, tone_wav, tmp_path / "four", 8, "--drain-s", "0.4", "--processes", "4")
    assert one_code == EXIT_OK and four_code == EXIT_OK
    assert _keys(one) == _keys(four)
    assert one["processes"] == 1 and four["processes"] == 4
    assert [row["index"] for row in four["sessions"]] == list(range(8))
    assert [row["worker"] for row in four["sessions"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({row["session_id"] for row in four["sessions"]}) == 8
    # one shared start: every session's frame 0 was planned for the same instant
    starts = {row["input_timeline"][0]["planned_at_s"] for row in four["sessions"]}
    assert len(starts) == 1
    assert four["passed_sessions"] == 8 and four["holding_sessions"] == 8


def test_start_spread_puts_sessions_at_different_phases(tone_wav, tmp_path):
    with ScriptedServer(capacity=8) as server:
        code, result = run_load(server, tone_wav, tmp_path, 4, "--drain-s", "0.4", "--processes", "2",
                                "--start-spread-ms", "80")
    assert code == EXIT_OK and result["start_spread_ms"] == 80
    starts = [row["input_timeline"][0]["planned_at_s"] for row in result["sessions"]]
    offsets = [(start - starts[0]) * 1000.0 for start in starts]
    # golden-ratio steps over 80 ms: 0, 49.4, 18.9, 68.3 ms after the shared start
    assert offsets == pytest.approx([0.0, 49.44, 18.89, 68.33], abs=0.05)


def test_sessions_a_full_server_refuses_are_failed_rows_in_their_process(tone_wav, tmp_path):
    with ScriptedServer(capacity=3) as server:
        code, result = run_load(server, tone_wav, tmp_path, 4, "--drain-s", "0.4", "--processes", "2")
    assert code == EXIT_NOT_OK and result["passed_sessions"] == 3
    refused = [row for row in result["sessions"] if not row["ok"]]
    assert len(refused) == 1 and refused[0]["error"].startswith("admission:")
    assert refused[0]["output_frames"] is None and refused[0]["stream_lag_ms"]["count"] == 0


# The package ------------------------------------------------------------------------------------

def test_reread_of_a_result_gives_its_own_figures(tone_wav, tmp_path, capsys):
    from orchestrator.load_driver import reread

    with ScriptedServer(delay_s=0.2) as server:
        _, result = run_load(server, tone_wav, tmp_path, 2, "--drain-s", "0.6")
    path = tmp_path / "load-result.json"
    figures = reread.reread(reread.read_result(path))
    for row, again in zip(result["sessions"], figures["sessions"]):
        assert again["stream_lag_ms"] == row["stream_lag_ms"] and again["max_output_gap_ms"] == row["max_output_gap_ms"]
        assert again["holds_real_time"] == row["holds_real_time"] is False  # 200 ms late: passes, does not hold
    assert figures["stream_lag_ms"] == result["stream_lag_ms"] and figures["holding_sessions"] == 0
    assert reread.main([str(path)]) == 0
    assert "0 of 2 sessions hold real time" in capsys.readouterr().out
    assert reread.main([str(tmp_path / "absent.json")]) == 2


def test_the_driver_imports_without_the_server_stack():
    # The load driver is a client: it must install and run without Quart, hypercorn or torch.
    code = ("import sys; import orchestrator.load_driver.cli, orchestrator.load_driver.processes, "
            "orchestrator.load_driver.reread, orchestrator.load_driver.plot; "
            "loaded = {'quart', 'hypercorn', 'torch'} & set(sys.modules); assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    helped = subprocess.run([sys.executable, "-m", "orchestrator.load_driver", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "--processes" in helped.stdout and "--max-stream-lag-ms" in helped.stdout
