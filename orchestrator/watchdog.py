"""The watchdog: notices an engine call (a tick, an open, a restart) that does not return.

A hung GPU kernel or a deadlocked driver call leaves the engine thread blocked and every
session silent, with no exception anywhere.  The watchdog runs on the event loop, reads the
scheduler's ``busy`` marker a few times per deadline (two attribute reads: the tick itself
pays nothing), and when one call has run past ``deadline_s`` it counts a stall, logs it,
tells the callback (which warns the sessions), and reports itself in ``stalled`` until that
call returns: its engine then takes no new sessions, and when no engine of the process can
serve ``/health`` is 503, so an orchestrator can replace the process.  One watchdog per
engine in its engine process (which counts the stall), and one per engine in each front-end
worker (``engine_pool.py``: reading the call in progress as the engine's status last said,
to warn that worker's sessions and place none there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from .metrics import Metrics
from .engine_port import EngineCall

log = logging.getLogger(__name__)


class Watched(Protocol):
    """What the watchdog reads: the engine process's ``TickScheduler``, or a worker's
    ``EnginePort`` to it (its call in progress as last heard)."""

    device: str
    busy: EngineCall | None


class Watchdog:
    def __init__(self, scheduler: Watched, deadline_s: float, metrics: Metrics,
                 on_stall: Callable[[EngineCall, float], None],
                 clock: Callable[[], float] = time.monotonic, count_stalls: bool = True) -> None:
        # ``count_stalls``: False where the engine process counts its own stalls (every
        # worker watches the same engine; counting in each would count a stall K times).
        # ``clock`` must be the scheduler's (both default to time.monotonic).
        self.scheduler = scheduler
        self.deadline_s = deadline_s
        self._metrics = metrics
        self._on_stall = on_stall
        self._clock = clock
        self._stalled: EngineCall | None = None
        self._count_stalls = count_stalls

    @property
    def period_s(self) -> float:
        return max(0.02, min(1.0, self.deadline_s / 4))

    @property
    def stalled(self) -> str | None:
        """Why the engine counts as stalled now, or None."""
        call = self._stalled
        if call is None:
            return None
        return (f"engine stalled: a {call.kind} has been running for {self._clock() - call.since:.1f} s "
                f"(deadline {self.deadline_s:g} s)")

    @property
    def _of_device(self) -> str:
        return f" of {self.scheduler.device}" if self.scheduler.device else ""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.check()

    def check(self) -> None:
        call = self.scheduler.busy
        now = self._clock()
        if call is not None and now - call.since > self.deadline_s:
            if self._stalled != call:  # equal, not identical: an engine process's call is re-read per status
                self._stalled = call
                if self._count_stalls:
                    self._metrics.inc("tick_stalls")
                log.error("watchdog: the engine thread%s is stuck in a %s (%d session(s)) for %.1f s, past the %g s "
                          "deadline; it takes no new sessions until it returns", self._of_device, call.kind,
                          call.sessions, now - call.since, self.deadline_s)
                self._on_stall(call, now - call.since)
        elif self._stalled is not None:
            log.warning("watchdog: the stalled %s%s returned after %.1f s; healthy again", self._stalled.kind,
                        self._of_device, now - self._stalled.since)
            self._stalled = None
