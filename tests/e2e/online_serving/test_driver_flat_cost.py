"""One driver process keeps its grid for 3000 frames per session (a full attention window):
the cost of a frame must not grow with the stream.

The sessions run four times as fast as real time (a 20 ms grid): 32 sessions send their
frames in bursts of 32, each 3000 frames long, so a per-frame cost that grows with the frames
a session has seen lengthens every burst as it would in real time; the run takes 60 s
instead of 240, at the frame rate of 64 real-time sessions (~1 of the machine's 2 cores, with
the server).  (Until 2026-12-05: 64 sessions on a 40 ms grid, 120 s of CI's 20 minutes.  The
driver that re-scanned its events cost ~200 ms a burst of 64 at frame 3000: half of that for
32 is still five periods of 20 ms.)

An earlier driver re-scanned every event received so far before each send; its send lateness
p99 went from 6 ms over the first 150 frames to 36 ms at frame 1500 and ~200 ms at frame 3000.
The test asserts the *slope* of lateness over the stream and compares its end with its
start, never an absolute speed: a slow machine shifts both ends alike.  Lateness is taken
against the grid in force (``due_at_s``): after a stall of over a frame the grid restarts
instead of bursting, which leaves every later frame late against the *original* plan by the
stall; a stall (a co-tenant taking the CPU) is not a cost that grows with the stream.  The scripted server
runs in its own process, so it does not share the driver's interpreter.

The gates that judge the server (stream lag, output gap, frame deficit) are opened wide: here
they would judge the machine instead.  A shared CI machine once stalled both processes for
~1.5 s, so every session's longest output gap read ~1,480 ms against the 500 ms default; beside
two busy processes the scripted server fell 280-309 frames behind the 64 x 3000 frames, so the
half-second drain ended with those unanswered; the send lateness slope, what this test is
about, was untouched either time.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.load_driver import load, pacing
from orchestrator.load_driver.metrics import least_squares_slope

from .personaplex_realtime_duplex import main
from .scripted_server import write_tone_wav

SESSIONS = 32
FRAMES = 3000
PERIOD_S = 0.02  # four times real time
EDGE = 300  # frames compared at the start and the end of the stream
UNGATED_MS = 60_000  # the lag and gap gates, out of the way (see the module's docstring)
UNGATED_DEFICIT = FRAMES  # and the frame deficit's
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def scripted_server_process():
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.online_serving.scripted_server",
                             json.dumps({"capacity": SESSIONS})], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), line
        yield f"ws://127.0.0.1:{int(line.split()[1])}/v1/realtime?duplex=1"
    finally:
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_send_lateness_stays_flat_over_3000_frames(scripted_server_process, tmp_path, monkeypatch):
    monkeypatch.setattr(load, "send_paced", functools.partial(pacing.send_paced, period=PERIOD_S))
    wav = write_tone_wav(tmp_path / "tone.wav", 2.0)
    code = main(["--model", "scripted", "--input-wav", str(wav), "--url", scripted_server_process,
                 "--output-dir", str(tmp_path / "out"), "--sessions", str(SESSIONS), "--processes", "1",
                 "--load-frames", str(FRAMES), "--tail-s", str(FRAMES * 0.08), "--drain-s", "0.5",
                 "--timeout-s", "60", "--max-gap-ms", str(UNGATED_MS),
                 "--max-stream-lag-ms", str(UNGATED_MS), "--max-frame-deficit", str(UNGATED_DEFICIT), "-q"])
    result = json.loads((tmp_path / "out" / "load-result.json").read_text())
    assert result["processes"] == 1 and result["passed_sessions"] == SESSIONS, \
        sorted({row["error"] for row in result["sessions"]} - {None})
    assert code == 0
    lateness = np.array([[max(0.0, f["send_started_at_s"] - f["due_at_s"]) * 1000.0 for f in row["input_timeline"]]
                         for row in result["sessions"]])
    assert lateness.shape == (SESSIONS, FRAMES)
    # Median over the sessions at each frame, then its slope over the stream (ms per 1000 frames).
    per_frame = np.median(lateness, axis=0)
    slope = least_squares_slope(list(range(FRAMES)), per_frame.tolist()) * 1000.0
    # The edges by their typical frame (the median over their frames of the per-frame median): a
    # cost that grows with the stream moves every frame, a stall of the shared machine only the
    # few it hits.  Their p99 judged the machine: beside two busy processes, 11.1 ms over the
    # first 300 frames and 98.5 over the last, with the slope flat (-0.087 ms per 1000 frames).
    start = float(np.median(per_frame[:EDGE]))
    end = float(np.median(per_frame[-EDGE:]))
    restarts = sum(row["client_grid_restarts"] for row in result["sessions"])
    report = (f"slope {slope:.3f} ms/1000 frames, median first {EDGE} frames {start:.1f} ms, last {EDGE} {end:.1f} ms, "
              f"{restarts} grid restarts")
    print(report)
    assert slope < 1.0, report
    assert end <= max(1.5 * start, start + 10.0), report
