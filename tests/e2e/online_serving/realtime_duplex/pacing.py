"""Sending input in real time: one frame per 80 ms on a fixed grid, with no catch-up bursts.

The grid is absolute (``start + k * 80 ms``), so sleep overshoot and send time never
accumulate.  If a send completes more than one frame period after the next grid slot, the
grid restarts one period after that completion instead of firing the missed frames back to
back (a burst would hide the stall from the server and fake a real-time client).  Planned
times stay on the original grid, so a restart shows up as send lateness.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import numpy as np

from . import wire
from .audio import frame_at, frame_count
from .metrics import Send


class PacingGrid:
    """When to send frame ``seq``, and how a late completion moves the grid."""

    def __init__(self, start: float, period: float = wire.FRAME_PERIOD_S) -> None:
        self.start = start
        self.period = period
        self._grid_start = start
        self._grid_seq = 0

    def planned(self, seq: int) -> float:
        """The original grid time of frame ``seq`` (what lateness is measured against)."""
        return self.start + seq * self.period

    def due(self, seq: int) -> float:
        """When frame ``seq`` should start sending on the current (maybe restarted) grid."""
        return self._grid_start + (seq - self._grid_seq) * self.period

    def sent(self, seq: int, completed: float) -> None:
        """Frame ``seq`` finished sending at ``completed``."""
        next_due = self.due(seq + 1)
        if completed - next_due > self.period:
            self._grid_start, self._grid_seq = completed + self.period, seq + 1


async def send_paced(
    send: Callable[[dict], Awaitable[None]],
    pcm: np.ndarray,
    *,
    start: float,
    sends: list[Send],
    before_send: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    max_frames: int | None = None,
) -> int:
    """Send ``pcm`` frame by frame from ``start``; appends ``(planned, started, completed)``
    to ``sends`` as it goes (so a failure mid-stream keeps the timeline).  ``before_send``
    may raise to stop (e.g. the server reported an error).  Returns the frames sent."""
    grid = PacingGrid(start)
    total = frame_count(len(pcm))
    if max_frames:
        total = min(total, max_frames)
    for seq in range(total):
        await sleep(max(0.0, grid.due(seq) - clock()))
        before_send()
        event = wire.frame_event(frame_at(pcm, seq), seq)
        started = clock()
        await send(event)
        completed = clock()
        sends.append((grid.planned(seq), started, completed))
        grid.sent(seq, completed)
    return total
