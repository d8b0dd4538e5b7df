"""Why a tick ran long: what the engine thread's process did while it ran.

A tick that takes a few frame periods is an output gap every session of it hears (an H200
at 147 sessions, 2026-12-05: one tick of 0.3-0.6 s among 3,017 of ~59 ms, nothing in the log
to say why; docs/PERFORMANCE.md, "A capacity model per GPU").  This module keeps the two
things such a tick can be explained by from inside the process, cheaply enough to keep on in
production: the interpreter's garbage collections (when each ran, how long, which
generation: a full collection of a process holding a compiled model can take hundreds of
milliseconds, and the engine thread waits for it like any other) and the engine's own
counters where it offers them (the GPU allocator's retries and device allocations: a retry
frees the allocator's cache and synchronises the device).  ``SlowTicks.note`` is called with
every tick's duration; above ``SLOW_TICK_S`` it logs one warning with both.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from typing import Callable, Mapping

log = logging.getLogger(__name__)

# 2.5 frame periods: a tick this long is an output gap longer than the 200 ms a session may
# have and still hold real time (docs/PERFORMANCE.md, "The load driver as an instrument (issue 14)").
SLOW_TICK_S = 0.2
# Collections remembered: more than run during any one tick (a full one is rare; young ones a
# few a second under load).
KEPT_COLLECTIONS = 256


class GcWatch:
    """This process's garbage collections, each as (start, end, generation), the latest kept.
    The callback runs in whichever thread triggered the collection, and only appends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started: float | None = None
        self.collections: deque[tuple[float, float, int]] = deque(maxlen=KEPT_COLLECTIONS)

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            self.collections.append((self._started, self._clock(), int(info.get("generation", -1))))
            self._started = None

    def during(self, start: float, end: float) -> list[tuple[int, float]]:
        """(generation, seconds) of each collection that overlapped [start, end]."""
        return [(generation, finish - begin) for begin, finish, generation in list(self.collections)
                if finish >= start and begin <= end]


class SlowTicks:
    """Explains, in one warning each, the ticks longer than ``threshold_s``.  ``counters``
    gives the engine's cumulative counters (name -> count) or None, read when serving starts
    and at each slow tick: each warning names how they moved since the slow tick before (the
    first since serving began; a span that holds the joins and closes of that time too)."""

    def __init__(self, counters: Callable[[], Mapping[str, int] | None] | None = None,
                 threshold_s: float = SLOW_TICK_S, clock: Callable[[], float] = time.monotonic,
                 device: str | None = None) -> None:
        self.threshold_s = threshold_s
        self.gc = GcWatch(clock)
        self.counters = counters
        self._last_counters: Mapping[str, int] | None = None
        self._device = device
        self.reported = 0

    def start(self, counters: Callable[[], Mapping[str, int] | None] | None) -> None:
        """Serving begins: watch the collections, read the engine's counters once (the first
        slow tick's moves count from here)."""
        self.counters = counters
        self._last_counters = self._read_counters()
        self.gc.install()

    def stop(self) -> None:
        self.gc.uninstall()

    def note(self, start: float, seconds: float, batch: int, typical_s: float) -> str | None:
        """A tick of ``batch`` sessions that began at ``start`` and took ``seconds`` (the
        recent typical tick ``typical_s``); the warning logged, if it was slow."""
        if seconds < self.threshold_s:
            return None
        collections = self.gc.during(start, start + seconds)
        if collections:
            full = sum(1 for generation, _ in collections if generation == 2)
            gc_part = (f"{len(collections)} garbage collection(s) ran in it ({full} full), "
                       f"{sum(s for _, s in collections) * 1e3:.0f} ms together")
        else:
            gc_part = "no garbage collection ran in it"
        counter_part = self._counter_moves()
        message = (f"a tick of {batch} sessions{' on ' + self._device if self._device else ''} took "
                   f"{seconds * 1e3:.0f} ms (recently {typical_s * 1e3:.0f} ms): {gc_part}"
                   f"{'; ' + counter_part if counter_part else ''}")
        self.reported += 1
        log.warning("%s", message)
        return message

    def _read_counters(self) -> dict[str, int] | None:
        if self.counters is None:
            return None
        try:
            return dict(self.counters() or {})
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the tick
            log.debug("engine counters unreadable: %s", exc)
            return None

    def _counter_moves(self) -> str:
        now = self._read_counters()
        if not now:
            return ""
        before, self._last_counters = self._last_counters or {}, now
        return "engine counters since the previous slow tick (or since serving began): " + ", ".join(
            f"{name} +{value - before.get(name, 0)}" for name, value in sorted(now.items()))
