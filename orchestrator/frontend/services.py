"""What the routes share: settings, the engines (one per device, each in an engine process
this worker reaches through its port, with admission as last heard and a watchdog:
``engine_pool.py``), metrics and the registry of open sessions, plus access control and the
drain.  Lives on the event loop.

Health with several engines: the process is healthy while at least one engine can serve,
and ready once every engine has finished loading and at least one is serving; each engine's own state is in the bodies (and in
the ``personaplex_device_*`` metrics).  Restarting the process for one bad GPU would end
every session of the good ones; a process whose every engine is down is replaced.

Draining: the server starts draining when it stops listening (``listeners.py``: hypercorn
closes its listeners first on SIGTERM, then gives open connections ``--graceful-timeout``)
or when serving stops.  New opens are then refused (``server_shutting_down``) and every
live session ends with ``session.closed`` reason ``shutdown`` (close code 1001).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from engines.interface import SessionSpec

from ..engine_host.launch import ensure_host
from ..ipc.endpoints import default_run_dir, metrics_dir, server_group_pid
from ..engine_port import EngineCall, FrameFailure, FrameResult
from ..metrics import Metrics
from ..protocol import libopus
from ..protocol.errors import CAPACITY_EXHAUSTED, ProtocolError, capacity_exhausted, engine_failure
from ..protocol.events import capabilities
from ..settings import Settings
from .access import AccessPolicy
from .engine_link import EngineRefusal
from .engine_pool import DeviceEngine, EnginePool
from .limits import ClientLimits, Refusal
from .listeners import ListenerWatch, find_listeners
from .loop_watch import watch_event_loop
from .codec_threads import CodecThreads
from .native_session import NativeSession
from .session import Session

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005  # see start()
LISTENER_POLL_S = 0.1  # how soon a closed listener (shutdown) starts the drain
LOADING_POLL_S = 0.2  # how often the announcing worker looks whether start-up is over
ENGINE_CONNECT_TIMEOUT_S = 120.0  # start-up: an engine process answers before loading its model


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Access control first: a public server without keys fails before loading a model.
        listeners = find_listeners()
        self.access = AccessPolicy(settings, listeners)
        self.key_limits = ClientLimits("API key", settings.max_sessions_per_key, settings.opens_per_minute_per_key)
        self.ip_limits = ClientLimits("address", settings.max_sessions_per_ip, settings.opens_per_minute_per_ip)
        self._listeners = ListenerWatch(listeners)
        self.draining = False
        self.shutdown_started = asyncio.Event()
        self._tasks: list[asyncio.Future] = []
        self.sessions: dict[str, Session | NativeSession] = {}  # open sessions of both protocols, by id
        self._codec: CodecThreads | None = None  # the native sessions' Opus work, from the first one on
        # The engines run in engine processes that the engine host starts (the first worker
        # starts the host; the others find it).  That worker logs what concerns the whole server.
        run_dir = Path(settings.run_dir) if settings.run_dir else default_run_dir()
        layout, self.speaks_for_server = ensure_host(settings, run_dir, server_group_pid())
        self.metrics = Metrics(metrics_dir(run_dir))  # the host has made it, empty
        self.pool = EnginePool.connect(settings, layout, self.metrics, self._on_stall)
        self._caps: tuple[int, dict[str, Any]] | None = None
        engines = self.pool.engines
        self.metrics.live_sessions = lambda: self.pool.held
        self.metrics.free_slots = lambda: self.pool.free
        self.metrics.max_sessions = lambda: self.pool.capacity
        self.metrics.ready = lambda: any(engine.port.is_ready for engine in engines)
        self.metrics.engine_stalled = lambda: any(engine.watchdog.stalled is not None for engine in engines)
        self.metrics.devices = lambda: [engine.status() for engine in engines]
        self.metrics.draining = lambda: self.draining
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_sessions(self) -> int:
        """Of all engines: what clients and balancers see."""
        return self.pool.capacity

    @property
    def caps(self) -> dict[str, Any]:
        capacity = self.max_sessions
        if self._caps is None or self._caps[0] != capacity:
            self._caps = (capacity, capabilities(capacity))
        return self._caps[1]

    # Lifecycle --------------------------------------------------------------------------------
    async def wait_engines(self, timeout_s: float = ENGINE_CONNECT_TIMEOUT_S) -> None:
        """Wait until each engine process has answered (its capacity is then known)."""
        await self.pool.wait_connected(timeout_s)
        log.info("engine processes answered: %s", ", ".join(
            f"{e.label} pid {e.engine_pid} max_sessions={e.max_sessions or 'auto'}" for e in self.pool.engines))

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.declare_worker()
        if self.settings.checkpoint is None:
            log.warning("PERSONAPLEX_CHECKPOINT is not set: serving the embedded default, an UNTRAINED tiny demo "
                        "model (its speech is noise). To serve real weights set PERSONAPLEX_CHECKPOINT to a "
                        "nvidia/personaplex-7b-v1 checkpoint directory.")
        self.pool.start(self.deliver)
        if self.settings.watchdog_deadline_s > 0:
            self._tasks.extend(asyncio.ensure_future(engine.watchdog.run()) for engine in self.pool.engines)
        if self._listeners.listeners:
            self._tasks.append(asyncio.ensure_future(self._watch_listeners()))
        if self.speaks_for_server:
            self._tasks.append(asyncio.ensure_future(self._announce_ready()))
        self._tasks.append(asyncio.ensure_future(watch_event_loop(self.metrics)))

    def stop(self) -> None:
        self.drain("serving stopped")
        for task in self._tasks:
            task.cancel()
        if self._codec is not None:
            self._codec.stop()
        self.pool.stop()

    def drain(self, why: str) -> None:
        """Refuse new opens and end every live session with reason ``shutdown`` (once)."""
        if self.draining:
            return
        self.draining = True
        self.shutdown_started.set()
        log.warning("draining (%s): refusing new sessions, closing %d live session(s) with reason 'shutdown'",
                    why, len(self.sessions))
        for session in list(self.sessions.values()):
            session.request_stop("shutdown")

    async def _announce_ready(self) -> None:
        """Once start-up is over, say where to talk to the server (hypercorn's "Running on"
        comes as soon as it listens, long before a 7B model has loaded)."""
        while self.pool.loading:
            await asyncio.sleep(LOADING_POLL_S)
        if not self.pool.serving:
            return  # each engine's failure is logged where it happened; /health says why
        for listener in self._listeners.listeners or ():
            if listener.port is None:
                continue
            host = str(listener).rsplit(":", 1)[0]
            if host in ("0.0.0.0", "[::]"):
                host = socket.gethostname()
            log.info("ready: %d session(s) on %s; talk page http://%s:%d/ , websocket ws://%s:%d/v1/realtime?duplex=1",
                     self.max_sessions, ", ".join(e.label for e in self.pool.engines if e.serving), host,
                     listener.port, host, listener.port)

    async def _watch_listeners(self) -> None:
        while not self._listeners.closed():
            await asyncio.sleep(LISTENER_POLL_S)
        self.drain("the server stopped listening")

    def open_refusal(self, *, at_open: bool = False, exclude: Collection[DeviceEngine] = ()
                     ) -> tuple[ProtocolError, str] | None:
        """Why a new session cannot be placed now, with the reason it is counted under in
        ``connections_refused`` (``full``: also ``sessions_refused``), or None.  ``at_open``:
        for the open itself, where an engine process that looks full to this worker is asked
        anyway (its admission is global and this worker's view of it a heartbeat old);
        ``exclude``: engines that refused this open already."""
        if self.draining:
            return ProtocolError("server_shutting_down", "the server is shutting down; connect again (to another "
                                 "replica)", retryable=True), "shutdown"
        unavailable = self.pool.unavailable()
        if unavailable is not None:
            return unavailable, "stalled" if unavailable.code == "engine_stalled" else "unavailable"
        if self.pool.choose(at_open=at_open, exclude=exclude) is None:
            return self.full_error(), "full"
        return None

    def full_error(self) -> ProtocolError:
        return capacity_exhausted(self.max_sessions)

    def place_session(self, exclude: Collection[DeviceEngine] = ()) -> DeviceEngine:
        """The engine placement picks for a new session, leaving out ``exclude`` (its engine
        admits the open or refuses it); raises ``open_refusal()``'s error (counted in the
        metrics) when there is none."""
        refusal = self.open_refusal(at_open=True, exclude=exclude)
        if refusal is not None:
            error, reason = refusal
            self.count_refusal(reason)
            raise error
        engine = self.pool.choose(at_open=True, exclude=exclude)
        assert engine is not None  # open_refusal saw one, and nothing ran in between
        return engine

    async def open_session(self, session_id: str, spec: SessionSpec) -> DeviceEngine:
        """Place a new session and open it on its engine (its prompt installed); the engine it
        lives on.  An engine process that turns the open down as full (this worker's view of it
        was a heartbeat old) is left out and the session placed again; refused with a
        ``ProtocolError`` only when no engine can take it."""
        refused_by: list[DeviceEngine] = []
        refused: ProtocolError | None = None  # the latest engine's own refusal
        while True:
            try:
                engine = self.place_session(refused_by)  # raises when nowhere
            except ProtocolError as nowhere:
                # Every engine turned it down: a join that got no turn says so, not "full".
                other_reason = refused is not None and not refused.message.startswith(CAPACITY_EXHAUSTED)
                raise (refused if other_reason and nowhere.code == "resource_exhausted" else nowhere) from None
            try:
                await self.pool.wait_ready(engine, self.settings.ready_wait_s)
                await asyncio.wrap_future(engine.open(session_id, spec))
                return engine
            except asyncio.CancelledError:
                # The client left while the slot was being prepared; the open may still complete
                # in the engine process, so close by id: that frees whatever was allocated.
                engine.close(session_id)
                raise
            except Exception as exc:  # noqa: BLE001 - a failed open allocated no engine slot
                error = _open_error(exc)  # (the engine process counted the failure)
                if error.code != "resource_exhausted":
                    raise error from None
                refused_by.append(engine)
                refused = error
                log.info("session %s: %s is full; placing it again", session_id, engine.label)

    def add_session(self, session: Session | NativeSession) -> None:
        """A session is open on this worker: the ticks' results, stalls and the drain reach it."""
        self.sessions[session.id] = session
        self.metrics.inc("sessions_opened", session.protocol)
        self.metrics.session_count(session.protocol, +1)

    def close_session(self, session: Session | NativeSession, engine: DeviceEngine, protocol: str,
                      reason: str) -> concurrent.futures.Future:
        """Stop a session of either protocol and free its engine slot (its admission slot
        follows the engine's close); the future of that close.  Call once per session."""
        session.begin_close()
        if self.sessions.pop(session.id, None) is not None:
            self.metrics.session_count(session.protocol, -1)
        self.metrics.inc("sessions_closed", (protocol, reason))
        log.info("%s session %s closed (%s)", protocol, session.id, reason)
        return engine.close(session.id)

    async def wait_closed(self, session_id: str, cleanup: concurrent.futures.Future) -> None:
        """Wait for ``close_session``'s engine close, at most ``close_timeout_s``: a session's
        last words go out after its slot is free, or after that long regardless."""
        timeout = self.settings.close_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cleanup)), timeout)
        except Exception:  # noqa: BLE001 - the client is told regardless
            log.warning("session %s: engine cleanup did not finish within %.1f s", session_id, timeout)

    def codec(self) -> CodecThreads:
        """This worker's Opus threads (started by its first native session)."""
        if self._codec is None:
            codec = self.settings.resolved_opus_codec()
            if codec == "libopus":
                libopus.use(self.settings.opus_library)
            else:
                log.warning("native sessions' Opus runs on sphn, which holds the interpreter lock while it "
                            "encodes (%s): this worker's encodes run one at a time and its event loop waits "
                            "behind them; install libopus (Debian: libopus0) for the faster codec",
                            "PERSONAPLEX_OPUS_CODEC=sphn" if self.settings.opus_codec == "sphn" else "no libopus")
                # Between sphn's calls the event loop should get the lock back at once, not after
                # the default 5 ms switch interval.
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self._codec = CodecThreads(asyncio.get_running_loop(), codec=codec,
                                       encode_threads=self.settings.opus_encode_threads, metrics=self.metrics)
            log.info("native sessions' Opus: %s, %d encoding thread(s)", codec, self.settings.opus_encode_threads)
        return self._codec

    def count_refusal(self, reason: str) -> None:
        if reason == "full":
            self.metrics.inc("sessions_refused")
        else:
            self.metrics.inc("connections_refused", reason)

    def _on_stall(self, engine: DeviceEngine, call: EngineCall, elapsed: float) -> None:
        for session in list(self.sessions.values()):
            if session.port is engine.port:
                session.emit_error(ProtocolError(
                    "engine_stalled", f"the model has not answered for {elapsed:.1f} s; this session waits for it",
                    retryable=True))

    # Per-client limits ----------------------------------------------------------------------------
    def admit_client(self, address: str, key_id: str | None) -> Refusal | None:
        """Count one more websocket for ``address`` and ``key_id``; a refusal counts nothing."""
        refusal = self.ip_limits.acquire(address)
        if refusal is None and key_id is not None:
            refusal = self.key_limits.acquire(key_id)
            if refusal is not None:
                self.ip_limits.release(address)
        if refusal is not None:
            self.metrics.inc("connections_refused", "limits")
        return refusal

    def release_client(self, address: str, key_id: str | None) -> None:
        self.ip_limits.release(address)
        if key_id is not None:
            self.key_limits.release(key_id)

    @property
    def model_name(self) -> str:
        served = self.settings.served_model_id()
        if served:
            return served
        info = self.pool.info
        return info.model if info else "personaplex"

    # Ticks -> sessions ------------------------------------------------------------------------
    def deliver(self, results: list[FrameResult | FrameFailure]) -> None:
        for result in results:
            session = self.sessions.get(result.key)
            if session is None:
                self.metrics.inc("frames_dropped")
            else:
                session.on_result(result)

    # Status -----------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Fetch each engine's status now (``EnginePool.refresh``)."""
        await self.pool.refresh()

    def health(self) -> tuple[int, dict[str, Any]]:
        """503 when no engine can serve (the one engine's reason, or each device's) or while
        draining; the per-device detail is added whenever some engine has a problem."""
        limit = self.settings.unhealthy_after_failed_ticks
        engines = self.pool.engines
        problem_of = {engine: engine.health_problem(limit) for engine in engines}  # read once: threads move on
        problems = list(problem_of.values())
        if all(problems):
            body = {"status": "unhealthy", "reason": self.pool.describe(engines, problem_of.get)}
        elif self.draining:
            body = {"status": "unhealthy", "reason": "shutting down"}
        else:
            body = {"status": "healthy"}
        if any(problems):
            body["devices"] = [{"device": engine.label, "status": "unhealthy" if problem else "healthy",
                                **({"reason": problem} if problem else {}),
                                **({"loading": loading} if (loading := engine.loading_status()) else {})}
                               for engine, problem in zip(engines, problems)]
        return (200 if body["status"] == "healthy" else 503), body

    def readiness(self, require_free_slot: bool = False) -> tuple[int, dict[str, Any]]:
        """200 once start-up is over (no engine still loading), some engine is serving and
        the server is not draining; with ``require_free_slot``, also 503 ``"reason": "full"``
        when a new session would be refused for capacity (what a balancer's health check
        asks)."""
        pool = self.pool
        reason = None
        if self.draining:
            reason = "draining"
        elif pool.loading:
            reason = "loading"  # sessions wait for every engine's load (EnginePool.wait_ready)
        elif not pool.serving:
            reason = "unavailable"
        elif require_free_slot and pool.choose() is None:
            reason = "full"
        ready = reason in (None, "full")
        body: dict[str, Any] = {"ready": ready, "free_slots": pool.free, "max_sessions": pool.capacity,
                                "live_sessions": pool.held, "worker_pid": os.getpid()}
        if reason is not None:
            body["reason"] = reason
        body["devices"] = [engine.status() for engine in pool.engines]
        return (200 if reason is None else 503), body


def _open_error(exc: Exception) -> ProtocolError:
    """The client-facing error of a failed open: the engine process's reply (already the
    client's: ``EngineRefusal`` with its code and message), or ``engine_failure``'s for anything
    else (the link's typed ``EngineError`` passes as it is; no exception text for the client)."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, EngineRefusal):  # (capacity, or memory for it now: retryable)
        extra = {"retryable": True} if exc.code == "resource_exhausted" else {}
        return ProtocolError(exc.code, str(exc), param="voice" if exc.code == "invalid_voice" else None, **extra)
    return engine_failure(exc, "opening the session", log)  # typed refusals pass as they are
