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
from typing import Awaitable, Callable, Sequence

from . import wire
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
    send: Callable[[str], Awaitable[None]],
    frames: Sequence[str],
    *,
    start: float,
    sends: list[Send],
    before_send: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    max_frames: int | None = None,
    dues: list[float] | None = None,
    period: float = wire.FRAME_PERIOD_S,
) -> int:
    """Send the encoded ``frames`` one by one from ``start``; appends ``(planned, started,
    completed)`` to ``sends`` as it goes (so a failure mid-stream keeps the timeline).
    ``before_send`` may raise to stop (e.g. the server reported an error); it must be cheap,
    since it runs before every frame.  ``dues``, if given, gets each frame's time on the grid in
    force (after restarts), so that a send's own delay can be told from an earlier stall's
    lasting offset.  ``period``: the grid's step (the model's frame; tests may run faster).
    Returns the frames sent."""
    grid = PacingGrid(start, period)
    total = len(frames)
    if max_frames:
        total = min(total, max_frames)
    for seq in range(total):
        due = grid.due(seq)
        if dues is not None:
            dues.append(due)
        await sleep(max(0.0, due - clock()))
        before_send()
        started = clock()
        await send(frames[seq])
        completed = clock()
        sends.append((grid.planned(seq), started, completed))
        grid.sent(seq, completed)
    return total
