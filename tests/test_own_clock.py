"""The clocks that let timing checks judge the server's code and not the machine it shares:
``OwnClock`` (wall time less the thread's waits for a CPU) and the event-loop watch built on
it (``personaplex_event_loop_blocked_seconds``).  Linux only (schedstat)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from orchestrator.frontend.loop_watch import watch_event_loop
from orchestrator.metrics import Metrics
from orchestrator.own_clock import OwnClock
from tests.busy import busy_processes, usable_cpus

pytestmark = pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux's schedstat")

BLOCKED = "personaplex_event_loop_blocked_seconds"


def spin(cpu_s: float) -> None:
    """Compute on this thread until it has used ``cpu_s`` of CPU time."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_own_time_leaves_out_the_waits_for_a_cpu():
    """0.2 s of computing beside twice as many busy processes as cores: its wall time grows
    (the check needs that, or it shows nothing), its own time stays the computing.  A clock
    that counted the waits (plain wall time) fails here."""
    with busy_processes(2 * usable_cpus()) as hogs:
        time.sleep(0.3)  # the hogs are running
        clock = OwnClock()
        try:
            wall, own = time.monotonic(), clock.now()
            spin(0.2)
            wall, own = time.monotonic() - wall, clock.now() - own
        finally:
            clock.close()
    print(f"0.2 s of CPU beside {len(hogs)} busy processes: wall {wall:.3f} s, own {own:.3f} s")
    assert wall > 0.3, "the busy processes did not contend for the CPU: nothing was shown"
    assert 0.19 <= own < 0.28, own


def test_the_loop_watch_records_the_workers_own_blocks():
    """A callback that sleeps 0.4 s and one that computes for 0.4 s each hold the loop past
    the 0.25 s bucket bound once; beats of an idle loop record nothing near it."""
    metrics = Metrics()

    def above(bound: str) -> float:
        registry = metrics.registry
        return registry.get_sample_value(f"{BLOCKED}_count") - registry.get_sample_value(f"{BLOCKED}_bucket",
                                                                                          {"le": bound})

    async def scenario() -> None:
        watch = asyncio.ensure_future(watch_event_loop(metrics))
        await asyncio.sleep(0.5)
        assert above("0.1") == 0
        time.sleep(0.4)  # a blocking call on the loop
        await asyncio.sleep(0.2)
        spin(0.4)  # computing on the loop
        await asyncio.sleep(0.2)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(scenario())
    assert above("0.25") == 2 and above("0.5") == 0
    assert metrics.registry.get_sample_value(f"{BLOCKED}_count") >= 15  # a beat every 50 ms
