"""A front-end worker's handle on one engine process: the ``engine_port.EnginePort`` over IPC.

It lives on the worker's event loop (one DEALER socket,
read by the loop's reader callback without a future per message; ``ipc/wire.py`` has the
messages):

- input frames of one event-loop pass go in one ``PUSH``; a control message first sends
  what is queued, so the engine sees everything in the order the sessions did it;
- ``FRAMES`` and ``FAILURES`` carry ``FrameResult``/``FrameFailure`` (``ipc/wire.py`` decodes
  them) for ``deliver``;
- ``STATUS`` (every ``HEARTBEAT_S``) carries the engine's state and its admission count; the
  worker's own ``HELLO`` goes the other way at the same pace;
- the engine is **lost** when its heartbeat stops for ``PEER_TIMEOUT_S`` or a status comes
  from another pid (the host restarted it): every session on it gets a fatal
  ``FrameFailure`` (an ``engine_error``; its model context is gone), its opens fail with
  ``engine_unavailable`` and its closes complete at once.

``pending(key)``, which the input back-pressure check reads synchronously, is counted here:
frames pushed minus outputs that answered client frames.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from engines.interface import EngineError, EngineInfo, SessionSpec

from ..ipc import wire
from ..engine_port import EngineCall, FrameFailure

log = logging.getLogger(__name__)

_MAX_PER_DRAIN = 256  # messages handled in one go before the loop runs other work



class EngineRefusal(EngineError):
    """An engine process's answer to an open that failed, already worded for the client (the
    engine process logged any detail under the error id its message names)."""

class EngineLoadError(RuntimeError):
    """The engine process reported that its model failed to load (the message is its own)."""


class EngineLink:
    def __init__(self, index: int, label: str, endpoint: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.device = label
        self.endpoint = endpoint
        self._clock = clock
        self.ready = threading.Event()  # set once the engine has loaded (or failed to)
        self.load_error: BaseException | None = None
        self.info: EngineInfo | None = None
        self.voices: tuple[str, ...] = ()
        self.busy: EngineCall | None = None
        self.failed_ticks_in_row = 0
        self.engine_pid: int | None = None
        self.max_sessions: int | None = None  # known from the first status
        self.memory_plan: dict[str, Any] | None = None  # the engine's, once it has loaded (status)
        self.held = 0  # admitted sessions of this engine, all workers (from the status)
        self.sessions_by_worker: dict[int, int] = {}  # worker pid -> its sessions here (status)
        self._loading: dict[str, Any] | None = None  # the engine's load phase and progress (status)
        self.first_status = asyncio.Event()
        self._last_status = float("-inf")
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._drain_scheduled = False
        self._tasks: list[asyncio.Task] = []
        self._deliver: Callable[[list], None] = lambda results: None
        self._opens: dict[str, concurrent.futures.Future] = {}
        self._closes: dict[str, concurrent.futures.Future] = {}
        self._epochs: dict[str, int] = {}  # sessions opened on this engine -> latest epoch
        self._pending: dict[str, int] = {}
        self._queued: list[tuple[str, int, np.ndarray]] = []  # input frames not yet sent
        self._flush_scheduled = False
        self._status_waiters: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # Lifecycle ----------------------------------------------------------------------------------
    def start(self, deliver: Callable[[list], None]) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._deliver = deliver
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"w{os.getpid()}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 20)  # ms: a restarted engine is found at once
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        sock.connect(self.endpoint)
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # A ZeroMQ socket's FD signals *edges*: readable means "look at EVENTS", and any send
        # may consume an edge, so every drain reads until EVENTS says nothing is left, and a
        # send is followed by a look (``_after_send``).
        loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        loop.add_reader(self._monitor.getsockopt(zmq.FD), self._drain_monitor)
        loop.call_soon(self._drain_monitor)  # arm both: an edge may have passed before the readers
        loop.call_soon(self._drain)
        self._tasks = [asyncio.ensure_future(self._heartbeat())]

    def request_stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        loop, sock, monitor = self._loop, self._socket, self._monitor
        self._socket = self._monitor = None
        if sock is None:
            return
        if loop is not None and not loop.is_closed():
            for one in (sock, monitor):
                if one is not None:
                    loop.remove_reader(one.getsockopt(zmq.FD))
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        if monitor is not None:
            monitor.close(0)
        sock.close(0)

    def stop(self, timeout: float = 0.0) -> None:
        self.request_stop()

    @property
    def alive(self) -> bool:
        """The engine process answers (its heartbeat is fresh)."""
        return self._clock() - self._last_status <= wire.PEER_TIMEOUT_S

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.load_error is None

    # Session commands (event loop) --------------------------------------------------------------
    def open(self, key: str, spec: SessionSpec) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._opens[key] = future
        self._send([wire.OPEN, wire.header({"key": key, "spec": wire.spec_to_wire(spec)})])
        return future

    def close(self, key: str) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        opening = self._opens.pop(key, None)
        if opening is not None:
            opening.cancel()
        if key not in self._epochs and opening is None:
            future.set_result(None)  # never opened here, or lost with its engine: nothing to free
            return future
        self._epochs.pop(key, None)
        self._pending.pop(key, None)
        self._closes[key] = future
        self._send([wire.CLOSE, wire.header(key)])
        return future

    def restart(self, key: str, epoch: int) -> None:
        if key not in self._epochs:
            return
        self._epochs[key] = epoch
        self._pending[key] = 0
        self._send([wire.RESTART, wire.header([key, epoch])])

    def push(self, key: str, epoch: int, frames: np.ndarray) -> None:
        if key not in self._epochs:
            return
        self._pending[key] = self._pending.get(key, 0) + len(frames)
        self._queued.append((key, epoch, frames))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def drop_pending(self, key: str) -> None:
        if key in self._epochs:
            self._pending[key] = 0
            self._send([wire.DROP, wire.header(key)])

    def pending(self, key: str) -> int:
        return self._pending.get(key, 0)

    async def refresh(self, timeout_s: float = 0.5) -> None:
        """Ask the engine for its status now and wait for it (at most ``timeout_s``): what
        ``/ready``, ``/health`` and ``/metrics`` report is then exact, not a heartbeat old.
        A silent engine leaves the last status in place (its absence is ``alive``'s business)."""
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._status_waiters.append(waiter)
        self._send([wire.STATUS_NOW])
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            pass

    # Sending --------------------------------------------------------------------------------------
    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._queued:
            items, self._queued = self._queued, []
            self._send_now(wire.push_message(items))

    def _send(self, parts: list) -> None:
        self._flush()  # whatever was queued before this command goes first
        self._send_now(parts)

    def _send_now(self, parts: list) -> None:
        sock = self._socket
        if sock is None:
            return
        try:
            # NOBLOCK: a message the engine cannot take now (its queue full: it is gone or
            # stuck) is dropped; the heartbeat tells the sessions.
            sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("engine %s: its queue is full; a message was dropped", self.device)
        except zmq.ZMQError as exc:
            log.warning("engine %s: send failed (%s)", self.device, exc)
        self._after_send()

    def _after_send(self) -> None:
        """A send may have taken the FD's edge for messages already waiting: read them soon."""
        sock = self._socket
        if sock is not None and not self._drain_scheduled and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._drain_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._drain)

    async def _heartbeat(self) -> None:
        hello = [wire.HELLO, wire.header({"pid": os.getpid()})]
        while True:
            self._send_now(hello)
            if self.engine_pid is not None and not self.alive:
                self._lost(f"the engine process of {self.device} (pid {self.engine_pid}) stopped answering")
                self.engine_pid = None
            await asyncio.sleep(wire.HEARTBEAT_S)

    def _drain_monitor(self) -> None:
        """The engine's end of the Unix socket closed: the process has exited or been killed.
        Its sessions are told now, not a heartbeat timeout later (the host restarts it; the
        link reconnects by itself)."""
        monitor = self._monitor
        while monitor is not None and monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            if event["event"] == zmq.EVENT_DISCONNECTED and self.engine_pid is not None:
                self._lost(f"the engine process of {self.device} (pid {self.engine_pid}) has exited")
                self.engine_pid = None

    # Receiving ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Read and handle every message waiting (at most ``_MAX_PER_DRAIN`` before letting the
        loop run other work; the rest follow at once)."""
        self._drain_scheduled = False
        sock = self._socket
        for _ in range(_MAX_PER_DRAIN):
            if sock is None or self._socket is not sock or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(parts)
        self._drain_scheduled = True
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    def _handle(self, parts: list) -> None:
        kind = parts[0].bytes
        try:
            if kind == wire.FRAMES:
                self._on_frames(parts)
            elif kind == wire.STATUS:
                self._on_status(wire.read_header(parts[1]))
            elif kind == wire.FAILURES:
                self._on_failures(parts)
            elif kind == wire.OPENED:
                self._on_opened(wire.read_header(parts[1]))
            elif kind == wire.CLOSED:
                self._on_closed(wire.read_header(parts[1]))
            else:
                raise wire.WireError(f"unknown message kind {kind!r}")
        except (wire.WireError, KeyError, TypeError, ValueError, IndexError) as exc:
            log.error("engine %s: dropped a malformed %r message: %s", self.device, kind, exc)
        except Exception:  # noqa: BLE001 - one bad delivery must not stop this worker's frames
            log.exception("engine %s: handling a %r message failed", self.device, kind)

    def _on_frames(self, parts: list) -> None:
        results = wire.read_frames(parts)
        pending = self._pending
        for result in results:
            if not result.silence_input and pending.get(result.key, 0) > 0:
                pending[result.key] -= 1
        self._deliver(results)

    def _on_failures(self, parts: list) -> None:
        failures = wire.read_failures(parts)
        for failure in failures:
            self._pending[failure.key] = 0
        self._deliver(failures)

    def _on_opened(self, reply: dict[str, Any]) -> None:
        key = reply["key"]
        self.held = int(reply.get("held", self.held))
        future = self._opens.pop(key, None)
        if future is None or future.done():
            return  # closed while opening: the engine got our close after its open
        error = reply.get("error")
        if error is not None:
            future.set_exception(EngineRefusal(error["message"], error["code"]))
            return
        self._epochs[key] = 0
        self._pending[key] = 0
        future.set_result(reply["slot"])

    def _on_closed(self, reply: dict[str, Any]) -> None:
        self.held = int(reply.get("held", self.held))
        future = self._closes.pop(reply["key"], None)
        if future is None or future.done():
            return
        if reply.get("error"):
            future.set_exception(EngineError(f"the engine did not release the slot: {reply['error']}"))
        else:
            future.set_result(None)

    def _on_status(self, status: dict[str, Any]) -> None:
        pid = status["pid"]
        if self.engine_pid is not None and pid != self.engine_pid:
            self._lost(f"the engine process of {self.device} was restarted (pid {self.engine_pid} -> {pid})")
        if pid != self.engine_pid:
            log.info("engine %s: pid %d, state %s", self.device, pid, status["state"])
        self.engine_pid = pid
        self._last_status = self._clock()
        self.max_sessions = int(status["max_sessions"])
        self.memory_plan = status.get("memory_plan")
        self.held = int(status["held"])
        self.sessions_by_worker = {int(pid): int(n) for pid, n in status.get("workers", {}).items()}
        self.failed_ticks_in_row = int(status["failed_ticks_in_row"])
        self._loading = status.get("loading")
        busy = status["busy"]
        self.busy = None if busy is None else EngineCall(busy[0], float(busy[1]), int(busy[2]))
        state = status["state"]
        if state == "loading":
            self.ready.clear()
            self.load_error = None
        else:
            self.load_error = EngineLoadError(status["load_error"]) if status["load_error"] else None
            if state == "failed" and self.load_error is None:
                self.load_error = EngineLoadError("the engine thread has stopped")
            self.info = wire.info_from_wire(status["info"]) or self.info
            self.voices = tuple(status["voices"])
            self.ready.set()
        self.first_status.set()
        waiters, self._status_waiters = self._status_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def loading_status(self) -> dict[str, Any] | None:
        """The engine's load phase and progress, as its last status said (None once loaded)."""
        return None if self.ready.is_set() else self._loading

    def _lost(self, why: str) -> None:
        """The engine process is gone: tell every session on it, fail its opens, end its closes."""
        log.error("%s: ending its %d session(s) on this worker", why, len(self._epochs))
        self._queued = [item for item in self._queued if item[0] not in self._epochs]
        failures = [FrameFailure(key, epoch, f"{why}; this session's model context is lost", fatal=True)
                    for key, epoch in self._epochs.items()]
        self._epochs.clear()
        self._pending.clear()
        for future in self._opens.values():
            if not future.done():
                future.set_exception(EngineError(f"{why} while this session was opening", "engine_unavailable"))
        self._opens.clear()
        for future in self._closes.values():
            if not future.done():
                future.set_result(None)
        self._closes.clear()
        self.ready.clear()
        self.busy = None
        if failures:
            self._deliver(failures)
