"""The engines of one server process, one per device, and where a new session goes.

A ``DeviceEngine`` is what one device needs to serve on its own: a ``TickScheduler`` (its
own engine thread, whose engine is built with ``device=`` that device), a ``SlotPool`` (the
admission of that engine's slots) and a ``Watchdog``.  Devices share only the event loop,
the metrics and the registry of sessions: a tick on one GPU never waits for another.
``PERSONAPLEX_DEVICES`` lists the devices; without it the pool holds the one engine of
``PERSONAPLEX_DEVICE``, and everything below reduces to the single-engine server.

Placement: a new session goes to the *serving* engine (loaded, thread alive, not stalled)
with the most free slots, ties to the lowest index.  Only when no serving engine has a slot
does an engine that is still loading get it.  Either way its open waits until start-up is
over: no session runs while any engine is still loading (``EnginePool.wait_ready``).  Engines that failed to load, whose thread has died or that
are stalled get none.  A session stays on its engine for its whole life: its commands go to
that engine's scheduler, and its admission slot goes back to that engine's pool once that
engine has released the engine slot.

Lives on the event loop; only the schedulers have threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable, Collection
from typing import Any

from engines.interface import Engine, EngineInfo, SessionSpec
from engines.spec import EngineSpec

from ..engine_port import EngineCall
from ..lockstep.scheduler import TickScheduler
from ..lockstep.watchdog import Watchdog
from ..metrics import Metrics
from ..protocol.errors import ProtocolError
from ..settings import Settings, StartupError, device_labels
from .admission import EngineAdmission, SlotPool
from .engine_link import EngineLink

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineSpec], Engine]  # engines.runtime.factory.build_engine's signature
# on_stall(engine, call, elapsed): an engine call of ``engine`` is past the watchdog deadline.
StallHandler = Callable[["DeviceEngine", EngineCall, float], None]


class DeviceEngine:
    """One device's engine thread, admission and watchdog (see the module doc)."""

    def __init__(self, index: int, label: str, max_sessions: int | None, scheduler: TickScheduler | EngineLink, *,
                 watchdog_deadline_s: float, metrics: Metrics, on_stall: StallHandler) -> None:
        # ``scheduler``: a TickScheduler (the engine runs in a thread of this process) or an
        # EngineLink (it runs in an engine process; ``max_sessions`` is None: the engine
        # reports it, and admits sessions itself for every worker).
        self.index = index
        self.label = label  # the device, made unique ("cpu#1") when a device serves twice
        self.admission: SlotPool | EngineAdmission = (
            EngineAdmission(scheduler) if isinstance(scheduler, EngineLink)
            else SlotPool(max_sessions, lambda: scheduler.slots_taken,
                          lambda: scheduler.info.max_slots if scheduler.info is not None else None))
        self.scheduler = scheduler
        self.watchdog = Watchdog(scheduler, watchdog_deadline_s, metrics,
                                 lambda call, elapsed: on_stall(self, call, elapsed),
                                 count_stalls=not isinstance(scheduler, EngineLink))
        metrics.declare_device(label)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_sessions(self) -> int:
        return self.admission.capacity

    @property
    def engine_pid(self) -> int | None:
        scheduler = self.scheduler
        return scheduler.engine_pid if isinstance(scheduler, EngineLink) else os.getpid()

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list], None]) -> None:
        self._loop = loop
        scheduler = self.scheduler
        if isinstance(scheduler, EngineLink):
            scheduler.start(deliver)
            return

        def hand_back(results: list) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(deliver, results)
            except RuntimeError:  # the loop is gone: shutting down
                pass

        scheduler.start(hand_back)

    # State ------------------------------------------------------------------------------------
    @property
    def loading(self) -> bool:
        return not self.scheduler.ready.is_set()

    def unavailable(self) -> str | None:
        """Why this engine can take no session (load failed, thread gone, stalled), or None."""
        scheduler = self.scheduler
        if scheduler.load_error is not None:
            return f"the model failed to load: {scheduler.load_error}"
        if not self.loading and not scheduler.alive:
            return "the engine has stopped" if isinstance(scheduler, EngineLink) else "the engine thread has stopped"
        return self.watchdog.stalled

    @property
    def state(self) -> str:
        """``loading``, ``ready`` (serving), ``stalled`` or ``failed`` (load failed, thread gone)."""
        if self.scheduler.load_error is not None or (not self.loading and not self.scheduler.alive):
            return "failed"
        if self.loading:
            return "loading"
        return "stalled" if self.watchdog.stalled is not None else "ready"

    @property
    def serving(self) -> bool:
        """Loaded, warmed up, alive and not stalled: a new session can start here now."""
        return self.state == "ready"

    def health_problem(self, unhealthy_after_failed_ticks: int) -> str | None:
        """Why this engine is unhealthy (the single-engine ``/health`` reasons), or None."""
        if self.scheduler.load_error is None and self.loading:
            return "No engine initialized (loading)"
        problem = self.unavailable()
        if problem is not None:
            return problem
        failed = self.scheduler.failed_ticks_in_row
        if unhealthy_after_failed_ticks and failed >= unhealthy_after_failed_ticks:
            return f"the last {failed} ticks all failed"
        return None

    def status(self) -> dict[str, Any]:
        """This engine's entry in ``/ready`` and its per-device metrics."""
        state = self.state
        body = {"device": self.label, "ready": state == "ready", "state": state, "free_slots": self.admission.free,
                "max_sessions": self.max_sessions, "live_sessions": self.admission.held, "engine_pid": self.engine_pid}
        if isinstance(self.scheduler, EngineLink):
            body["sessions_by_worker"] = {str(pid): n for pid, n in sorted(self.scheduler.sessions_by_worker.items())}
        loading = self.loading_status()
        if loading is not None:
            body["loading"] = loading
        if self.scheduler.memory_plan is not None:  # the engine's, measured at start-up
            body["memory_plan"] = self.scheduler.memory_plan
        return body

    def loading_status(self) -> dict[str, Any] | None:
        """While this engine loads: ``{"phase", "detail"?, "done"?, "total"?, "elapsed_s"}``
        (engines/progress.py); None otherwise."""
        return self.scheduler.loading_status() if self.loading and self.scheduler.load_error is None else None

    # Sessions ---------------------------------------------------------------------------------
    def check_loaded(self) -> None:
        """``engine_unavailable`` unless the engine has loaded."""
        if self.scheduler.load_error is not None:
            raise ProtocolError("engine_unavailable", str(self.unavailable()))  # "the model failed to load: ..."
        if self.loading:
            raise ProtocolError("engine_unavailable", "the model is still loading; retry later", retryable=True)

    def open(self, key: str, spec: SessionSpec) -> concurrent.futures.Future:
        return self.scheduler.open(key, spec)

    def cancel_admission(self) -> None:
        """Give back the admission slot of an open that allocated no engine slot."""
        self.admission.release()

    def close(self, key: str) -> concurrent.futures.Future:
        """Free the session's engine slot; its admission slot follows once the engine is done
        (so a reopen never races a close that has not finished)."""
        loop = self._loop
        assert loop is not None, "close before start"
        cleanup = self.scheduler.close(key)

        def released(future: concurrent.futures.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                log.error("a session's engine slot on %s was not released cleanly; keeping its admission slot held",
                          self.label)
                return
            self.admission.release()

        cleanup.add_done_callback(lambda future: loop.call_soon_threadsafe(released, future))
        return cleanup


class EnginePool:
    def __init__(self, engines: list[DeviceEngine]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines

    @classmethod
    def build(cls, settings: Settings, engine_factory: EngineFactory, metrics: Metrics,
              on_stall: StallHandler) -> EnginePool:
        """One engine per ``settings.resolved_devices()``, each sized by its device's memory."""
        devices = settings.resolved_devices()
        engines = []
        for index, (device, label) in enumerate(zip(devices, device_labels(devices))):
            spec = settings.engine_spec(device)
            max_sessions = spec.max_slots
            factory = functools.partial(engine_factory, spec)
            scheduler = TickScheduler(factory, policy=settings.tick_policy_object(),
                                      silence_grace_s=settings.silence_grace_s, warmup_frames=settings.warmup_frames,
                                      metrics=metrics, device=label, concurrent_joins=settings.concurrent_joins,
                                      join_wait_s=settings.join_wait_s)
            engines.append(DeviceEngine(index, label, max_sessions, scheduler,
                                        watchdog_deadline_s=settings.watchdog_deadline_s, metrics=metrics,
                                        on_stall=on_stall))
        return cls(engines)

    @classmethod
    def connect(cls, settings: Settings, layout: dict[str, Any], metrics: Metrics, on_stall: StallHandler) -> EnginePool:
        """One ``EngineLink`` per engine process of ``layout`` (``engine_host/host.py``)."""
        engines = []
        for entry in layout["engines"]:
            link = EngineLink(entry["index"], entry["label"], entry["endpoint"])
            engines.append(DeviceEngine(entry["index"], entry["label"], None, link,
                                        watchdog_deadline_s=settings.watchdog_deadline_s, metrics=metrics,
                                        on_stall=on_stall))
        return cls(engines)

    @property
    def links(self) -> list[EngineLink]:
        """The links of the engines that run in engine processes (none in the thread layout)."""
        return [e.scheduler for e in self.engines if isinstance(e.scheduler, EngineLink)]

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait for every engine process's first status (it says the engine's capacity)."""
        links = self.links
        try:
            await asyncio.wait_for(asyncio.gather(*(link.first_status.wait() for link in links)), timeout_s)
        except asyncio.TimeoutError:
            missing = [link.device for link in links if not link.first_status.is_set()]
            raise StartupError(f"the engine process(es) of {', '.join(missing)} did not answer within "
                               f"{timeout_s:g} s") from None

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list], None]) -> None:
        for engine in self.engines:
            log.info("starting the engine of %s", engine.label)
            engine.start(loop, deliver)

    def stop(self) -> None:
        for engine in self.engines:  # ask every thread to stop before waiting for any
            engine.scheduler.request_stop()
        for engine in self.engines:
            engine.scheduler.stop()

    # Totals -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return sum(engine.max_sessions for engine in self.engines)

    @property
    def free(self) -> int:
        return sum(engine.admission.free for engine in self.engines)

    @property
    def held(self) -> int:
        return sum(engine.admission.held for engine in self.engines)

    @property
    def serving(self) -> bool:
        return any(engine.serving for engine in self.engines)

    @property
    def loading(self) -> bool:
        return any(engine.loading for engine in self.engines)

    @property
    def loaded(self) -> DeviceEngine | None:
        """The first engine that loaded: what the model and its voices are (all run the same)."""
        return next((engine for engine in self.engines if engine.scheduler.info is not None), None)

    @property
    def info(self) -> EngineInfo | None:
        engine = self.loaded
        return engine.scheduler.info if engine is not None else None

    @property
    def voices(self) -> tuple[str, ...]:
        engine = self.loaded
        return engine.scheduler.voices if engine is not None else ()

    async def wait_ready(self, engine: DeviceEngine, timeout_s: float) -> None:
        """Return once start-up is over (no engine still loading) and ``engine`` is up;
        ``engine_unavailable`` if it failed or start-up takes longer than ``timeout_s``.

        Sessions wait for every engine, not just their own: an engine still loading compiles
        and captures on the host, holding the interpreter and CPU that the others' ticks
        need (on an H200 a CPU engine's tick stalled 11 s while a CUDA engine compiled in
        the same process), so no session runs until start-up is over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.loading and loop.time() < deadline:
            await asyncio.sleep(0.05)
        engine.check_loaded()

    # Placement --------------------------------------------------------------------------------
    def choose(self, *, views_may_lag: bool = False, exclude: Collection[DeviceEngine] = ()) -> DeviceEngine | None:
        """The engine a new session would go to now (see the module doc), or None when none
        that can take one has a free slot.  ``views_may_lag``: an engine process's admission
        as this worker last heard it (``EngineAdmission``) may be a heartbeat old, so a
        serving engine process that looks full is still a candidate: it decides itself.
        ``exclude``: engines that have just refused this open (full after all)."""
        engines = [e for e in self.engines if e not in exclude]
        for usable in (lambda e: e.serving, lambda e: e.loading):
            candidates = [e for e in engines if usable(e) and e.admission.free > 0]
            if not candidates and views_may_lag:
                candidates = [e for e in engines if usable(e) and isinstance(e.admission, EngineAdmission)]
            if candidates:
                return min(candidates, key=lambda e: (-e.admission.free, e.index))
        return None

    def acquire(self, exclude: Collection[DeviceEngine] = ()) -> DeviceEngine:
        """Hold an admission slot on the engine placement picks (the caller has seen one
        there; an engine process's own admission has the last word at its open)."""
        engine = self.choose(views_may_lag=True, exclude=exclude)
        if engine is None or not engine.admission.try_acquire():
            raise RuntimeError("no engine has a free slot")
        return engine

    def unavailable(self) -> ProtocolError | None:
        """Why no engine can take any session (each failed, died or is stalled), or None."""
        if any(engine.serving or engine.loading for engine in self.engines):
            return None
        stalled = [engine for engine in self.engines if engine.watchdog.stalled is not None]
        if stalled:
            return ProtocolError("engine_stalled", self.describe(stalled, lambda e: e.watchdog.stalled),
                                 retryable=True)
        return ProtocolError("engine_unavailable", self.describe(self.engines, lambda e: e.unavailable()))

    def describe(self, engines: list[DeviceEngine], reason: Callable[[DeviceEngine], str | None]) -> str:
        """``reason`` of each engine; prefixed with its device when the pool has several."""
        if len(self.engines) == 1:
            return str(reason(engines[0]))
        return "; ".join(f"{engine.label}: {reason(engine)}" for engine in engines)

