"""The client's user-facing output: one live status line per interval and a closing summary,
written to a stream (stderr) so stdout stays free for the transcript."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import numpy as np

from engines.config import FRAME_SAMPLES, SAMPLE_RATE

from .conversation import Progress


def latency_summary(latencies_ms: list[float]) -> str:
    if not latencies_ms:
        return "latency n/a"
    values = np.asarray(latencies_ms)
    return (f"latency median {np.median(values):.0f} ms, p90 {np.percentile(values, 90):.0f} ms, "
            f"max {values.max():.0f} ms")


class Reporter:
    """Live progress for a person watching: frames each way, the latest round trip and what
    the model said since the last line.  ``quiet`` keeps only errors and the summary."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, interval_s: float = 1.0) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.interval_s = interval_s
        self._next = 0.0
        self._text = ""

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def text(self, delta: str) -> None:
        self._text += delta

    def error(self, error: dict[str, Any]) -> None:
        self._write(f"server error: {error.get('code')}: {error.get('message')}")

    def tick(self, progress: Progress, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now < self._next):
            return
        self._next = now + self.interval_s
        latest = f"{progress.latencies_ms[-1]:.0f} ms" if progress.latencies_ms else "n/a"
        said = self._text.strip()
        self._text = ""
        self._write(f"[{progress.elapsed_s:6.1f} s] sent {progress.frames_sent} frames, "
                    f"received {progress.frames_received}, latency {latest}" + (f' | "{said}"' if said else ""))

    def summary(self, progress: Progress, written: list[str]) -> None:
        sent_s = progress.frames_sent * FRAME_SAMPLES / SAMPLE_RATE
        got_s = sum(len(chunk) for chunk in progress.pcm) / SAMPLE_RATE
        lines = [(f"session {progress.session_id}: sent {sent_s:.2f} s, received {got_s:.2f} s of audio "
                  f"in {progress.elapsed_s:.1f} s; {latency_summary(progress.latencies_ms)}")]
        if progress.errors:
            lines.append(f"{len(progress.errors)} server error(s): "
                         + ", ".join(sorted({str(e.get('code')) for e in progress.errors})))
        lines.extend(f"wrote {path}" for path in written)
        for line in lines:
            self._write(line)
