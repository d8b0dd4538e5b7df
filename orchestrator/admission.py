"""Admission: how many sessions may hold an engine slot at once.

A slot is counted from the moment an open is admitted (so concurrent opens cannot
oversubscribe while the prefill runs) until the engine has released it after cleanup (so a
reopen never races a close that has not finished).  Used only on the event loop.
"""

from __future__ import annotations


class SlotPool:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.held = 0

    @property
    def free(self) -> int:
        return self.capacity - self.held

    def try_acquire(self) -> bool:
        if self.held >= self.capacity:
            return False
        self.held += 1
        return True

    def release(self) -> None:
        if self.held <= 0:
            raise RuntimeError("SlotPool.release without a matching acquire")
        self.held -= 1
