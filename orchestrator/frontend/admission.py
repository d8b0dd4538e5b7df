"""Admission: how many sessions may hold an engine slot at once.

A slot is counted from the moment an open is admitted (so concurrent opens cannot
oversubscribe while the prefill runs) until the engine has released it after cleanup (so a
reopen never races a close that has not finished).  What is held is never less than the
slots the engine itself reports taken, so a slot the engine lost is never offered as free.
Used only on the event loop.
"""

from __future__ import annotations

from typing import Any, Callable


class SlotPool:
    """Admission of an engine that runs in this process (``PERSONAPLEX_ENGINE_HOST=thread``)."""

    def __init__(self, capacity: int | None, engine_taken: Callable[[], int] = lambda: 0,
                 engine_slots: Callable[[], int | None] = lambda: None) -> None:
        # ``engine_taken``: the slots the engine holds (``TickScheduler.slots_taken``);
        # ``engine_slots``: its slot count once loaded, the capacity when ``capacity`` is None
        # (the engine's memory plan decides; 0 until it has loaded).
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self.admitted = 0
        self._engine_taken = engine_taken
        self._engine_slots = engine_slots

    @property
    def capacity(self) -> int:
        if self._capacity is not None:
            return self._capacity
        return self._engine_slots() or 0

    @property
    def known(self) -> bool:
        """Whether the capacity is known (configured, or the engine has loaded)."""
        return self._capacity is not None or self._engine_slots() is not None

    @property
    def held(self) -> int:
        return max(self.admitted, self._engine_taken())

    @property
    def free(self) -> int:
        # Capacity not known yet (auto: the engine still loads): not full; an open waits for
        # the load, and the engine refuses what its plan does not fit.
        return max(0, self.capacity - self.held) if self.known else 1

    def try_acquire(self) -> bool:
        if self.known and self.held >= self.capacity:
            return False
        self.admitted += 1
        return True

    def release(self) -> None:
        if self.admitted <= 0:
            raise RuntimeError("SlotPool.release without a matching acquire")
        self.admitted -= 1


class EngineAdmission:
    """Admission kept by an engine process for every worker of the server (global): the
    engine admits or refuses each open itself (``engine_host/engine_process.py``), so this
    worker only reads the counts of its latest status, to place sessions and to answer
    ``/ready``.  The counts may be a heartbeat old, so nothing is refused on them: the
    engine's answer to the open is what counts."""

    def __init__(self, link: Any) -> None:
        self._link = link  # orchestrator.frontend.engine_link.EngineLink

    @property
    def capacity(self) -> int:
        return self._link.max_sessions or 0

    @property
    def held(self) -> int:
        return self._link.held

    @property
    def free(self) -> int:
        if not self.capacity and not self._link.ready.is_set():
            return 1  # auto, still loading: not full (the engine process admits, then decides)
        return max(0, self.capacity - self.held)

    def try_acquire(self) -> bool:
        return True  # the engine admits or refuses the open itself

    def release(self) -> None:
        pass  # the engine released it when it freed the slot
