"""The capacity tool (tests/e2e/online_serving/capacity.py): argument checks, and one real run
of two layouts (one server process; one process per device) with the tiny demo model on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.online_serving import capacity

REPO = Path(__file__).resolve().parents[1]


def _tool(args: list[str], **env: str) -> subprocess.CompletedProcess:
    # The servers inherit the environment: no checkpoint (the tiny demo model), and one intra-op
    # thread, as for the soak (torch's default of one per core makes ticks slow on a busy box).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PERSONAPLEX_") or k == "PERSONAPLEX_CACHE_DIR"}
    return subprocess.run([sys.executable, "-m", "tests.e2e.online_serving.capacity", *args], check=False,
                          cwd=REPO,
                          env={**clean, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=240)


def test_two_layouts_end_to_end(speech_wav: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _tool(["--layout", "process:cpu", "--layout", "split:cpu,cpu", "--sessions-per-device", "2",
                  "--load-frames", "25", "--driver-processes", "2", "--input-wav", str(speech_wav),
                  "--output-dir", str(out),
                  # the tool is under test, not this 2-core box's speed: the drivers' real-time gate is opened wide
                  "--driver-args", "--max-stream-lag-ms 60000 --max-gap-ms 60000"])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "capacity.json").read_text())
    assert report["complete"] is True and report["command"] and report["date_utc"] and report["hostname"]
    assert [r["layout"] for r in report["layouts"]] == ["process:cpu", "split:cpu,cpu"]
    single, split = report["layouts"]
    assert (single["servers"], split["servers"]) == (1, 2)
    assert (single["sessions_requested"], split["sessions_requested"]) == (2, 4)
    for layout in (single, split):
        assert layout["ok"] is True and layout["errors"] == []
        assert layout["sessions_admitted"] == layout["sessions_ok"] == layout["sessions_requested"]
        assert layout["startup_s"] > 0
        ticks = layout["ticks"]
        assert ticks["ticks"] >= 25 and ticks["mean_tick_ms"] > 0 and ticks["mean_batch_size"] > 0
        assert 0 < ticks["ticks_le_80ms_fraction"] <= 1
        assert layout["ticks_per_device"] and all(d["ticks"] > 0 for d in layout["ticks_per_device"])
        assert layout["sessions"]["first_audio_ms"][1] > 0
        assert layout["sessions"]["frame_deficit"][1] <= 4
        sessions = layout["sessions"]
        assert sessions["stream_lag_p50_ms"] is not None and sessions["stream_lag_p99_ms"] >= sessions["stream_lag_p50_ms"]
        assert sessions["max_output_gap_ms"] > 0 and sessions["client_send_lateness_p99_ms"] is not None
        assert 0 <= sessions["holding_sessions"] <= layout["sessions_requested"]
        assert all(d["processes"] == 2 for d in layout["drivers"])  # --driver-processes reached the drivers
    assert {d["server"] for d in split["ticks_per_device"]} == {0, 1}
    assert len(split["drivers"]) == 2
    assert "process:cpu" in done.stdout and "split:cpu,cpu" in done.stdout and "OK;" in done.stdout
    assert list(out.glob("*/server-*.log")) and list(out.glob("*/driver-*/load-result.json"))

    # A second run into the same directory refuses before starting anything.
    again = _tool(["--layout", "process:cpu", "--sessions-per-device", "2", "--input-wav", str(speech_wav),
                   "--output-dir", str(out)])
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.parametrize("layout, message", [
    ("cpu", "expected process:DEVICES"),
    ("gpu:0", "expected process:DEVICES"),
    ("split:", "expected process:DEVICES"),
    ("process:0,0", "twice"),
    ("split:0,cuda:0", "twice"),
    ("process:all", "list the devices"),
    ("process:x", "not a device"),
])
def test_bad_layouts(layout: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wav = tmp_path / "in.wav"
    wav.write_bytes(b"")
    assert capacity.main(["--layout", layout, "--sessions-per-device", "2", "--input-wav", str(wav),
                          "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--sessions-per-device", "0"], "--sessions-per-device must be >= 1"),
    (["--sessions-per-device", "1"], "multi-session"),
    (["--sessions-per-device", "2", "--load-frames", "0"], "--load-frames must be >= 1"),
    (["--sessions-per-device", "2", "--driver-processes", "0"], "--driver-processes must be in [1, 256]"),
    (["--sessions-per-device", "2000"], "the load driver's limit"),
    (["--sessions-per-device", "2", "--tail-s", "-1"], "--tail-s must be finite"),
])
def test_bad_numbers(extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wav = tmp_path / "in.wav"
    wav.write_bytes(b"")
    assert capacity.main(["--layout", "process:0", "--input-wav", str(wav), "--output-dir", str(tmp_path),
                          *extra]) == 2
    assert message in capsys.readouterr().err


def test_missing_wav_and_existing_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--layout", "split:0,1", "--sessions-per-device", "4", "--output-dir", str(tmp_path)]
    assert capacity.main([*common, "--input-wav", str(tmp_path / "absent.wav")]) == 2
    assert "no such file" in capsys.readouterr().err
    wav = tmp_path / "in.wav"
    wav.write_bytes(b"")
    (tmp_path / "capacity.json").write_text("{}")
    assert capacity.main([*common, "--input-wav", str(wav)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "capacity.json").read_text() == "{}"


def test_tick_stats_from_histogram_deltas() -> None:
    def scrape(count: int, total: float, le60: int, le80: int, batch: float) -> capacity.Samples:
        lines = [f'personaplex_device_tick_duration_seconds_bucket{{device="cuda:0",le="0.06"}} {le60}',
                 f'personaplex_device_tick_duration_seconds_bucket{{device="cuda:0",le="0.08"}} {le80}',
                 f'personaplex_device_tick_duration_seconds_sum{{device="cuda:0"}} {total}',
                 f'personaplex_device_tick_duration_seconds_count{{device="cuda:0"}} {count}',
                 f'personaplex_device_batch_size_sum{{device="cuda:0"}} {batch}',
                 "# HELP personaplex_ticks_total Lockstep ticks run."]
        return capacity.parse_metrics("\n".join(lines))

    stats = capacity.tick_stats(scrape(10, 0.5, 10, 10, 10), scrape(110, 6.5, 60, 90, 6410),
                                "personaplex_device", "cuda:0")
    assert stats["ticks"] == 100
    assert stats["mean_tick_ms"] == pytest.approx(60.0)
    assert stats["mean_batch_size"] == pytest.approx(64.0)
    assert stats["ticks_le_60ms_fraction"] == pytest.approx(0.5)
    assert stats["ticks_le_80ms_fraction"] == pytest.approx(0.8)
    merged = capacity.merge_tick_stats([stats, {**stats, "ticks": 300, "mean_tick_ms": 20.0}])
    assert merged["ticks"] == 400 and merged["mean_tick_ms"] == pytest.approx(30.0)


def test_frontend_cost_reads_thread_cpu_by_role() -> None:
    import time as _time

    from tests.e2e.online_serving import frontend_cost

    before = frontend_cost.thread_cpu_s(os.getpid())
    start = _time.thread_time()
    while _time.thread_time() - start < 0.3:  # 0.3 s of CPU on this, the main, thread
        pass
    after = frontend_cost.thread_cpu_s(os.getpid())
    assert set(after) == {"loop", "engine", "other"}
    assert 0.25 <= after["loop"] - before["loop"] <= 1.0  # /proc counts in clock ticks (10 ms)
