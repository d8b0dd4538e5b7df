"""What the routes share: settings, the tick scheduler, admission, metrics and the registry
of open sessions, plus access control and the reliability guards (watchdog, drain).  Lives
on the event loop; only the scheduler has a thread.

Draining: the server starts draining when it stops listening (``listeners.py``: hypercorn
closes its listeners first on SIGTERM, then gives open connections ``--graceful-timeout``)
or when serving stops.  New opens are then refused (``server_shutting_down``) and every
live session ends with ``session.closed`` reason ``shutdown`` (close code 1001).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable

from engines.interface import Engine

from .access import AccessPolicy
from .admission import SlotPool
from .errors import ProtocolError
from .events import capabilities
from .fault_injection import FaultPlan, FaultPlanError, wrap_engine
from .limits import ClientLimits, Refusal
from .listeners import ListenerWatch, find_listeners
from .metrics import Metrics
from .scheduler import EngineCall, FrameFailure, FrameResult, TickScheduler
from .session import Session
from .settings import Settings, SettingsError, env_name
from .watchdog import Watchdog

log = logging.getLogger(__name__)

EngineFactory = Callable[..., Engine]

LISTENER_POLL_S = 0.1  # how soon a closed listener (shutdown) starts the drain


class Services:
    def __init__(self, settings: Settings, engine_factory: EngineFactory) -> None:
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
        engine_factory = _with_fault_injection(engine_factory, settings.fault_injection)
        self.device = settings.resolved_device()
        self.max_sessions = settings.resolved_max_sessions(self.device)
        self.admission = SlotPool(self.max_sessions)
        self.metrics = Metrics()
        self.sessions: dict[str, Session] = {}
        self.caps = capabilities(self.max_sessions)
        self.scheduler = TickScheduler(
            lambda: engine_factory(settings.checkpoint, max_slots=self.max_sessions, device=self.device,
                                   backend=settings.backend, window=settings.window,
                                   kv_cache=settings.kv_cache, compile=settings.compile),
            batch_window_s=settings.batch_window_ms / 1000.0,
            silence_grace_s=settings.silence_grace_s,
            warmup_frames=settings.warmup_frames,
            metrics=self.metrics,
        )
        self.metrics.live_sessions = lambda: self.admission.held
        self.metrics.free_slots = lambda: self.admission.free
        self.metrics.ready = lambda: self.scheduler.is_ready
        self.watchdog = Watchdog(self.scheduler, settings.watchdog_deadline_s, self.metrics, self._on_stall)
        self.metrics.engine_stalled = lambda: self.watchdog.stalled is not None
        self.metrics.draining = lambda: self.draining
        self.metrics.loop_tasks = lambda: len(asyncio.all_tasks())
        self._loop: asyncio.AbstractEventLoop | None = None

    # Lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.settings.checkpoint is None:
            log.warning("PERSONAPLEX_CHECKPOINT is not set: serving the embedded default, an UNTRAINED tiny demo "
                        "model (its speech is noise). To serve real weights set PERSONAPLEX_CHECKPOINT to a "
                        "nvidia/personaplex-7b-v1 checkpoint directory.")
        log.info("starting the engine: device=%s backend=%s max_sessions=%d", self.device, self.settings.backend,
                 self.max_sessions)
        self.scheduler.start(self._loop, self.deliver)
        if self.settings.watchdog_deadline_s > 0:
            self._tasks.append(asyncio.ensure_future(self.watchdog.run()))
        if self._listeners.listeners:
            self._tasks.append(asyncio.ensure_future(self._watch_listeners()))

    def stop(self) -> None:
        self.drain("serving stopped")
        for task in self._tasks:
            task.cancel()
        self.scheduler.stop()

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

    async def _watch_listeners(self) -> None:
        while not self._listeners.closed():
            await asyncio.sleep(LISTENER_POLL_S)
        self.drain("the server stopped listening")

    def open_refusal(self) -> ProtocolError | None:
        """Why a new session cannot be opened now (draining, stalled engine), or None."""
        if self.draining:
            return ProtocolError("server_shutting_down", "the server is shutting down; connect again (to another "
                                 "replica)", retryable=True)
        stalled = self.watchdog.stalled
        if stalled is not None:
            return ProtocolError("engine_stalled", stalled, retryable=True)
        return None

    def _on_stall(self, call: EngineCall, elapsed: float) -> None:
        for session in list(self.sessions.values()):
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
        if self.settings.model_name:
            return self.settings.model_name
        return self.scheduler.info.model if self.scheduler.info else "personaplex"

    async def wait_ready(self) -> None:
        """Return once the engine is up; ``engine_unavailable`` if it failed or is too slow."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ready_wait_s
        while not self.scheduler.ready.is_set() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler.load_error is not None:
            raise ProtocolError("engine_unavailable", f"the model failed to load: {self.scheduler.load_error}")
        if not self.scheduler.ready.is_set():
            raise ProtocolError("engine_unavailable", "the model is still loading; retry later", retryable=True)

    # Ticks -> sessions ------------------------------------------------------------------------
    def deliver(self, results: list[FrameResult | FrameFailure]) -> None:
        for result in results:
            session = self.sessions.get(result.key)
            if session is None:
                self.metrics.inc("frames_dropped")
            else:
                session.on_result(result)

    def release_when_closed(self, cleanup: concurrent.futures.Future) -> None:
        """Give the admission slot back once the engine has released the session's slot."""
        loop = self._loop
        assert loop is not None

        def released(future: concurrent.futures.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                log.error("a session's engine slot was not released cleanly; keeping its admission slot held")
                return
            self.admission.release()

        cleanup.add_done_callback(lambda future: loop.call_soon_threadsafe(released, future))

    # Status -----------------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]]:
        if self.scheduler.load_error is not None:
            return 503, {"status": "unhealthy", "reason": f"engine failed to load: {self.scheduler.load_error}"}
        if not self.scheduler.ready.is_set():
            return 503, {"status": "unhealthy", "reason": "No engine initialized (loading)"}
        if not self.scheduler.alive:
            return 503, {"status": "unhealthy", "reason": "the engine thread has stopped"}
        stalled = self.watchdog.stalled
        if stalled is not None:
            return 503, {"status": "unhealthy", "reason": stalled}
        failed, limit = self.scheduler.failed_ticks_in_row, self.settings.unhealthy_after_failed_ticks
        if limit and failed >= limit:
            return 503, {"status": "unhealthy", "reason": f"the last {failed} ticks all failed"}
        if self.draining:
            return 503, {"status": "unhealthy", "reason": "shutting down"}
        return 200, {"status": "healthy"}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        ready = (self.scheduler.is_ready and self.scheduler.alive and not self.draining
                 and self.watchdog.stalled is None)
        body = {"ready": ready, "free_slots": self.admission.free, "max_sessions": self.max_sessions,
                "live_sessions": self.admission.held}
        return (200 if ready else 503), body


def _with_fault_injection(factory: EngineFactory, spec: str | None) -> EngineFactory:
    """The factory as is, or (testing only) one whose engines fail on purpose."""
    if not spec:
        return factory
    try:
        FaultPlan.parse_all(spec)
    except FaultPlanError as exc:
        raise SettingsError(f"{env_name('fault_injection')}: {exc}") from None
    return lambda *args, **kwargs: wrap_engine(factory(*args, **kwargs), spec)
