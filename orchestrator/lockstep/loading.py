"""Loading one engine on its lockstep thread: build it, warm it up, capture its graphs, settle
its memory plan; what ``/ready`` shows while that runs (``engines/progress.py``), and what it
gave (the engine's info, voices and measured plan, or the error that ended it)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from engines import progress
from engines.config import FRAME_SAMPLES, ConfigError
from engines.errors import AudioInputError, CheckpointError, GpuArchError, MemoryPlanError
from engines.interface import Engine, EngineInfo, SessionSpec

log = logging.getLogger(__name__)

# Load failures caused by the checkpoint, a voice, the machine or a setting the GPU cannot run
# (not by this code): logged as one line (the server stays up; /health says why).
_INPUT_LOAD_ERRORS = (CheckpointError, ConfigError, AudioInputError, OSError, MemoryError, MemoryPlanError,
                      GpuArchError)


class EngineLoad:
    def __init__(self, factory: Callable[[], Engine], warmup_frames: int, device: str | None) -> None:
        self._factory = factory
        self._warmup_frames = warmup_frames  # silent frames stepped through a throwaway slot
        self._device = device
        self.ready = threading.Event()  # set when loading finished, successfully or not
        self.error: BaseException | None = None
        self.info: EngineInfo | None = None
        self.voices: tuple[str, ...] = ()
        self.memory_plan: dict[str, Any] | None = None  # the engine's, measured (for /ready)
        # Where loading is, and since when: for /ready while it loads.
        self.progress: progress.LoadProgress | None = None
        self.started: float | None = None

    def status(self) -> dict[str, Any] | None:
        """The phase and progress of a load under way (None once it has finished)."""
        current, started = self.progress, self.started
        if self.ready.is_set() or started is None:
            return None
        body = current.as_dict() if current is not None else {"phase": "starting"}
        body["elapsed_s"] = round(time.monotonic() - started, 1)
        return body

    def run(self) -> Engine | None:
        """Load the engine (on the thread that will drive it); None if loading failed (``error``)."""
        self.started = time.monotonic()
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
                # Everything compiled: what it cost, and the portable artifacts for the next start.
                if hasattr(engine, "finish_compiling"):
                    engine.finish_compiling()
        except BaseException as exc:  # noqa: BLE001 - reported through /health and opens
            if isinstance(exc, _INPUT_LOAD_ERRORS) or type(exc).__name__ == "OutOfMemoryError":
                # What the operator gave or has (files, memory): their message says it all.
                log.error("engine failed to load (device %s): %s", self._device, exc)
            else:  # a defect: keep the traceback
                log.exception("engine failed to load (device %s)", self._device)
            # Without its traceback: the frames would keep the half-built engine (and its
            # device memory) alive while the server reports the failure.
            exc.__traceback__ = None
            if exc.__cause__ is not None:
                exc.__cause__.__traceback__ = None
            self.error = exc
            self.ready.set()
            return None
        self.info = engine.info
        self.ready.set()
        log.info("engine ready: model=%s backend=%s device=%s slots=%d", engine.info.model, engine.info.backend,
                 self._device or engine.info.device, engine.info.max_slots)
        return engine

    def _on_progress(self, report: progress.LoadProgress) -> None:
        previous, self.progress = self.progress, report
        if previous is None or previous.phase != report.phase:  # the steps of a phase: /ready shows them
            log.info("loading (device %s): %s%s", self._device, report.phase, f": {report.detail}" if report.detail
                     else "")

    def _warm_up(self, engine: Engine) -> None:
        """Step a throwaway slot with silence so the first real session pays no one-time cost
        (lazy allocations, kernel selection, the default prefill)."""
        if self._warmup_frames <= 0:
            return
        progress.report(progress.WARM_UP, f"{self._warmup_frames} frames of silence")
        start = time.perf_counter()
        silence = np.zeros((1, FRAME_SAMPLES), dtype=np.float32)
        slot = engine.open_slot(SessionSpec())
        try:
            for _ in range(self._warmup_frames):
                engine.step([slot], silence)
        finally:
            engine.close_slot(slot)
        log.info("warm-up: %d frames in %.0f ms", self._warmup_frames, (time.perf_counter() - start) * 1e3)
