"""One device's engine process: its lockstep scheduler and engine behind one socket.

No websocket, no client JSON and no event loop run here: the interpreter belongs to the
engine thread (``TickScheduler``) and to this module's IPC thread, which

- receives the workers' commands and audio on a ZeroMQ ROUTER (``ipc/wire.py``) and hands
  them to the scheduler (thread-safe, non-blocking calls);
- owns **admission for the whole server**: an ``OPEN`` is admitted or refused here, at once,
  whichever worker sent it, so exactly ``max_sessions`` sessions hold this device's slots;
  a slot is held from the admitted open until the engine has released it;
- sends each tick's output to the workers that own its lanes (one ``FRAMES`` per worker
  per tick) and a ``STATUS`` heartbeat to every worker every ``HEARTBEAT_S``;
- closes the sessions of a worker that has gone (its pid is dead, or it has been silent
  for ``PEER_TIMEOUT_S``): a worker that dies loses only its own sessions.

The scheduler thread hands results back through a queue and an eventfd-like pipe that the
IPC thread polls beside its socket, so neither thread ever waits on the other.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from ..engine_port import FrameFailure, FrameResult
from ..ipc import wire
from ..ipc.endpoints import engine_endpoint, engine_socket_path, pid_alive
from ..watchdog import Watchdog
from ..metrics import Metrics, mark_process_dead
from ..protocol.errors import capacity_exhausted, counted_failure, engine_failure, new_error_id, withheld

log = logging.getLogger(__name__)

_MAX_MESSAGES_PER_POLL = 256  # bounds one pass so heartbeats and results keep their pace


@dataclass
class _Worker:
    identity: bytes
    pid: int = 0
    last_seen: float = 0.0
    keys: set[str] = field(default_factory=set)


class EngineProcess:
    def __init__(self, run_dir: Path, index: int, label: str, max_sessions: int | None, scheduler: Any, *,
                 metrics: Metrics, watchdog_deadline_s: float = 0.0) -> None:
        # Stalls are counted (and logged) here, once: each worker's own watchdog only warns
        # its sessions, since counting there would count a stall once per worker.
        self._watchdog = (Watchdog(scheduler, watchdog_deadline_s, metrics, lambda call, elapsed: None)
                          if watchdog_deadline_s > 0 else None)
        self.run_dir = run_dir
        self.index = index
        self.label = label
        self._configured_sessions = max_sessions  # None: the engine's memory plan decides
        self.scheduler = scheduler
        self._metrics = metrics
        self._load_error_logged: str | None = None  # the error id the load failure was logged under
        self._context = zmq.Context.instance()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished worker's messages are dropped
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # from the scheduler thread
        self._workers: dict[bytes, _Worker] = {}
        self._owner: dict[str, bytes] = {}  # admitted session key -> its worker (the admission)
        self._stopping = threading.Event()
        self._pid = os.getpid()

    # Start-up -----------------------------------------------------------------------------------
    def bind(self) -> None:
        path = engine_socket_path(self.run_dir, self.index)
        try:
            path.unlink()  # a previous engine of this index (killed) left its socket file
        except FileNotFoundError:
            pass
        self._router.bind(engine_endpoint(self.run_dir, self.index))

    def serve(self) -> None:
        """Run until SIGTERM/SIGINT: the scheduler thread loads and ticks, this thread does IPC."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopping.set())
        self.scheduler.start(self._from_scheduler)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stopping.is_set():
                timeout_ms = max(0.0, (next_beat - time.monotonic()) * 1e3)
                events = dict(poller.poll(timeout_ms))
                if self._router in events:
                    self._receive()
                if self._wake_r in events:
                    self._drain_wake()
                self._handle_inbox()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + wire.HEARTBEAT_S
                    self._check_workers(now)
                    if self._watchdog is not None:
                        self._watchdog.check()
                    self._send_status()
        finally:
            log.info("engine %s (pid %d) stopping", self.label, self._pid)
            self.scheduler.stop()
            self._router.close(0)

    # From the scheduler thread (any thread) -----------------------------------------------------
    def _from_scheduler(self, results: list) -> None:
        self._post(("results", results))

    def _post(self, item: tuple) -> None:
        self._inbox.put(item)
        try:
            os.write(self._wake_w, b"\x01")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # Worker messages ------------------------------------------------------------------------------
    def _receive(self) -> None:
        for _ in range(_MAX_MESSAGES_PER_POLL):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, kind = parts[0].bytes, parts[1].bytes
            worker = self._workers.get(identity)
            if worker is None:
                worker = self._workers[identity] = _Worker(identity)
                log.info("engine %s: worker %r connected", self.label, identity)
            worker.last_seen = time.monotonic()
            try:
                self._dispatch(worker, kind, parts[1:])
            except (wire.WireError, KeyError, TypeError, ValueError, IndexError) as exc:
                log.error("engine %s: dropped a malformed %r message from worker %r: %s", self.label, kind,
                          identity, exc)

    def _dispatch(self, worker: _Worker, kind: bytes, parts: list) -> None:
        scheduler = self.scheduler
        if kind == wire.PUSH:
            for key, epoch, frames in wire.read_push(parts):
                if self._owner.get(key) == worker.identity:
                    scheduler.push(key, epoch, frames)
        elif kind == wire.HELLO:
            worker.pid = int(wire.read_header(parts[1]).get("pid", 0))
        elif kind == wire.STATUS_NOW:
            self._send(worker.identity, [wire.STATUS, wire.header(self.status())])
        elif kind == wire.OPEN:
            meta = wire.read_header(parts[1])
            self._open(worker, str(meta["key"]), wire.spec_from_wire(meta["spec"]))
        elif kind == wire.CLOSE:
            key = str(wire.read_header(parts[1]))
            if self._owner.get(key) == worker.identity:
                self._close(key)
            else:  # never admitted (refused, or already gone): nothing to free
                self._send(worker.identity, [wire.CLOSED, wire.header({"key": key, "held": self._held()})])
        elif kind == wire.RESTART:
            key, epoch = wire.read_header(parts[1])
            if self._owner.get(key) == worker.identity:
                scheduler.restart(str(key), int(epoch))
        elif kind == wire.DROP:
            key = str(wire.read_header(parts[1]))
            if self._owner.get(key) == worker.identity:
                scheduler.drop_pending(key)
        else:
            raise wire.WireError(f"unknown message kind {kind!r}")

    @property
    def max_sessions(self) -> int:
        """The engine's slots once it has loaded; before, what was configured (0 for auto:
        nothing is admitted while it loads anyway)."""
        info = self.scheduler.info
        return info.max_slots if info is not None else (self._configured_sessions or 0)

    def _held(self) -> int:
        """Slots held: the sessions admitted, or the slots the engine itself holds if more
        (one it could not give back must not be counted free)."""
        return max(len(self._owner), self.scheduler.slots_taken)

    def _load_error_id(self) -> str:
        """The id clients are given for the engine's load failure, logged with it once."""
        if self._load_error_logged is None:
            self._load_error_logged = new_error_id()
            log.error("engine %s: the model failed to load [%s]: %s", self.label, self._load_error_logged,
                      self.scheduler.load_error)
        return self._load_error_logged

    def _open(self, worker: _Worker, key: str, spec: Any) -> None:
        refusal = None
        if self.scheduler.load_error is not None:
            refusal = ("engine_unavailable", withheld("the model failed to load", self._load_error_id()))
        elif key in self._owner:
            refusal = ("bad_event", f"session {key} is already open")
        elif self.max_sessions and self._held() >= self.max_sessions:  # (0: auto, still loading: it queues)
            full = capacity_exhausted(self.max_sessions)
            refusal = (full.code, full.message)
        if refusal is not None:
            code, message = refusal
            self._send(worker.identity, [wire.OPENED, wire.header({"key": key, "held": self._held(),
                                                                   "error": {"code": code, "message": message}})])
            return
        self._owner[key] = worker.identity  # admitted: held until the engine has released the slot
        worker.keys.add(key)
        future = self.scheduler.open(key, spec)
        future.add_done_callback(lambda done: self._post(("opened", key, done)))

    def _close(self, key: str) -> None:
        future = self.scheduler.close(key)
        future.add_done_callback(lambda done: self._post(("closed", key, done)))

    def _check_workers(self, now: float) -> None:
        for identity, worker in list(self._workers.items()):
            silent = now - worker.last_seen > wire.PEER_TIMEOUT_S
            exited = bool(worker.pid) and not pid_alive(worker.pid)
            if not silent and not exited:
                continue
            del self._workers[identity]
            log.warning("engine %s: worker %r (pid %d) is gone (%s); closing its %d session(s)", self.label, identity,
                        worker.pid, "exited" if exited else "silent", len(worker.keys))
            for key in list(worker.keys):
                self._close(key)
            if exited:
                mark_process_dead(worker.pid)  # its live gauges leave the sums

    # Scheduler results ----------------------------------------------------------------------------
    def _handle_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "results":
                self._route_results(item[1])
            elif kind == "opened":
                self._opened(item[1], item[2])
            elif kind == "closed":
                self._closed(item[1], item[2])

    def _opened(self, key: str, future: concurrent.futures.Future) -> None:
        identity = self._owner.get(key)
        if future.cancelled() or identity is None:
            return  # closed while opening: the close releases the admission
        error = future.exception()
        if error is None:
            reply = {"key": key, "slot": future.result()}
        else:
            self._release(key)
            refusal = engine_failure(error, "opening the session", log)
            reason = counted_failure(error)  # (no free slot is a refusal, not a failure)
            if reason is not None:
                self._metrics.inc("open_failures", reason)
            reply = {"key": key, "error": {"code": refusal.code, "message": refusal.message}}
        reply["held"] = self._held()  # the worker's view of the admission, exact at once
        self._send(identity, [wire.OPENED, wire.header(reply)])

    def _closed(self, key: str, future: concurrent.futures.Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            # The engine could not free the slot: keep its admission held (it is not reusable).
            log.error("engine %s: the slot of session %s was not released cleanly (%s); keeping it held", self.label,
                      key, error)
        identity = self._owner.get(key) if error is not None else self._release(key)
        if identity is not None and identity in self._workers:
            reply: dict[str, Any] = {"key": key, "held": self._held()}
            if error is not None:
                reply["error"] = str(error)
            self._send(identity, [wire.CLOSED, wire.header(reply)])

    def _release(self, key: str) -> bytes | None:
        identity = self._owner.pop(key, None)
        worker = self._workers.get(identity) if identity is not None else None
        if worker is not None:
            worker.keys.discard(key)
        return identity

    def _route_results(self, results: list) -> None:
        """One tick's results: a ``FRAMES`` (and a ``FAILURES``) per worker that owns lanes."""
        frames: dict[bytes, list[FrameResult]] = {}
        failures: dict[bytes, list[FrameFailure]] = {}
        for result in results:
            identity = self._owner.get(result.key)
            if identity is None:
                continue  # closed meanwhile
            (frames if isinstance(result, FrameResult) else failures).setdefault(identity, []).append(result)
        for identity, rows in frames.items():
            self._send(identity, wire.frames_message(rows))
        for identity, failed in failures.items():
            self._send(identity, wire.failures_message(failed))

    # Sending ----------------------------------------------------------------------------------------
    def _send(self, identity: bytes, parts: list) -> None:
        try:
            self._router.send_multipart([identity, *parts], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the worker's queue is full or it is gone: it learns by heartbeat
            log.warning("engine %s: a message to worker %r was dropped (%s)", self.label, identity, exc)

    def status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        busy = scheduler.busy
        if scheduler.load_error is not None:
            state = "failed"
        elif not scheduler.ready.is_set():
            state = "loading"
        elif not scheduler.alive:
            state = "failed"
        else:
            state = "ready"
        return {
            "pid": self._pid, "index": self.index, "device": self.label, "state": state,
            "load_error": None if scheduler.load_error is None else str(scheduler.load_error),
            "info": wire.info_to_wire(scheduler.info), "voices": list(scheduler.voices),
            "busy": None if busy is None else [busy.kind, busy.since, busy.sessions],
            "failed_ticks_in_row": scheduler.failed_ticks_in_row, "held": self._held(),
            "max_sessions": self.max_sessions, "loading": scheduler.loading_status(),
            "memory_plan": scheduler.memory_plan,
            # Sessions held per front-end worker (by pid): which worker serves how many.
            "workers": {str(w.pid): len(w.keys) for w in self._workers.values() if w.pid},
        }

    def _send_status(self) -> None:
        if not self._workers:
            return
        message = wire.header(self.status())
        for identity in self._workers:
            self._send(identity, [wire.STATUS, message])
