"""The lockstep tick scheduler: the one thread that owns the engine.

Every live session is a *lane*: a slot in the engine plus a queue of 80 ms input frames.  A
tick takes one frame from every lane that has one and advances all of them with a single
batched ``engine.step``; the results go back to the event loop with
``loop.call_soon_threadsafe``.  The event loop never calls the engine and this thread never
touches a websocket.

Batching policy: ``tick_policy.py`` decides, from the lanes' queues, the time since the
previous tick took its frames and the recent tick time, whether to tick now or how long to
wait (``window``: tick once every live lane has a frame or the oldest has waited the batch
window; ``paced``: at most one tick per interval sized to keep the engine about
``busy_target`` busy, unless every live lane has a frame).  This thread keeps the state the
policy reads (a moving average of the tick time) and acts on its answer.

Silence feeding: a lane whose queue has been empty for ``silence_grace_s`` (no input, nothing
left to step) gets one silence frame per 80 ms so the conversation stays clocked.

Control work (opening a slot with its prefill, restarting an epoch) is expensive and runs on
this same thread, so it is placed where it costs live lanes least: right after a tick, when
the paced clients' next frames are furthest away, at most one piece of work per gap, or
whenever no lane has a frame waiting.  A cold prefill comes in pieces of bounded cost
(``Engine.prepare_in_pieces``: a chunk of prompt positions each), so a long persona joins
over several gaps instead of holding every live lane for the whole pass; jobs take turns a
piece at a time, so one long prefill does not hold up the opens queued behind it.  Closes
run before anything else, all those queued in one engine call (``close_slots``: one wipe of
every slot, which costs about what one slot's does: a few ms on a GPU), and once a tick is
due, at most once before it: a burst of closes (many clients leaving together) holds the
live lanes up by one wipe, not by one wipe per session.

Faults: a ``SlotFault`` from ``engine.step`` fails only the slots it names (the others keep
their outputs, or have their frames stepped again if none advanced); any other exception
fails every lane of that tick, because nobody can say which one caused it.  A failed lane
is suspended at once (its queued frames dropped, a restart of its model context queued) and
its session is told with a ``FrameFailure``; the thread goes on ticking.  ``busy`` names the
engine call in progress, for the watchdog.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from engines.config import FRAME_SAMPLES
from engines.interface import Engine, EngineInfo, FrameOutput, SessionSpec, SlotFault

from ..engine_port import EngineCall, FrameFailure, FrameResult
from ..metrics import Metrics
from ..os_threads import name_os_thread
from ..own_clock import OwnClock
from ..protocol.audio import float_to_pcm16
from ..protocol.errors import new_error_id, withheld
from .joins import UNFINISHED, Job, JobQueue
from .loading import EngineLoad
from .slow_ticks import SlowTicks
from .tick_policy import FRAME_PERIOD_S, PacedPolicy, TickState, WindowPolicy

log = logging.getLogger(__name__)

JOBS_STALLED_PAUSE_S = 0.005

TICK_TIME_SMOOTHING = 0.2  # weight of the newest tick in the moving average the policy reads


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter has cancelled it meanwhile (not an error here)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class LaneFrame(NamedTuple):
    """One input frame queued on a lane."""

    pcm: np.ndarray  # float32 [1920]
    arrival: float  # scheduler clock
    silent: bool  # fed silence (the client's audio stalled), not client audio


class BatchItem(NamedTuple):
    """One lane's frame in a tick, with the epoch it was taken for."""

    lane: "_Lane"
    epoch: int
    pcm: np.ndarray
    arrival: float
    silent: bool


@dataclass(frozen=True)
class TickAction:
    batch: list[BatchItem]


@dataclass(frozen=True)
class JobAction:
    job: Job


@dataclass(frozen=True)
class CloseAction:
    closes: list[tuple[str, concurrent.futures.Future]]


Action = TickAction | JobAction | CloseAction  # what the engine thread does next (_next_action)


class _Lane:
    def __init__(self, key: str, slot: int, spec: SessionSpec, now: float) -> None:
        self.key = key
        self.slot = slot
        self.spec = spec  # what a restart prepares again
        self.epoch = 0  # epoch the slot's model context belongs to
        self.want_epoch = 0  # epoch the session asked for; a restart is due while they differ
        self.restart_queued = False
        self.frames: deque[LaneFrame] = deque()
        self.stalled_since = now  # queue empty since, with no new input
        self.next_silence: float | None = None  # once feeding silence: when the next one is due
        self.closing = False

    @property
    def live(self) -> bool:
        return not self.closing and self.epoch == self.want_epoch


class TickScheduler:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        policy: WindowPolicy | PacedPolicy,
        silence_grace_s: float,
        warmup_frames: int,
        metrics: Metrics,
        device: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        concurrent_joins: int = 1,
        join_wait_s: float = 30.0,
    ) -> None:
        # ``device``: the label of this engine's device (one scheduler per device), for the
        # thread's name, the logs and the per-device metrics; None in single-engine tests.
        self.device = device
        self._policy = policy
        self._tick_s = 0.0  # moving average of engine.step time per tick (read by the policy)
        self._grace = silence_grace_s
        self._metrics = metrics
        self._clock = clock
        self._cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._closes: deque[tuple[str, concurrent.futures.Future]] = deque()
        self._closed_since_take = False  # closes ran since the latest tick took its frames
        # Expensive control work (prefills of opens and restarts), a piece at a time in turn,
        # at most ``concurrent_joins`` under way (lockstep/joins.py).
        self._jobs = JobQueue(concurrent_joins, join_wait_s, _settle)
        self._after_tick = False
        self._last_take = float("-inf")  # when the latest tick's frames were taken
        self._live_at_take = 0  # live lanes when the latest tick's frames were taken (batch fill)
        self._stopping = False
        self._ticks = 0
        # Ticks long enough to be heard, each explained in the log (garbage collections, the
        # engine's allocator counters): slow_ticks.py.
        self._slow_ticks = SlowTicks(clock=clock, device=device)
        self._silence = np.zeros(FRAME_SAMPLES, dtype=np.float32)
        self._thread: threading.Thread | None = None
        self._hand_back: Callable[[list], None] = lambda results: None
        # Loading the engine, and what it gave: ready (set when loading finished, successfully
        # or not), load_error, info, voices, memory_plan.
        self.load = EngineLoad(engine_factory, warmup_frames, device)
        self.ready = self.load.ready
        self.busy: EngineCall | None = None  # written by the engine thread only
        # Slots the engine itself holds (its max_slots - free_slots()), written by the engine
        # thread after every open and close: what admission reports is never below it, so a
        # slot the engine lost cannot be counted free.
        self.slots_taken = 0
        self.failed_ticks_in_row = 0  # ticks in a row that produced no output at all

    # Lifecycle (event loop side) --------------------------------------------------------------
    def start(self, hand_back: Callable[[list], None]) -> None:
        """Start the engine thread; it calls ``hand_back(results)`` (from the engine thread,
        once per tick or failure) with a list of ``FrameResult``/``FrameFailure``: the caller
        moves them to where the sessions live (an event loop, or a socket to the workers)."""
        self._hand_back = hand_back
        name = "personaplex-engine" + (f"-{self.device}" if self.device else "")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def request_stop(self) -> None:
        """Ask the engine thread to finish (after its current call) without waiting for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    @property
    def load_error(self) -> BaseException | None:
        return self.load.error

    @property
    def info(self) -> EngineInfo | None:
        return self.load.info

    @property
    def voices(self) -> tuple[str, ...]:
        return self.load.voices

    @property
    def memory_plan(self) -> dict[str, Any] | None:
        return self.load.memory_plan

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.load_error is None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # Session commands (event loop side, thread-safe, never block on the engine) ---------------
    def open(self, key: str, spec: SessionSpec) -> concurrent.futures.Future:
        """Validate, prepare and install ``spec`` in a new slot; the future gives the slot id
        or the engine's ``EngineError``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._jobs.add(Job("open", key, spec, future, queued_at=self._clock()))
            self._cond.notify()
        return future

    def restart(self, key: str, epoch: int) -> None:
        """Start ``epoch``: drop queued frames of older epochs, replay the prefill before the
        lane's next frame."""
        with self._cond:
            lane = self._lanes.get(key)
            if lane is None or lane.closing or lane.want_epoch == epoch:
                return  # gone, or this restart was already started by a fault (_suspend)
            self._want_restart(lane, epoch)
            self._cond.notify()

    def _want_restart(self, lane: _Lane, epoch: int) -> None:
        """Under the lock: drop the lane's queued frames and queue a restart into ``epoch``."""
        lane.want_epoch = epoch
        lane.frames.clear()
        if not lane.restart_queued:
            lane.restart_queued = True
            self._jobs.add(Job("restart", lane.key))

    def close(self, key: str) -> concurrent.futures.Future:
        """Release the lane's slot (or cancel its pending open); the future resolves once the
        engine slot is free."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            lane = self._lanes.get(key)
            if lane is not None:
                lane.closing = True
                lane.frames.clear()
            self._closes.append((key, future))
            self._cond.notify()
        return future

    def push(self, key: str, epoch: int, frames: np.ndarray) -> None:
        """Queue client frames (float32 [n, 1920]) of ``epoch``; stale epochs are dropped."""
        now = self._clock()
        with self._cond:
            lane = self._lanes.get(key)
            if lane is None or lane.closing or epoch != lane.want_epoch:
                return
            if lane.frames and lane.frames[0].silent:  # client audio is back: skip queued silence
                lane.frames.popleft()
            lane.frames.extend(LaneFrame(frame, now, False) for frame in frames)
            lane.next_silence = None
            self._cond.notify()
        self._metrics.inc("frames_in", "client", len(frames))

    def drop_pending(self, key: str) -> None:
        """Forget queued, not yet stepped frames (input_audio_buffer.clear)."""
        with self._cond:
            lane = self._lanes.get(key)
            if lane is not None:
                lane.frames.clear()
                lane.stalled_since = self._clock()
                lane.next_silence = None

    def pending(self, key: str) -> int:
        with self._cond:
            lane = self._lanes.get(key)
            return len(lane.frames) if lane is not None else 0

    # The engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("ppengine" + (f"-{self.device}" if self.device else ""))
        engine = self.load.run()
        if engine is None:
            return
        own_clock = OwnClock()  # this thread's: a job's cost without a busy host's waits
        # An engine may count what its device's allocator did (EngineRuntime.allocator_counters).
        self._slow_ticks.start(getattr(engine, "allocator_counters", None))
        try:
            self._serve(engine, own_clock)
        finally:
            own_clock.close()
            self._slow_ticks.stop()
        self._close(engine, [(key, concurrent.futures.Future()) for key in list(self._lanes)])

    def _serve(self, engine: Engine, own_clock: OwnClock) -> None:
        """Ticks and control work in turn until stopped."""
        while True:
            action = self._next_action()
            if action is None:
                return
            if isinstance(action, TickAction):
                self._tick(engine, action.batch)
                self._after_tick = True
                continue
            job = action.job if isinstance(action, JobAction) else None
            label = job.kind if job is not None else "close"
            start, own_start = self._clock(), own_clock.now()
            self.busy = EngineCall(label, start, 1 if job is not None else len(action.closes))
            try:
                if job is None:
                    self._close(engine, action.closes)
                else:
                    finished = self._job(engine, job)
                    with self._cond:
                        after = self._jobs.after_piece(job, finished)
                        if after == "next":
                            self._after_tick = True
                        elif after == "pause":
                            self._cond.wait(JOBS_STALLED_PAUSE_S)
            finally:
                self.busy = None
                if job is None or not job.waited:  # a piece that waited did no engine work
                    self._metrics.observe_engine_job(label, self._clock() - start, own_clock.now() - own_start)

    def loading_status(self) -> dict[str, Any] | None:
        """The phase and progress of a load under way (None once it has finished)."""
        return self.load.status()

    def _next_action(self) -> Action | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = self._clock()
                silence_due = self._feed_silence(now)
                live = [lane for lane in self._lanes.values() if lane.live]
                ready = [lane for lane in live if lane.frames]
                # Closes first, all of them in one call; but once a tick is due, one such call
                # before it at most (closes that keep arriving must not starve the live lanes).
                if self._closes and (not ready or not self._closed_since_take):
                    return self._take_closes()
                job = self._jobs.take(now) if self._jobs and (self._after_tick or not ready) else None
                if job is not None:
                    self._after_tick = False
                    return JobAction(job)
                oldest = min(lane.frames[0].arrival for lane in ready) if ready else None
                decision = self._policy.decide(TickState(now, len(live), len(ready), oldest, self._last_take,
                                                         self._tick_s))
                if decision.tick:
                    self._live_at_take = len(live)
                    self._closed_since_take = False
                    return TickAction(self._take(ready, now))
                if self._closes:  # no tick due yet: the gap is free
                    return self._take_closes()
                wait = decision.wait_s
                if silence_due is not None:
                    wait = silence_due - now if wait is None else min(wait, silence_due - now)
                self._cond.wait(wait)

    def _take_closes(self) -> CloseAction:
        """Under the lock: every queued close, for one engine call."""
        closes = list(self._closes)
        self._closes.clear()
        self._closed_since_take = True
        return CloseAction(closes)

    def _feed_silence(self, now: float) -> float | None:
        """Queue silence for stalled lanes; returns the next time one falls due (or None)."""
        if self._grace <= 0:
            return None
        next_due = None
        for lane in self._lanes.values():
            if not lane.live or lane.frames:
                continue
            due = lane.next_silence if lane.next_silence is not None else lane.stalled_since + self._grace
            if now >= due:
                lane.frames.append(LaneFrame(self._silence, due, True))
                # No catch-up burst after a long tick: the next one is a period from now at most.
                lane.next_silence = max(due + FRAME_PERIOD_S, now)
            else:
                next_due = due if next_due is None else min(next_due, due)
        return next_due

    def _take(self, ready: Sequence[_Lane], now: float) -> list[BatchItem]:
        self._last_take = now
        batch = []
        for lane in ready:
            frame = lane.frames.popleft()
            if not lane.frames and not frame.silent:
                lane.stalled_since = now
            batch.append(BatchItem(lane, lane.epoch, frame.pcm, frame.arrival, frame.silent))
        return batch

    def _tick(self, engine: Engine, batch: list[BatchItem]) -> None:
        slots = [item.lane.slot for item in batch]
        pcm = np.stack([item.pcm for item in batch])
        start = self._clock()
        self.busy = EngineCall("tick", start, len(batch))
        try:
            try:
                outputs = engine.step(slots, pcm)
            finally:
                self.busy = None
            if len(outputs) != len(batch):
                raise RuntimeError(f"engine.step returned {len(outputs)} outputs for {len(batch)} slots")
        except SlotFault as fault:
            batch, outputs = self._slot_fault(batch, fault)
            if not batch:
                return
        except Exception as exc:  # noqa: BLE001 - one failed tick must not kill the server
            self._batch_fault(batch, exc)
            return
        try:
            self._hand_back_outputs(batch, outputs, start)
        except Exception as exc:  # noqa: BLE001 - malformed outputs: nobody gets this tick's frame
            self._batch_fault(batch, exc)

    def _hand_back_outputs(self, batch: list[BatchItem], outputs: list[FrameOutput], start: float) -> None:
        self.failed_ticks_in_row = 0
        seconds = self._clock() - start
        typical_s = self._tick_s
        self._ticks += 1
        self._tick_s = seconds if self._ticks == 1 else (
            TICK_TIME_SMOOTHING * seconds + (1.0 - TICK_TIME_SMOOTHING) * self._tick_s)
        pcm16 = float_to_pcm16(np.stack([out.pcm for out in outputs]))
        silent_inputs = sum(1 for item in batch if item.silent)
        self._metrics.observe_tick(seconds, len(batch), silent_inputs, device=self.device, live=self._live_at_take)
        tick_ms = seconds * 1e3
        self._hand_back([
            FrameResult(item.lane.key, item.epoch, pcm16[i], out.text, int(out.text_id), item.silent, self._ticks,
                        tick_ms, len(batch), (start - item.arrival) * 1e3)
            for i, (item, out) in enumerate(zip(batch, outputs))
        ])
        try:  # after the frames have gone: a slow tick's log line waits, they do not
            self._slow_ticks.note(start, seconds, len(batch), typical_s)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail the tick it describes
            log.debug("could not explain a slow tick: %s", exc)

    def _slot_fault(self, batch: list[BatchItem], fault: SlotFault) -> tuple[list[BatchItem], list[FrameOutput]]:
        """Fail the lanes ``fault`` names; returns the lanes that did advance, with outputs."""
        failed = set(fault.slots)
        if not failed & {item.lane.slot for item in batch} or (fault.outputs is not None
                                                              and len(fault.outputs) != len(batch)):
            self._batch_fault(batch, fault)  # it names nobody in this tick, or is malformed: no trust
            return [], []
        self._metrics.inc("tick_failures", "slots")
        error_id = new_error_id()
        log.error("engine.step failed for slot(s) %s of a %d-slot tick [%s]: %s", sorted(failed), len(batch), error_id,
                  fault)
        message = withheld("the model failed on this session's frame; its context was restarted", error_id)
        failures, kept, outputs = [], [], []
        with self._cond:
            for i, item in enumerate(batch):
                lane = item.lane
                if lane.slot in failed:
                    failures.append(self._suspend(lane, item.epoch, message))
                elif fault.outputs is None:
                    if lane.live:  # nothing advanced: step this frame again next tick
                        lane.frames.appendleft(LaneFrame(item.pcm, item.arrival, item.silent))
                elif fault.outputs[i] is not None:
                    kept.append(item)
                    outputs.append(fault.outputs[i])
        if not kept:
            self.failed_ticks_in_row += 1
        self._hand_back(failures)
        return kept, outputs

    def _batch_fault(self, batch: list[BatchItem], exc: BaseException) -> None:
        """The engine cannot say which lane failed: fail them all, keep serving."""
        self._metrics.inc("tick_failures", "batch")
        self.failed_ticks_in_row += 1
        error_id = new_error_id()
        log.error("engine.step failed on a %d-slot tick and the failing session cannot be identified: failing and "
                  "restarting all %d sessions of the tick [%s]", len(batch), len(batch), error_id, exc_info=exc)
        message = withheld(f"the model failed on a tick shared by {len(batch)} sessions; which session caused it is "
                           "unknown, so every one of them was restarted", error_id)
        with self._cond:
            failures = [self._suspend(item.lane, item.epoch, message) for item in batch]
        self._hand_back(failures)

    def _suspend(self, lane: _Lane, epoch: int, message: str) -> FrameFailure:
        """Under the lock: stop stepping a failed lane's suspect context; restart it into the
        next epoch (the session learns the same from the FrameFailure)."""
        if not lane.closing and lane.want_epoch <= epoch:
            self._want_restart(lane, epoch + 1)
        return FrameFailure(lane.key, epoch, message)

    def _close(self, engine: Engine, closes: list[tuple[str, concurrent.futures.Future]]) -> None:
        """Release the slots of ``closes`` (keys with their futures) in one engine call."""
        slots: list[int] = []
        with self._cond:
            for key, _ in closes:
                lane = self._lanes.pop(key, None)
                if lane is not None:
                    slots.append(lane.slot)
                    continue
                self._jobs.cancel_opens(key)  # not opened yet: cancel the open (and its prefill) instead
        error = None
        try:
            if slots:
                engine.close_slots(slots)
        except Exception as exc:  # noqa: BLE001
            log.exception("close_slot(%s) failed", slots)
            error = exc
        self._count_slots(engine)  # before the waiters hear of it: they report the count
        for _, future in closes:
            _settle(future, error=error)

    def _count_slots(self, engine: Engine) -> None:
        self.slots_taken = engine.info.max_slots - engine.free_slots()

    def _job(self, engine: Engine, job: Job) -> bool:
        """Run the next piece of ``job``; True once it is finished (done, failed or moot)."""
        if job.kind == "open":
            return self._open_piece(engine, job)
        return self._restart_piece(engine, job)

    def _open_piece(self, engine: Engine, job: Job) -> bool:
        try:
            prefill = job.next_piece(engine, job.spec)
            if prefill is UNFINISHED:
                return False
            slot = engine.open_slot(job.spec, prefill)
        except Exception as exc:  # noqa: BLE001 - EngineError subclasses carry the client code
            self._count_slots(engine)
            _settle(job.future, error=exc)
            return True
        self._count_slots(engine)
        with self._cond:
            # Installed even if the waiter went away: its close follows and frees the slot.
            self._lanes[job.key] = _Lane(job.key, slot, job.spec, self._clock())
        _settle(job.future, slot)
        return True

    def _restart_piece(self, engine: Engine, job: Job) -> bool:
        with self._cond:
            lane = self._lanes.get(job.key)
            if lane is None or lane.closing:
                job.drop()
                return True
        try:
            prefill = job.next_piece(engine, lane.spec)
        except Exception:  # noqa: BLE001
            error_id = new_error_id()
            log.exception("preparing the restart of slot %s failed [%s]", lane.slot, error_id)
            self._restart_failed(lane, error_id)
            return True
        if prefill is UNFINISHED:
            return False
        with self._cond:
            # The epoch asked for by now: a restart asked for while this one was being
            # prepared is the same work (its frames were dropped already).
            lane.restart_queued = False
            target = lane.want_epoch
        try:
            engine.restart_slot(lane.slot, prefill)
        except Exception:  # noqa: BLE001
            error_id = new_error_id()
            log.exception("restart_slot(%s) failed [%s]", lane.slot, error_id)
            self._restart_failed(lane, error_id, target)
            return True
        with self._cond:
            lane.epoch = target
            lane.stalled_since = self._clock()
            lane.next_silence = None
        return True

    def _restart_failed(self, lane: _Lane, error_id: str, target: int | None = None) -> None:
        with self._cond:
            lane.restart_queued = False
            target = lane.want_epoch if target is None else target
        self._hand_back([FrameFailure(lane.key, target, withheld("restart of the model context failed", error_id),
                                      fatal=True)])
