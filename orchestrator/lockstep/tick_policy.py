"""When the lockstep scheduler runs its next tick: a pure function of what it can see now.

No threads, clocks or sleeps here: the scheduler passes a ``TickState`` and acts on the
``Decision`` (tick now, or look again in ``wait_s`` unless something changes first), so each
policy is tested alone with plain numbers.

Why it matters: a tick reads every weight once whatever its batch, and has a fixed cost
besides, so many small ticks serve fewer sessions per GPU-second than few large ones.  Real
clients send at arbitrary phases of the 80 ms period.  Measured figures for both policies:
docs/PERFORMANCE.md, "Both tick policies at full windows" and "The server on the H200 at full
windows" (the one-process layout of 2026-12-01).

- ``paced`` (the server's default): tick when every live lane has a frame; otherwise at most
  once per *interval* after the previous tick took its frames, the interval being the recent
  tick time over ``busy_target`` (so the engine is busy about that fraction of the time), at
  least ``min_wait_s`` and at most one frame period.  Under load the batches grow until the
  ticks fit; a frame that has waited a whole period ticks at once, so a lane that fell behind
  catches up; one lone session (always "every live lane") ticks the moment its frame arrives.
  Latency cost: a frame waits up to one interval (half of it on average) for its tick.
- ``window`` (the first policy): tick as soon as every live lane has a frame, when a frame is
  behind (it was already queued when the previous tick took its frames), or once the oldest
  frame has waited ``min_wait_s``.  With random phases and ticks longer than the window, the
  oldest frame has always waited long enough when a tick ends, so ticks run back to back on
  whatever arrived meanwhile: the engine stays busy with small batches, leaving no headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.config import FRAME_PERIOD_S

POLICIES = ("paced", "window")


@dataclass(frozen=True)
class TickState:
    now: float
    live: int  # lanes that can be stepped
    ready: int  # of them, lanes with a frame queued
    oldest_arrival: float | None  # arrival of the oldest queued frame (None when none is)
    last_take: float  # when the previous tick took its frames (-inf before the first)
    tick_s: float  # recent tick duration (moving average; 0 before the first tick)


@dataclass(frozen=True)
class Decision:
    tick: bool
    wait_s: float | None = None  # not ticking: look again after this long (None: on the next change)


TICK = Decision(True)
IDLE = Decision(False)


@dataclass(frozen=True)
class WindowPolicy:
    min_wait_s: float  # the batch window

    def decide(self, state: TickState) -> Decision:
        if not state.ready or state.oldest_arrival is None:
            return IDLE
        behind = state.oldest_arrival <= state.last_take
        waited = state.now - state.oldest_arrival
        if state.ready == state.live or behind or waited >= self.min_wait_s:
            return TICK
        return Decision(False, self.min_wait_s - waited)


@dataclass(frozen=True)
class PacedPolicy:
    min_wait_s: float  # the shortest interval between ticks that leave a live lane out
    busy_target: float = 0.7  # fraction of the time the engine should be stepping
    period_s: float = FRAME_PERIOD_S

    def interval(self, tick_s: float) -> float:
        return min(self.period_s, max(self.min_wait_s, tick_s / self.busy_target))

    def decide(self, state: TickState) -> Decision:
        if not state.ready:
            return IDLE
        if state.ready == state.live:
            return TICK
        # A frame a whole period old: its lane is behind (a slow job, a stall).  Waiting the
        # interval would step it no faster than its client sends, so the backlog would never
        # drain once the interval reaches the period; tick now.
        if state.oldest_arrival is not None and state.now - state.oldest_arrival >= self.period_s:
            return TICK
        due = state.last_take + self.interval(state.tick_s)
        if state.now >= due:
            return TICK
        return Decision(False, due - state.now)


def make_policy(name: str, *, min_wait_s: float, busy_target: float) -> WindowPolicy | PacedPolicy:
    if name == "window":
        return WindowPolicy(min_wait_s)
    if name == "paced":
        return PacedPolicy(min_wait_s, busy_target)
    raise ValueError(f"unknown tick policy {name!r} (one of {', '.join(POLICIES)})")
