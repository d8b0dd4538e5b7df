"""A front-end worker's reading of an engine's admission.

The engine process admits or refuses each open itself, for every worker of the server
(``engine_host/engine_process.py``): a slot is counted from the moment an open is admitted (so
concurrent opens cannot oversubscribe while the prefill runs) until the engine has released it
after cleanup (so a reopen never races a close that has not finished).  A worker only reads the
counts of the engine's latest status, to place sessions and to answer ``/ready``; they may be a
heartbeat old, so nothing is refused on them: the engine's answer to the open is what counts.
Used only on the event loop.
"""

from __future__ import annotations

from ..engine_port import EnginePort


class EngineAdmission:
    def __init__(self, port: EnginePort) -> None:
        self._port = port

    @property
    def capacity(self) -> int:
        return self._port.max_sessions or 0

    @property
    def held(self) -> int:
        return self._port.held

    @property
    def free(self) -> int:
        if not self.capacity and not self._port.ready.is_set():
            return 1  # auto, still loading: not full (the engine admits, then decides)
        return max(0, self.capacity - self.held)
