"""The front end's one view of an engine: the messages a lockstep hands back, and the interface
both engine layouts offer (issue 35, step 1).

An engine runs either as a thread of this process (``lockstep.scheduler.TickScheduler``) or in
an engine process reached over IPC (``frontend.engine_link.EngineLink``).  Sessions, the engine
pool and the watchdog hold an ``EnginePort`` and never ask which.  What a tick gives back is a
``FrameResult`` per lane (or a ``FrameFailure``), the same objects in both layouts;
``ipc/wire.py`` encodes exactly these types.  Torch-free.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from engines.interface import EngineInfo, SessionSpec


@dataclass(frozen=True)
class FrameResult:
    """One output frame of one lane, as handed to the event loop."""

    key: str
    epoch: int
    pcm16: np.ndarray  # int16 [1920]
    text: str
    text_id: int
    silence_input: bool  # the input of this frame was fed silence, not client audio
    tick: int
    tick_ms: float
    batch_size: int
    wait_ms: float  # how long the input frame waited for its tick


@dataclass(frozen=True)
class FrameFailure:
    """``engine.step`` failed for this lane (alone, or with its whole tick)."""

    key: str
    epoch: int
    message: str
    fatal: bool = False  # the slot could not be restarted: the session cannot go on


@dataclass(frozen=True)
class EngineCall:
    """The engine call in progress (read by the watchdog from the event loop)."""

    kind: str  # tick | open | restart | close
    since: float  # the engine's clock
    sessions: int  # how many sessions it concerns (the tick's batch size)


class EnginePort(Protocol):
    """What the front end uses of an engine, in either layout.  Commands never block on the
    engine: they return futures or queue work."""

    ready: threading.Event  # set once the engine has loaded (or failed to)
    load_error: BaseException | None
    info: EngineInfo | None
    voices: tuple[str, ...]
    busy: EngineCall | None
    failed_ticks_in_row: int
    memory_plan: dict[str, Any] | None  # the engine's measured memory plan, once loaded

    @property
    def is_ready(self) -> bool: ...

    @property
    def alive(self) -> bool: ...

    def start(self, deliver: Callable[[list], None]) -> None:
        """Start; ``deliver(results)`` gets each tick's ``FrameResult``/``FrameFailure`` list."""

    def request_stop(self) -> None: ...

    def stop(self, timeout: float) -> None: ...

    def open(self, key: str, spec: SessionSpec) -> concurrent.futures.Future: ...

    def close(self, key: str) -> concurrent.futures.Future: ...

    def restart(self, key: str, epoch: int) -> None: ...

    def push(self, key: str, epoch: int, frames: np.ndarray) -> None: ...

    def drop_pending(self, key: str) -> None: ...

    def pending(self, key: str) -> int: ...

    def loading_status(self) -> dict[str, Any] | None: ...
