"""A front-end worker's event loop, watched from inside it.

Every session of a worker waits while its event loop runs one piece of work, so the longest
such piece is what the worker's code costs its sessions in lag.  A timer due every
``LOOP_BEAT_S`` runs late by that much, plus whatever time the loop's thread waited for a CPU
that other processes held: ``OwnClock`` leaves the latter out, so the recorded block
(``personaplex_event_loop_blocked_seconds``) is the worker's own doing (a callback that
computes, a blocking call, a lock, the interpreter lock held by a codec thread) and stays small
on a host that is merely busy (a lock whose holder waits for a CPU is the one way the host
shows).  The wall-clock lag (``personaplex_event_loop_lag_seconds``) is sampled too, less
often: it is what sessions felt, host included.
"""

from __future__ import annotations

import asyncio
import itertools

from ..metrics import Metrics
from ..own_clock import OwnClock

LOOP_BEAT_S = 0.05  # how often the block is measured (a block shorter than a beat or two can hide in it)
LOOP_SAMPLE_EVERY = 10  # beats per sample of the wall-clock lag and the task count (0.5 s; walking every task costs)


async def watch_event_loop(metrics: Metrics) -> None:
    """Record the running loop's blocks at every beat, its lag and task count every
    LOOP_SAMPLE_EVERY beats; until cancelled."""
    loop = asyncio.get_running_loop()
    clock = OwnClock()
    try:
        for beat in itertools.count(1):
            due, own_due = loop.time() + LOOP_BEAT_S, clock.now() + LOOP_BEAT_S
            await asyncio.sleep(LOOP_BEAT_S)
            metrics.observe_loop_blocked(max(0.0, clock.now() - own_due))
            if beat % LOOP_SAMPLE_EVERY == 0:
                metrics.observe_loop(max(0.0, loop.time() - due), len(asyncio.all_tasks()))
    finally:
        clock.close()
