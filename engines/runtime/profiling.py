"""Per-stage GPU timing of a tick, off unless a benchmark turns it on.

``StageClock.mark(name)`` records a CUDA event after the work queued so far; nothing is
synchronised until ``durations_ms`` is read, so timing does not change what it measures
(beyond the events themselves).  ``host_mark(name)`` does the same with the host's clock,
to see where wall time outside the GPU's goes.  Disabled, both are no-ops.

``external``: the events become event-record nodes when a CUDA graph is captured (instead
of dependencies inside it), so a captured tick reports its stages at every replay.
"""

from __future__ import annotations

import time

import torch


class StageClock:
    def __init__(self) -> None:
        self.enabled = False
        self.external = False
        self._marks: list[tuple[str, torch.cuda.Event]] = []
        self._host: list[tuple[str, float]] = []

    def start(self) -> None:
        self._marks = []
        self.mark("start")

    def host_start(self) -> None:
        self._host = []
        self.host_mark("start")

    def host_mark(self, name: str) -> None:
        if self.enabled:
            self._host.append((name, time.perf_counter()))

    def host_durations_ms(self) -> dict[str, float]:
        """Host milliseconds between consecutive ``host_mark``s, keyed by the later name."""
        return {name: (t1 - t0) * 1e3 for (_, t0), (name, t1) in zip(self._host, self._host[1:])}

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        event = torch.cuda.Event(enable_timing=True, external=self.external)
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
