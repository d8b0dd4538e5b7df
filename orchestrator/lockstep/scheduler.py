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
import ctypes
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from engines import progress
from engines.config import FRAME_SAMPLES, ConfigError
from engines.errors import AudioInputError, CheckpointError, MemoryPlanError
from engines.interface import WAITING, Engine, EngineError, EngineInfo, FrameOutput, Pieces, SessionSpec, SlotFault

from ..engine_port import EngineCall, FrameFailure, FrameResult
from ..metrics import Metrics
from ..own_clock import OwnClock
from ..protocol.audio import float_to_pcm16
from ..protocol.errors import new_error_id, withheld
from .tick_policy import FRAME_PERIOD_S, PacedPolicy, TickState, WindowPolicy

log = logging.getLogger(__name__)

# Load failures caused by the checkpoint, a voice or the machine (not by this code): logged as
# one line (the server stays up; /health says why).
_INPUT_LOAD_ERRORS = (CheckpointError, ConfigError, AudioInputError, OSError, MemoryError, MemoryPlanError)

_UNFINISHED = object()  # a job's preparation has pieces left
JOBS_STALLED_PAUSE_S = 0.005

TICK_TIME_SMOOTHING = 0.2  # weight of the newest tick in the moving average the policy reads


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: what ``top -H``, ``ps -L`` and
    ``/proc/PID/task/TID/comm`` show; 15 bytes at most), so an operator can tell the engine
    thread's CPU from the event loop's.  Python's own thread names stay inside Python."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode("ascii", "replace")[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, or no prctl: a cosmetic loss only
        pass


PR_SET_NAME = 15


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its waiter has cancelled it meanwhile (not an error here)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class JoinTurnTimeout(EngineError):
    """An open that waited longer than ``join_wait_s`` for its turn to be prepared: the server
    is preparing as many joins as its memory plan allows (retryable)."""

    code = "resource_exhausted"
    reason = "join_wait_timeout"  # personaplex_open_failures_total{reason}


@dataclass
class _Job:
    """Control work that may take several pieces: opening a lane, or restarting one."""

    kind: str  # open | restart
    key: str
    spec: SessionSpec | None = None  # open: what to open
    future: concurrent.futures.Future | None = None  # open: settled with the slot or the error
    pieces: Pieces | None = None  # the preparation under way, once its first piece ran
    waited: bool = False  # its last piece did nothing (engines.interface.WAITING)
    queued_at: float = 0.0  # when it was asked for (an open's wait for its turn is bounded)

    @property
    def started(self) -> bool:
        """Whether its preparation is under way (and may hold device memory for it)."""
        return self.pieces is not None


class _Lane:
    def __init__(self, key: str, slot: int, spec: SessionSpec, now: float) -> None:
        self.key = key
        self.slot = slot
        self.spec = spec  # what a restart prepares again
        self.epoch = 0  # epoch the slot's model context belongs to
        self.want_epoch = 0  # epoch the session asked for; a restart is due while they differ
        self.restart_queued = False
        self.frames: deque[tuple[np.ndarray, float, bool]] = deque()  # (pcm, arrival, is_silence)
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
        self._factory = engine_factory
        self._policy = policy
        self._tick_s = 0.0  # moving average of engine.step time per tick (read by the policy)
        self._grace = silence_grace_s
        self._warmup_frames = warmup_frames
        self._metrics = metrics
        self._clock = clock
        self._cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._closes: deque[tuple[str, concurrent.futures.Future]] = deque()
        self._closed_since_take = False  # closes ran since the latest tick took its frames
        self._jobs: deque[_Job] = deque()  # expensive control work, a piece at a time in turn
        # Preparations under way at once, at most: the engine's memory plan reserves the
        # longest prompt's peak for each (engines/runtime/memory_plan.py).  An open waits for
        # its turn at most ``join_wait_s``, then is refused (JoinTurnTimeout), never allocated.
        self._concurrent_joins = concurrent_joins
        self._join_wait_s = join_wait_s
        self._after_tick = False
        self._waits_in_row = 0  # jobs in turn whose piece waited for another's
        self._last_take = float("-inf")  # when the latest tick's frames were taken
        self._live_at_take = 0  # live lanes when the latest tick's frames were taken (batch fill)
        self._stopping = False
        self._ticks = 0
        self._silence = np.zeros(FRAME_SAMPLES, dtype=np.float32)
        self._thread: threading.Thread | None = None
        self._hand_back: Callable[[list], None] = lambda results: None
        self.ready = threading.Event()  # set when loading finished, successfully or not
        self.load_error: BaseException | None = None
        # Where loading is (engines/progress.py), and since when: for /ready while it loads.
        self.load_progress: progress.LoadProgress | None = None
        self.load_started: float | None = None
        self.info: EngineInfo | None = None
        self.memory_plan: dict[str, Any] | None = None  # the engine's, measured (for /ready)
        self.voices: tuple[str, ...] = ()
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
            self._jobs.append(_Job("open", key, spec, future, queued_at=self._clock()))
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
            self._jobs.append(_Job("restart", lane.key))

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
            if lane.frames and lane.frames[0][2]:  # client audio is back: skip queued silence
                lane.frames.popleft()
            lane.frames.extend((frame, now, False) for frame in frames)
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
        engine = self._load()
        if engine is None:
            return
        own_clock = OwnClock()  # this thread's: a job's cost without a busy host's waits
        try:
            self._serve(engine, own_clock)
        finally:
            own_clock.close()
        self._close(engine, [(key, concurrent.futures.Future()) for key in list(self._lanes)])

    def _serve(self, engine: Engine, own_clock: OwnClock) -> None:
        """Ticks and control work in turn until stopped."""
        while True:
            action = self._next_action()
            if action is None:
                return
            kind = action[0]
            if kind == "tick":
                self._tick(engine, action[1])
                self._after_tick = True
                continue
            job = action[1] if kind == "job" else None
            label = job.kind if job is not None else kind
            start, own_start = self._clock(), own_clock.now()
            self.busy = EngineCall(label, start, 1 if job is not None else len(action[1]))
            try:
                if job is None:
                    self._close(engine, action[1])
                elif not self._job(engine, job):
                    with self._cond:  # unfinished: its next piece after the other jobs' turns
                        self._jobs.append(job)
                        self._after_waiting(job)
                else:
                    self._waits_in_row = 0
            finally:
                self.busy = None
                if job is None or not job.waited:  # a piece that waited did no engine work
                    self._metrics.observe_engine_job(label, self._clock() - start, own_clock.now() - own_start)

    def loading_status(self) -> dict[str, Any] | None:
        """The phase and progress of a load under way (None once it has finished)."""
        current, started = self.load_progress, self.load_started
        if self.ready.is_set() or started is None:
            return None
        body = current.as_dict() if current is not None else {"phase": "starting"}
        body["elapsed_s"] = round(time.monotonic() - started, 1)
        return body

    def _on_progress(self, report: progress.LoadProgress) -> None:
        previous, self.load_progress = self.load_progress, report
        if previous is None or previous.phase != report.phase:  # the steps of a phase: /ready shows them
            log.info("loading (device %s): %s%s", self.device, report.phase, f": {report.detail}" if report.detail
                     else "")

    def _load(self) -> Engine | None:
        self.load_started = time.monotonic()
        try:
            with progress.listening(self._on_progress):
                engine = self._factory()
                self.voices = tuple(engine.voices())
                self._warm_up(engine)
                # A GPU engine captures (and compiles) its tick per batch size on first use:
                # seconds that would stall every live session (and trip the watchdog) when the
                # load first grows.  Pay them all here, before /ready, warm-up or not (and
                # before the memory plan measures the graphs).
                engine.capture_graphs()
                # The plan's items measured (graph pools, the longest join's peak): a plan that
                # does not fit ends the load with one line saying what does.
                plan = engine.settle_memory_plan() if hasattr(engine, "settle_memory_plan") else None
                self.memory_plan = plan.as_dict() if plan is not None else None
        except BaseException as exc:  # noqa: BLE001 - reported through /health and opens
            if isinstance(exc, _INPUT_LOAD_ERRORS) or type(exc).__name__ == "OutOfMemoryError":
                # What the operator gave or has (files, memory): their message says it all.
                log.error("engine failed to load (device %s): %s", self.device, exc)
            else:  # a defect: keep the traceback
                log.exception("engine failed to load (device %s)", self.device)
            # Without its traceback: the frames would keep the half-built engine (and its
            # device memory) alive while the server reports the failure.
            exc.__traceback__ = None
            if exc.__cause__ is not None:
                exc.__cause__.__traceback__ = None
            self.load_error = exc
            self.ready.set()
            return None
        self.info = engine.info
        self.ready.set()
        log.info("engine ready: model=%s backend=%s device=%s slots=%d", engine.info.model, engine.info.backend,
                 self.device or engine.info.device, engine.info.max_slots)
        return engine

    def _warm_up(self, engine: Engine) -> None:
        """Step a throwaway slot with silence so the first real session pays no one-time cost
        (lazy allocations, kernel selection, the default prefill)."""
        if self._warmup_frames <= 0:
            return
        progress.report(progress.WARM_UP, f"{self._warmup_frames} frames of silence")
        start = time.perf_counter()
        slot = engine.open_slot(SessionSpec())
        try:
            for _ in range(self._warmup_frames):
                engine.step([slot], self._silence[None, :])
        finally:
            engine.close_slot(slot)
        log.info("warm-up: %d frames in %.0f ms", self._warmup_frames, (time.perf_counter() - start) * 1e3)

    def _next_action(self) -> tuple[Any, ...] | None:
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
                job = self._next_job(now) if self._jobs and (self._after_tick or not ready) else None
                if job is not None:
                    self._after_tick = False
                    return ("job", job)
                oldest = min(lane.frames[0][1] for lane in ready) if ready else None
                decision = self._policy.decide(TickState(now, len(live), len(ready), oldest, self._last_take,
                                                         self._tick_s))
                if decision.tick:
                    self._live_at_take = len(live)
                    self._closed_since_take = False
                    return ("tick", self._take(ready, now))
                if self._closes:  # no tick due yet: the gap is free
                    return self._take_closes()
                wait = decision.wait_s
                if silence_due is not None:
                    wait = silence_due - now if wait is None else min(wait, silence_due - now)
                self._cond.wait(wait)

    def _next_job(self, now: float) -> _Job | None:
        """Under the lock: the next job to run a piece of, in turn, among those under way and,
        while fewer than ``concurrent_joins`` are, the longest waiting; opens that waited past
        ``join_wait_s`` for their turn are refused here."""
        expired = [job for job in self._jobs
                   if not job.started and job.kind == "open" and now - job.queued_at > self._join_wait_s]
        for job in expired:
            self._jobs.remove(job)
            log.warning("open of %s refused: no turn to prepare it within %g s (%d joins under way)", job.key,
                        self._join_wait_s, self._concurrent_joins)
            _settle(job.future, error=JoinTurnTimeout(
                f"the server is preparing other sessions and had no turn for this one within "
                f"{self._join_wait_s:g} s; try again"))
        under_way = sum(1 for job in self._jobs if job.started)
        for job in self._jobs:
            if job.started or under_way < self._concurrent_joins:
                self._jobs.remove(job)
                return job
        return None

    def _take_closes(self) -> tuple[str, list[tuple[str, concurrent.futures.Future]]]:
        """Under the lock: every queued close, for one engine call."""
        closes = list(self._closes)
        self._closes.clear()
        self._closed_since_take = True
        return ("close", closes)

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
                lane.frames.append((self._silence, due, True))
                # No catch-up burst after a long tick: the next one is a period from now at most.
                lane.next_silence = max(due + FRAME_PERIOD_S, now)
            else:
                next_due = due if next_due is None else min(next_due, due)
        return next_due

    def _take(self, ready: Sequence[_Lane], now: float) -> list[tuple[_Lane, int, np.ndarray, float, bool]]:
        self._last_take = now
        batch = []
        for lane in ready:
            frame, arrival, silent = lane.frames.popleft()
            if not lane.frames and not silent:
                lane.stalled_since = now
            batch.append((lane, lane.epoch, frame, arrival, silent))
        return batch

    def _tick(self, engine: Engine, batch: list[tuple[_Lane, int, np.ndarray, float, bool]]) -> None:
        slots = [lane.slot for lane, *_ in batch]
        pcm = np.stack([frame for _, _, frame, _, _ in batch])
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

    def _hand_back_outputs(self, batch: list, outputs: list[FrameOutput], start: float) -> None:
        self.failed_ticks_in_row = 0
        seconds = self._clock() - start
        self._ticks += 1
        self._tick_s = seconds if self._ticks == 1 else (
            TICK_TIME_SMOOTHING * seconds + (1.0 - TICK_TIME_SMOOTHING) * self._tick_s)
        pcm16 = float_to_pcm16(np.stack([out.pcm for out in outputs]))
        silent_inputs = sum(1 for *_, silent in batch if silent)
        self._metrics.observe_tick(seconds, len(batch), silent_inputs, device=self.device, live=self._live_at_take)
        tick_ms = seconds * 1e3
        self._hand_back([
            FrameResult(lane.key, epoch, pcm16[i], out.text, int(out.text_id), silent, self._ticks, tick_ms,
                        len(batch), (start - arrival) * 1e3)
            for i, ((lane, epoch, _, arrival, silent), out) in enumerate(zip(batch, outputs))
        ])

    def _slot_fault(self, batch: list, fault: SlotFault) -> tuple[list, list[FrameOutput]]:
        """Fail the lanes ``fault`` names; returns the lanes that did advance, with outputs."""
        failed = set(fault.slots)
        if not failed & {lane.slot for lane, *_ in batch} or (fault.outputs is not None
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
                lane, epoch, frame, arrival, silent = item
                if lane.slot in failed:
                    failures.append(self._suspend(lane, epoch, message))
                elif fault.outputs is None:
                    if lane.live:  # nothing advanced: step this frame again next tick
                        lane.frames.appendleft((frame, arrival, silent))
                elif fault.outputs[i] is not None:
                    kept.append(item)
                    outputs.append(fault.outputs[i])
        if not kept:
            self.failed_ticks_in_row += 1
        self._hand_back(failures)
        return kept, outputs

    def _batch_fault(self, batch: list, exc: BaseException) -> None:
        """The engine cannot say which lane failed: fail them all, keep serving."""
        self._metrics.inc("tick_failures", "batch")
        self.failed_ticks_in_row += 1
        error_id = new_error_id()
        log.error("engine.step failed on a %d-slot tick and the failing session cannot be identified: failing and "
                  "restarting all %d sessions of the tick [%s]", len(batch), len(batch), error_id, exc_info=exc)
        message = withheld(f"the model failed on a tick shared by {len(batch)} sessions; which session caused it is "
                           "unknown, so every one of them was restarted", error_id)
        with self._cond:
            failures = [self._suspend(lane, epoch, message) for lane, epoch, *_ in batch]
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
                # Not opened yet: cancel the pending open (and drop its prefill) instead.
                for job in [job for job in self._jobs if job.kind == "open" and job.key == key]:
                    self._jobs.remove(job)
                    job.future.cancel()
                    self._drop(job)
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

    def _after_waiting(self, job: _Job) -> None:
        """Under the lock, after ``job``'s piece: a piece that waited spent no engine time, so
        the next job may have this gap; once every job in turn has waited (none can advance,
        which the engine's contract rules out), pause briefly rather than spin."""
        if not job.waited:
            self._waits_in_row = 0
            return
        self._waits_in_row += 1
        if self._waits_in_row < len(self._jobs):
            self._after_tick = True
        else:
            self._waits_in_row = 0
            self._cond.wait(JOBS_STALLED_PAUSE_S)

    def _job(self, engine: Engine, job: _Job) -> bool:
        """Run the next piece of ``job``; True once it is finished (done, failed or moot)."""
        if job.kind == "open":
            return self._open_piece(engine, job)
        return self._restart_piece(engine, job)

    def _open_piece(self, engine: Engine, job: _Job) -> bool:
        try:
            prefill = self._prepare_piece(engine, job, job.spec)
            if prefill is _UNFINISHED:
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

    def _restart_piece(self, engine: Engine, job: _Job) -> bool:
        with self._cond:
            lane = self._lanes.get(job.key)
            if lane is None or lane.closing:
                self._drop(job)
                return True
        try:
            prefill = self._prepare_piece(engine, job, lane.spec)
        except Exception:  # noqa: BLE001
            error_id = new_error_id()
            log.exception("preparing the restart of slot %s failed [%s]", lane.slot, error_id)
            self._restart_failed(lane, error_id)
            return True
        if prefill is _UNFINISHED:
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

    @staticmethod
    def _drop(job: _Job) -> None:
        """Stop ``job``'s preparation now: what it holds (a device cache, the engine's piece
        graph) is given back at once, not whenever the generator is collected."""
        if job.pieces is not None:
            job.pieces.close()

    @staticmethod
    def _prepare_piece(engine: Engine, job: _Job, spec: SessionSpec) -> Any:
        """The next piece of ``job``'s preparation of ``spec``: its result once the last piece
        ran, else ``_UNFINISHED``; raises what preparing raised."""
        if job.pieces is None:
            job.pieces = engine.prepare_in_pieces(spec)
        try:
            job.waited = next(job.pieces) is WAITING
        except StopIteration as done:
            return done.value
        return _UNFINISHED

    def _restart_failed(self, lane: _Lane, error_id: str, target: int | None = None) -> None:
        with self._cond:
            lane.restart_queued = False
            target = lane.want_epoch if target is None else target
        self._hand_back([FrameFailure(lane.key, target, withheld("restart of the model context failed", error_id),
                                      fatal=True)])
