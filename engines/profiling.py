"""Per-stage GPU timing of a tick, off unless a benchmark turns it on.

``StageClock.mark(name)`` records a CUDA event after the work queued so far; nothing is
synchronised until ``durations_ms`` is read, so timing does not change what it measures
(beyond the events themselves).  Disabled, ``mark`` is a no-op.
"""

from __future__ import annotations

import torch


class StageClock:
    def __init__(self) -> None:
        self.enabled = False
        self._marks: list[tuple[str, torch.cuda.Event]] = []

    def start(self) -> None:
        self._marks = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((name, event))

    def durations_ms(self) -> dict[str, float]:
        """Milliseconds between consecutive marks, keyed by the later mark's name."""
        if len(self._marks) < 2:
            return {}
        self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            out[name] = out.get(name, 0.0) + a.elapsed_time(b)
        return out
