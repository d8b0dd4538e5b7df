"""The front end's one view of an engine: the messages a lockstep hands back, and the interface
the front end uses of an engine.

Every engine runs in an engine process of its own (``engine_host/``), and a front-end worker
reaches it over IPC through an ``EnginePort``: ``frontend.engine_link.EngineLink`` is the one
the server uses, the tests' fakes are others.  Sessions, the engine pool and the watchdog hold
an ``EnginePort``.  What a tick gives back is a ``FrameResult`` per lane (or a
``FrameFailure``); ``ipc/wire.py`` encodes exactly these types.  Torch-free.
"""

from __future__ import annotations

import asyncio
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
    """What the front end uses of an engine.  Commands never block on the engine: they return
    futures or queue work.  The state is the engine's as last heard (a heartbeat old at most);
    the engine admits or refuses each open itself, for every worker of the server."""

    device: str  # the engine's device label ("cuda:0"; "cpu#1" when a device serves twice)
    ready: threading.Event  # set once the engine has loaded (or failed to)
    load_error: BaseException | None
    info: EngineInfo | None
    voices: tuple[str, ...]
    busy: EngineCall | None
    failed_ticks_in_row: int
    memory_plan: dict[str, Any] | None  # the engine's measured memory plan, once loaded
    engine_pid: int | None  # the engine process (None while it is not answering)
    max_sessions: int | None  # the engine's capacity (None until it has said; 0 while an auto plan loads)
    held: int  # sessions the engine has admitted, from every worker
    sessions_by_worker: dict[int, int]  # worker pid -> its sessions on this engine
    first_status: asyncio.Event  # set once the engine has first answered (its capacity is known)

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

    async def refresh(self) -> None:
        """Ask the engine for its state now (a request's answer is then exact)."""
