"""A tick long enough to be heard is explained in the log: the garbage collections that ran in
it and how the engine's allocator counters moved (orchestrator/lockstep/slow_ticks.py), on the
real scheduler with the embedded tiny engine."""

from __future__ import annotations

import gc
import logging
import time

import numpy as np

from engines.runtime.factory import create_engine
from orchestrator.lockstep.slow_ticks import SLOW_TICK_S, SlowTicks
from orchestrator.lockstep.scheduler import TickScheduler
from orchestrator.lockstep.tick_policy import make_policy
from orchestrator.metrics import Metrics

from .test_orchestrator_scheduler import GREEDY, Collector, frames


class _Garbage:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_slow_tick_names_the_full_collection_that_ran_in_it():
    slow = SlowTicks()
    slow.gc.install()
    try:
        start = time.monotonic()
        for _ in range(1000):
            _Garbage()
        gc.collect()  # a full collection, inside the "tick"
        message = slow.note(start, SLOW_TICK_S + 0.05, 147, 0.059)
    finally:
        slow.gc.uninstall()
    assert message is not None and "a tick of 147 sessions took 250 ms (recently 59 ms)" in message
    assert "garbage collection(s) ran in it (1 full)" in message, message


def test_a_slow_tick_without_a_collection_says_so_and_a_fast_one_is_not_logged():
    slow = SlowTicks()
    slow.gc.install()
    try:
        gc.collect()  # before the tick: not counted in it
        time.sleep(0.01)
        start = time.monotonic()
        assert slow.note(start, SLOW_TICK_S / 2, 8, 0.01) is None
        message = slow.note(start, SLOW_TICK_S, 8, 0.01)
    finally:
        slow.gc.uninstall()
    assert message is not None and "no garbage collection ran in it" in message, message
    assert slow.reported == 1


def test_the_engine_counters_are_given_as_moves_since_serving_began():
    counts = {"alloc_retries": 0, "device_allocs": 10}
    slow = SlowTicks()
    slow.start(lambda: dict(counts))  # the baseline
    try:
        now = time.monotonic()
        counts.update(alloc_retries=1, device_allocs=13)
        assert slow.note(now, 0.05, 4, 0.05) is None  # a fast tick reads nothing
        message = slow.note(now, 0.5, 4, 0.05)
        assert "alloc_retries +1, device_allocs +3" in message, message
        counts.update(device_allocs=14)
        assert "alloc_retries +0, device_allocs +1" in slow.note(now, 0.5, 4, 0.05)
        # A counter that cannot be read does not fail the tick.
        slow.counters = lambda: 1 / 0
        assert slow.note(now, 0.5, 4, 0.05) is not None
    finally:
        slow.stop()


def test_the_scheduler_explains_a_slow_tick_of_the_real_engine(caplog):
    """The engine thread's tick that ran a full collection and took 0.3 s: one warning naming
    it.  The tiny engine on CPU has no allocator counters (empty)."""
    class SlowOnce:
        def __init__(self, engine) -> None:
            self.engine, self.ticks = engine, 0

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def step(self, slots, pcm):
            self.ticks += 1
            if self.ticks == 3:
                for _ in range(1000):
                    _Garbage()
                gc.collect()
                time.sleep(SLOW_TICK_S + 0.1)
            return self.engine.step(slots, pcm)

    sink = Collector()
    scheduler = TickScheduler(lambda: SlowOnce(create_engine(None, max_slots=1)),
                              policy=make_policy("window", min_wait_s=0.01, busy_target=0.7),
                              silence_grace_s=0.0, warmup_frames=2, metrics=Metrics(), device="cpu")
    scheduler.start(sink.deliver)
    try:
        assert scheduler.ready.wait(120) and scheduler.load_error is None
        scheduler.open("a", GREEDY).result(30)
        with caplog.at_level(logging.WARNING, logger="orchestrator.lockstep.slow_ticks"):
            for i in range(5):
                scheduler.push("a", 0, frames(1, i))
                sink.wait(lambda: len(sink.results) == i + 1)
    finally:
        scheduler.stop()
    # A busy machine may make other ticks of the tiny engine slow too (logged, without a full
    # collection): the one that ran the collection is logged once, with it.
    warnings = [r.getMessage() for r in caplog.records if r.name == "orchestrator.lockstep.slow_ticks"]
    full = [w for w in warnings if "(1 full)" in w]
    assert len(full) == 1 and "a tick of 1 sessions on cpu took" in full[0], warnings
    assert np.all([r.batch_size == 1 for r in sink.results])
