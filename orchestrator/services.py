"""What the routes share: settings, the tick scheduler, admission, metrics and the registry
of open sessions.  Lives on the event loop; only the scheduler has a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable

from engines.interface import Engine

from .admission import SlotPool
from .errors import ProtocolError
from .events import capabilities
from .metrics import Metrics
from .scheduler import FrameFailure, FrameResult, TickScheduler
from .session import Session
from .settings import Settings

log = logging.getLogger(__name__)

EngineFactory = Callable[..., Engine]


class Services:
    def __init__(self, settings: Settings, engine_factory: EngineFactory) -> None:
        self.settings = settings
        self.device = settings.resolved_device()
        self.max_sessions = settings.resolved_max_sessions(self.device)
        self.admission = SlotPool(self.max_sessions)
        self.metrics = Metrics()
        self.sessions: dict[str, Session] = {}
        self.caps = capabilities(self.max_sessions)
        self.scheduler = TickScheduler(
            lambda: engine_factory(settings.checkpoint, max_slots=self.max_sessions, device=self.device,
                                   backend=settings.backend, window=settings.window),
            batch_window_s=settings.batch_window_ms / 1000.0,
            silence_grace_s=settings.silence_grace_s,
            warmup_frames=settings.warmup_frames,
            metrics=self.metrics,
        )
        self.metrics.live_sessions = lambda: self.admission.held
        self.metrics.free_slots = lambda: self.admission.free
        self.metrics.ready = lambda: self.scheduler.is_ready
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

    def stop(self) -> None:
        for session in list(self.sessions.values()):
            session.request_stop("shutdown")
        self.scheduler.stop()

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
        return 200, {"status": "healthy"}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        ready = self.scheduler.is_ready and self.scheduler.alive
        body = {"ready": ready, "free_slots": self.admission.free, "max_sessions": self.max_sessions,
                "live_sessions": self.admission.held}
        return (200 if ready else 503), body
