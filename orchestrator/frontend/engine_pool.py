"""The engines a front-end worker reaches, one per device, and where a new session goes.

A ``DeviceEngine`` is this worker's view of one device's engine: the ``EnginePort`` that
reaches its engine process (``engine_link.EngineLink``; the engine host started it), the
worker's reading of that engine's admission (``EngineAdmission``: the engine admits for every
worker) and a ``Watchdog``.  Devices share only the event loop, the metrics and the registry of
sessions: a tick on one GPU never waits for another.  ``PERSONAPLEX_DEVICES`` lists the
devices; without it the pool holds the one engine of ``PERSONAPLEX_DEVICE``.

Placement: a new session goes to the *serving* engine (loaded, alive, not stalled) with the
most free slots as last heard, ties to the lowest index.  Only when no serving engine has a slot
does an engine that is still loading get it.  Either way its open waits until start-up is over:
no session runs while any engine is still loading (``EnginePool.wait_ready``).  Engines that
failed to load, whose process is lost or that are stalled get none.  The counts this worker
reads may be a heartbeat old, so at an open a serving engine that looks full is still asked:
its answer is what counts (``EnginePool.choose``).  A session stays on its engine for its
whole life.

Lives on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Collection
from typing import Any

from engines.interface import EngineInfo, SessionSpec

from ..engine_port import EngineCall, EnginePort
from ..watchdog import Watchdog
from ..metrics import Metrics
from ..protocol.errors import ProtocolError
from ..settings import Settings, StartupError
from .admission import EngineAdmission
from .engine_link import EngineLink

log = logging.getLogger(__name__)

# on_stall(engine, call, elapsed): an engine call of ``engine`` is past the watchdog deadline.
StallHandler = Callable[["DeviceEngine", EngineCall, float], None]


class DeviceEngine:
    """One device's engine as this worker sees it (see the module doc)."""

    def __init__(self, index: int, label: str, port: EnginePort, *, watchdog_deadline_s: float, metrics: Metrics,
                 on_stall: StallHandler) -> None:
        self.index = index
        self.label = label  # the device, made unique ("cpu#1") when a device serves twice
        self.port = port
        self.admission = EngineAdmission(port)
        # The engine process counts its own stalls: every worker watches the same engine.
        self.watchdog = Watchdog(port, watchdog_deadline_s, metrics, lambda call, elapsed: on_stall(self, call, elapsed),
                                 count_stalls=False)
        metrics.declare_device(label)

    @property
    def max_sessions(self) -> int:
        return self.admission.capacity

    @property
    def engine_pid(self) -> int | None:
        return self.port.engine_pid

    def start(self, deliver: Callable[[list], None]) -> None:
        self.port.start(deliver)

    # State ------------------------------------------------------------------------------------
    @property
    def loading(self) -> bool:
        return not self.port.ready.is_set()

    def unavailable(self) -> str | None:
        """Why this engine can take no session (load failed, process lost, stalled), or None."""
        port = self.port
        if port.load_error is not None:
            return f"the model failed to load: {port.load_error}"
        if not self.loading and not port.alive:
            return "the engine has stopped"
        return self.watchdog.stalled

    @property
    def state(self) -> str:
        """``loading``, ``ready`` (serving), ``stalled`` or ``failed`` (load failed, process lost)."""
        if self.port.load_error is not None or (not self.loading and not self.port.alive):
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
        if self.port.load_error is None and self.loading:
            return "No engine initialized (loading)"
        problem = self.unavailable()
        if problem is not None:
            return problem
        failed = self.port.failed_ticks_in_row
        if unhealthy_after_failed_ticks and failed >= unhealthy_after_failed_ticks:
            return f"the last {failed} ticks all failed"
        return None

    def status(self) -> dict[str, Any]:
        """This engine's entry in ``/ready`` and its per-device metrics."""
        state = self.state
        body = {"device": self.label, "ready": state == "ready", "state": state, "free_slots": self.admission.free,
                "max_sessions": self.max_sessions, "live_sessions": self.admission.held, "engine_pid": self.engine_pid,
                "sessions_by_worker": {str(pid): n for pid, n in sorted(self.port.sessions_by_worker.items())}}
        loading = self.loading_status()
        if loading is not None:
            body["loading"] = loading
        if self.port.memory_plan is not None:  # the engine's, measured at start-up
            body["memory_plan"] = self.port.memory_plan
        return body

    def loading_status(self) -> dict[str, Any] | None:
        """While this engine loads: ``{"phase", "detail"?, "done"?, "total"?, "elapsed_s"}``
        (engines/progress.py); None otherwise."""
        return self.port.loading_status() if self.loading and self.port.load_error is None else None

    # Sessions ---------------------------------------------------------------------------------
    def check_loaded(self) -> None:
        """``engine_unavailable`` unless the engine has loaded."""
        if self.port.load_error is not None:
            raise ProtocolError("engine_unavailable", str(self.unavailable()))  # "the model failed to load: ..."
        if self.loading:
            raise ProtocolError("engine_unavailable", "the model is still loading; retry later", retryable=True)

    def open(self, key: str, spec: SessionSpec) -> concurrent.futures.Future:
        return self.port.open(key, spec)

    def close(self, key: str) -> concurrent.futures.Future:
        """Free the session's engine slot (the engine counts it free once it is done, so a
        reopen never races a close that has not finished)."""
        return self.port.close(key)


class EnginePool:
    def __init__(self, engines: list[DeviceEngine]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines

    @classmethod
    def connect(cls, settings: Settings, layout: dict[str, Any], metrics: Metrics, on_stall: StallHandler) -> EnginePool:
        """One ``EngineLink`` per engine process of ``layout`` (``engine_host/host.py``)."""
        engines = []
        for entry in layout["engines"]:
            link = EngineLink(entry["index"], entry["label"], entry["endpoint"])
            engines.append(DeviceEngine(entry["index"], entry["label"], link,
                                        watchdog_deadline_s=settings.watchdog_deadline_s, metrics=metrics,
                                        on_stall=on_stall))
        return cls(engines)

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait for every engine process's first status (it says the engine's capacity)."""
        ports = [engine.port for engine in self.engines]
        try:
            await asyncio.wait_for(asyncio.gather(*(port.first_status.wait() for port in ports)), timeout_s)
        except asyncio.TimeoutError:
            missing = [port.device for port in ports if not port.first_status.is_set()]
            raise StartupError(f"the engine process(es) of {', '.join(missing)} did not answer within "
                               f"{timeout_s:g} s") from None

    async def refresh(self) -> None:
        """Ask every engine for its state now, so that what this worker reports is exact
        whichever worker answers (between requests its view is a heartbeat old)."""
        await asyncio.gather(*(engine.port.refresh() for engine in self.engines))

    def start(self, deliver: Callable[[list], None]) -> None:
        for engine in self.engines:
            engine.start(deliver)

    def stop(self) -> None:
        for engine in self.engines:  # ask every link to stop before waiting for any
            engine.port.request_stop()
        for engine in self.engines:
            engine.port.stop()

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
        return next((engine for engine in self.engines if engine.port.info is not None), None)

    @property
    def info(self) -> EngineInfo | None:
        engine = self.loaded
        return engine.port.info if engine is not None else None

    @property
    def voices(self) -> tuple[str, ...]:
        engine = self.loaded
        return engine.port.voices if engine is not None else ()

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
    def choose(self, *, at_open: bool = False, exclude: Collection[DeviceEngine] = ()) -> DeviceEngine | None:
        """The engine a new session would go to now (see the module doc), or None when none
        that can take one has a free slot.  ``at_open``: for the open itself, where this
        worker's view of an engine's admission may be a heartbeat old, so a serving engine that
        looks full is still a candidate (it decides itself).  ``exclude``: engines that have
        just refused this open (full after all)."""
        engines = [e for e in self.engines if e not in exclude]
        for usable in (lambda e: e.serving, lambda e: e.loading):
            candidates = [e for e in engines if usable(e) and e.admission.free > 0]
            if not candidates and at_open:
                candidates = [e for e in engines if usable(e)]
            if candidates:
                return min(candidates, key=lambda e: (-e.admission.free, e.index))
        return None

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

