"""The tick scheduler driving the real engine (embedded tiny checkpoint on CPU), without a
server: batching policy, silence feeding, epochs, slot release and job placement."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engines.runtime.factory import create_engine
from engines.interface import WAITING, InvalidSessionSpec, NoFreeSlot, SamplingParams, SessionSpec
from orchestrator.metrics import Metrics
from orchestrator.engine_port import FrameResult
from orchestrator.lockstep.scheduler import TickScheduler
from orchestrator.lockstep.tick_policy import make_policy

GREEDY = SessionSpec(sampling=SamplingParams(greedy=True))


class Collector:
    """The scheduler's hand-back: records the results it is given (on the engine thread)."""

    def __init__(self) -> None:
        self.results: list[FrameResult] = []
        self.cond = threading.Condition()

    def deliver(self, results) -> None:
        with self.cond:
            self.results.extend(results)
            self.cond.notify_all()

    def of(self, key: str) -> list[FrameResult]:
        with self.cond:
            return [r for r in self.results if r.key == key]

    def wait(self, predicate, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "timed out waiting for results"


@pytest.fixture
def make_scheduler():
    made: list[TickScheduler] = []

    def make(max_slots: int = 2, window_ms: float = 20.0, grace_s: float = 0.0, policy: str = "window",
             adapt=lambda engine: engine, **options):
        sink = Collector()
        scheduler = TickScheduler(lambda: adapt(create_engine(None, max_slots=max_slots)),
                                  policy=make_policy(policy, min_wait_s=window_ms / 1e3, busy_target=0.7),
                                  silence_grace_s=grace_s, warmup_frames=2, metrics=Metrics(), **options)
        scheduler.start(sink.deliver)
        assert scheduler.ready.wait(120) and scheduler.load_error is None
        made.append(scheduler)
        return scheduler, sink

    yield make
    for scheduler in made:
        scheduler.stop()


def frames(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 1920)) * 0.05).astype(np.float32)


def test_ready_frames_of_all_lanes_tick_together(make_scheduler):
    scheduler, sink = make_scheduler()
    if Path("/proc/self/task").is_dir():  # the engine thread is named for top -H and ps -L
        assert (Path("/proc/self/task") / str(scheduler._thread.native_id) / "comm").read_text().strip() == "ppengine"
    assert scheduler.open("a", GREEDY).result(30) != scheduler.open("b", GREEDY).result(30)
    for i in range(5):
        with scheduler._cond:  # both frames land before the scheduler can look
            scheduler.push("a", 0, frames(1, i))
            scheduler.push("b", 0, frames(1, 10 + i))
        sink.wait(lambda: len(sink.results) == 2 * (i + 1))
    a, b = sink.of("a"), sink.of("b")
    assert [r.tick for r in a] == [r.tick for r in b], "frames of both lanes must share their ticks"
    assert all(r.batch_size == 2 for r in a + b)
    assert all(r.pcm16.dtype == np.int16 and r.pcm16.shape == (1920,) for r in a + b)


def test_lone_frame_waits_for_the_window_only(make_scheduler):
    scheduler, sink = make_scheduler(window_ms=60.0)
    scheduler.open("a", GREEDY).result(30)
    scheduler.open("idle", GREEDY).result(30)
    scheduler.push("a", 0, frames(1))
    sink.wait(lambda: len(sink.results) == 1)
    (result,) = sink.results
    assert result.batch_size == 1 and result.wait_ms >= 60.0 - 1.0  # waited for the idle lane's frame


def test_paced_policy_ticks_a_lone_frame_after_the_interval(make_scheduler):
    """With ``paced``, a frame that not every lane has matched waits for the interval since
    the previous tick's take (here the 60 ms floor: the tiny model's ticks are short), so a
    backlog is not stepped back to back; a frame a whole period (80 ms) old goes at once."""
    scheduler, sink = make_scheduler(window_ms=60.0, policy="paced")
    scheduler.open("a", GREEDY).result(30)
    scheduler.open("idle", GREEDY).result(30)
    with scheduler._cond:
        scheduler.push("a", 0, frames(3))
    sink.wait(lambda: len(sink.results) == 3, timeout=30)
    ticks = sink.results
    assert all(r.batch_size == 1 for r in ticks) and [r.tick for r in ticks] == sorted(r.tick for r in ticks)
    # frames 2 and 3 were queued with frame 1: frame 2 waited the interval, frame 3 (whose next
    # interval would end at 120 ms) the period; lower bounds only, the policy never goes early
    assert ticks[1].wait_ms - ticks[0].wait_ms >= 60.0 - 1.0 and ticks[2].wait_ms - ticks[0].wait_ms >= 80.0 - 1.0


def test_backlog_runs_back_to_back_and_joins_paced_lane(make_scheduler):
    """A client faster than real time is served as fast as the engine goes, in order; a
    slower lane rides along in the same ticks whenever it has a frame."""
    scheduler, sink = make_scheduler(window_ms=1000.0)
    scheduler.open("fast", GREEDY).result(30)
    scheduler.open("slow", GREEDY).result(30)
    with scheduler._cond:
        scheduler.push("fast", 0, frames(12))
        scheduler.push("slow", 0, frames(1, 5))
    sink.wait(lambda: len(sink.of("fast")) == 12)
    fast, slow = sink.of("fast"), sink.of("slow")
    assert [r.tick for r in fast] == sorted(r.tick for r in fast) and len(slow) == 1
    assert slow[0].tick == fast[0].tick and slow[0].batch_size == 2
    # The backlog did not wait the 1 s window for the slow lane between its frames: its last
    # frame waited for the ticks before it, plus less than one window (11 windows if it had
    # waited between frames; the ticks' own time is counted, so a busy machine does not fail it).
    assert all(r.batch_size == 1 for r in fast[1:])
    assert fast[-1].wait_ms < 1000.0 + sum(r.tick_ms for r in fast[:-1]), [(r.wait_ms, r.tick_ms) for r in fast]


def test_output_depends_only_on_the_lane_input(make_scheduler):
    """Greedy lanes fed the same frames produce the same audio whether they run alone or
    batched with a busy neighbour: no state crosses slots."""
    scheduler, sink = make_scheduler()
    scheduler.open("alone", GREEDY).result(30)
    scheduler.push("alone", 0, frames(6))
    sink.wait(lambda: len(sink.of("alone")) == 6)
    scheduler.close("alone").result(30)
    scheduler.open("x", GREEDY).result(30)
    scheduler.open("noise", SessionSpec()).result(30)
    with scheduler._cond:
        scheduler.push("x", 0, frames(6))
        scheduler.push("noise", 0, frames(6, 99) * 10)
    sink.wait(lambda: len(sink.of("x")) == 6)
    alone = np.stack([r.pcm16 for r in sink.of("alone")])
    batched = np.stack([r.pcm16 for r in sink.of("x")])
    np.testing.assert_allclose(batched.astype(np.float32), alone.astype(np.float32), atol=2)


def test_restart_drops_old_epoch_frames(make_scheduler):
    scheduler, sink = make_scheduler()
    scheduler.open("a", GREEDY).result(30)
    with scheduler._cond:  # queued together with the restart: none of them may run
        scheduler.push("a", 0, frames(50))
        scheduler.restart("a", 1)
        scheduler.push("a", 0, frames(3))  # late frames of the old epoch are ignored
        scheduler.push("a", 1, frames(4))
    sink.wait(lambda: len(sink.results) == 4)
    time.sleep(0.2)
    assert [r.epoch for r in sink.results] == [1, 1, 1, 1]


def test_silence_is_fed_after_the_grace(make_scheduler):
    scheduler, sink = make_scheduler(grace_s=0.3)
    opened = time.monotonic()
    scheduler.open("quiet", GREEDY).result(30)
    sink.wait(lambda: len(sink.results) >= 5, timeout=10)
    first = sink.results[0]
    assert all(r.silence_input for r in sink.results[:5])
    assert time.monotonic() - opened >= 0.3 + 4 * 0.08 - 0.05  # paced, after the grace
    scheduler.push("quiet", 0, frames(1))
    sink.wait(lambda: any(not r.silence_input for r in sink.results))
    assert first.epoch == 0


def test_close_releases_the_engine_slot_and_cancels_pending_opens(make_scheduler):
    scheduler, sink = make_scheduler(max_slots=1)
    scheduler.open("a", GREEDY).result(30)
    with pytest.raises(NoFreeSlot):
        scheduler.open("b", GREEDY).result(30)
    scheduler.close("a").result(30)
    assert scheduler.open("c", GREEDY).result(30) is not None
    with pytest.raises(InvalidSessionSpec):
        scheduler.open("d", SessionSpec(voice="NOBODY.pt")).result(30)
    # A close that overtakes its own pending open cancels it.
    with scheduler._cond:
        pending = scheduler.open("e", GREEDY)
        closed = scheduler.close("e")
    closed.result(30)
    assert pending.cancelled()


def test_a_burst_of_closes_is_one_engine_call(make_scheduler):
    """Many clients leaving together: one wipe of all their slots, not one per session (a
    wipe costs a few ms on a GPU whatever the number of slots; 76 in a row held the live
    lanes up ~200 ms on an H200)."""
    calls: list[list[int]] = []

    def adapt(engine):
        close_slots = engine.close_slots
        engine.close_slots = lambda slots: (calls.append(list(slots)), close_slots(slots))[1]
        return engine

    scheduler, sink = make_scheduler(max_slots=6, adapt=adapt)
    slots = [scheduler.open(f"s{i}", GREEDY).result(30) for i in range(6)]
    with scheduler._cond:  # all queued before the engine thread looks
        closed = [scheduler.close(f"s{i}") for i in range(5)]
    for future in closed:
        future.result(30)
    assert calls == [slots[:5]] and scheduler.slots_taken == 1
    assert [scheduler.open(f"t{i}", GREEDY).result(30) for i in range(5)] == slots[:5]


def test_closes_take_one_turn_before_a_due_tick():
    """Closes go first, all at once; closes that keep arriving wait for the due tick."""
    import concurrent.futures
    from orchestrator.lockstep.scheduler import CloseAction, LaneFrame, TickAction, _Lane

    scheduler = TickScheduler(lambda: None, policy=make_policy("window", min_wait_s=0.02, busy_target=0.7),
                              silence_grace_s=0.0, warmup_frames=0, metrics=Metrics())
    lane = _Lane("live", 0, GREEDY, time.monotonic())
    scheduler._lanes["live"] = lane
    lane.frames.append(LaneFrame(frames(1)[0], time.monotonic(), False))
    scheduler._closes.extend((key, concurrent.futures.Future()) for key in ("a", "b"))
    action = scheduler._next_action()
    assert isinstance(action, CloseAction) and [key for key, _ in action.closes] == ["a", "b"]
    scheduler._closes.append(("c", concurrent.futures.Future()))
    assert isinstance(scheduler._next_action(), TickAction)  # the live lane's frame was due
    assert [key for key, _ in scheduler._next_action().closes] == ["c"]


def test_open_runs_between_ticks_without_starving(make_scheduler):
    """A joining session's prefill is placed right after a tick: a lane with a long backlog
    does not delay it, and it delays that lane by at most one job per tick."""
    scheduler, sink = make_scheduler()
    scheduler.open("busy", GREEDY).result(30)
    scheduler.push("busy", 0, frames(40))
    sink.wait(lambda: len(sink.of("busy")) >= 3)
    ticks_at_request = len(sink.of("busy"))
    seen: list[int] = []
    future = scheduler.open("joiner", GREEDY)
    future.add_done_callback(lambda _: seen.append(len(sink.of("busy"))))
    future.result(30)
    assert seen[0] <= ticks_at_request + 1
    sink.wait(lambda: len(sink.of("busy")) == 40)


LONG_PERSONA = "You are a patient and thorough teacher. " * 1000  # 40,000 characters: ~16,000 positions


def test_a_long_prefill_runs_in_pieces_between_the_live_lanes_ticks(make_scheduler):
    """A cold prefill of a long persona comes in pieces of 256 positions, one per gap between
    ticks: the live lane keeps ticking while the joiner is prepared, instead of waiting for
    the whole pass (on the old, unsplit prefill it got no tick at all meanwhile)."""
    scheduler, sink = make_scheduler()
    scheduler.open("live", GREEDY).result(30)
    scheduler.push("live", 0, frames(200))  # always a frame ready: it ticks whenever allowed
    sink.wait(lambda: len(sink.of("live")) >= 2)
    ticks_at_request = len(sink.of("live"))
    seen: list[int] = []
    future = scheduler.open("joiner", SessionSpec(persona=LONG_PERSONA, sampling=GREEDY.sampling))
    future.add_done_callback(lambda _: seen.append(len(sink.of("live"))))
    assert future.result(60) is not None
    ticks_during = seen[0] - ticks_at_request
    assert ticks_during >= 30, f"only {ticks_during} live ticks ran while ~60 prefill pieces did"
    sink.wait(lambda: len(sink.of("live")) == 200)


def test_a_client_that_leaves_during_its_prefill_leaves_nothing_behind(make_scheduler):
    """Closing a session whose long prefill is under way cancels it between two pieces: the
    rest of the pass is not computed and no slot is taken."""
    scheduler, sink = make_scheduler()
    scheduler.open("live", GREEDY).result(30)
    scheduler.push("live", 0, frames(200))
    sink.wait(lambda: len(sink.of("live")) >= 2)
    pending = scheduler.open("leaver", SessionSpec(persona=LONG_PERSONA, sampling=GREEDY.sampling))
    sink.wait(lambda: len(sink.of("live")) >= 12)  # a few of its pieces ran meanwhile
    assert not pending.done()
    scheduler.close("leaver").result(30)
    assert pending.cancelled()
    assert scheduler.slots_taken == 1
    sink.wait(lambda: len(sink.of("live")) == 200)
    assert not scheduler._jobs


def test_a_join_that_waits_for_another_does_not_spend_the_gaps(make_scheduler):
    """Two long joins at once where only one may run at a time (on CUDA: the one piece graph;
    here a stand-in around the real preparation): the second waits (``WAITING``) until the
    first is done, then runs, and its waiting pieces do not take the gaps between live ticks
    that the first one's pieces need."""
    holder: list[str | None] = [None]
    log: list[tuple[str, str, int]] = []  # (joiner, "piece" | "wait", live ticks so far)

    def adapt(engine):
        prepare = engine.prepare_in_pieces
        engine.prepare_in_pieces = lambda spec: one_at_a_time(prepare, spec)
        return engine

    scheduler, sink = make_scheduler(max_slots=3, adapt=adapt, concurrent_joins=2)

    def one_at_a_time(prepare, spec: SessionSpec):
        name = spec.persona[:1]

        def pieces():
            while holder[0] not in (None, name):
                log.append((name, "wait", len(sink.of("live"))))
                yield WAITING
            holder[0] = name
            inner = prepare(spec)
            try:
                while True:
                    try:
                        next(inner)
                    except StopIteration as done:
                        return done.value
                    log.append((name, "piece", len(sink.of("live"))))
                    yield
            finally:
                holder[0] = None

        return pieces()

    scheduler.open("live", GREEDY).result(30)
    scheduler.push("live", 0, frames(400))
    sink.wait(lambda: len(sink.of("live")) >= 2)
    first = scheduler.open("A", SessionSpec(persona="A" + LONG_PERSONA[: len(LONG_PERSONA) // 2], sampling=GREEDY.sampling))
    second = scheduler.open("B", SessionSpec(persona="B" + LONG_PERSONA[: len(LONG_PERSONA) // 2], sampling=GREEDY.sampling))
    assert first.result(60) is not None and second.result(60) is not None
    a_pieces = [ticks for name, kind, ticks in log if name == "A" and kind == "piece"]
    b_pieces = [ticks for name, kind, ticks in log if name == "B" and kind == "piece"]
    assert any(name == "B" and kind == "wait" for name, kind, _ in log)
    assert len(a_pieces) >= 20 and b_pieces and min(b_pieces) >= max(a_pieces), "B ran while A held the graph"
    spent = a_pieces[-1] - a_pieces[0]
    assert spent <= 1.4 * len(a_pieces) + 3, f"A's {len(a_pieces)} pieces took {spent} ticks: waits took gaps"
    sink.wait(lambda: len(sink.of("live")) == 400)


def _held_back(release: threading.Event, log: list[str]):
    """An engine adapter: a persona starting "H" is prepared in pieces until ``release`` is set
    (a join that stays under way as long as a test needs); every piece of every preparation
    is logged by the persona's first letter."""

    def adapt(engine):
        prepare = engine.prepare_in_pieces

        def pieces(spec: SessionSpec):
            name = spec.persona[:1]
            while name == "H" and not release.is_set():
                log.append(name)
                yield
            inner = prepare(spec)
            while True:
                try:
                    signal = next(inner)
                except StopIteration as done:
                    return done.value
                log.append(name)
                yield signal

        engine.prepare_in_pieces = pieces
        return engine

    return adapt


def test_joins_past_the_concurrent_limit_wait_their_turn(make_scheduler):
    """With one join prepared at a time (the memory plan reserves one longest prefill), a
    second join does not start preparing while the first is under way: every piece of the
    first comes before the second's first.  (Without the limit the two interleave, one piece
    each in turn.)"""
    release, log = threading.Event(), []
    scheduler, _ = make_scheduler(max_slots=3, adapt=_held_back(release, log), concurrent_joins=1)
    first = scheduler.open("first", SessionSpec(persona="Hold me", sampling=GREEDY.sampling))
    second = scheduler.open("second", SessionSpec(persona="B" + LONG_PERSONA[:2000], sampling=GREEDY.sampling))
    deadline = time.monotonic() + 30
    while log.count("H") < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "B" not in log and not second.done()
    release.set()
    assert first.result(60) is not None and second.result(60) is not None
    assert log.index("B") > max(i for i, name in enumerate(log) if name == "H")


def test_a_join_with_no_turn_in_time_is_refused_retryably_and_takes_nothing(make_scheduler):
    """A join that waits past ``join_wait_s`` for its turn is refused with the typed,
    retryable ``resource_exhausted`` (``JoinTurnTimeout``), without having allocated or taken
    a slot; the join under way is untouched, and a later open succeeds."""
    from orchestrator.lockstep.joins import JoinTurnTimeout

    release, log = threading.Event(), []
    scheduler, _ = make_scheduler(max_slots=3, adapt=_held_back(release, log), concurrent_joins=1, join_wait_s=0.2)
    first = scheduler.open("first", SessionSpec(persona="Hold me", sampling=GREEDY.sampling))
    second = scheduler.open("second", GREEDY)
    with pytest.raises(JoinTurnTimeout, match="no turn for this one within 0.2 s; try again") as refused:
        second.result(30)
    assert refused.value.code == "resource_exhausted" and set(log) == {"H"}
    assert scheduler.slots_taken == 0 and not first.done()
    release.set()
    assert first.result(60) is not None
    assert scheduler.open("third", GREEDY).result(30) is not None
    assert scheduler.slots_taken == 2
