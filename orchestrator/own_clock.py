"""A thread's own time: wall-clock time less the time the thread was ready to run but waited
for a CPU.

How long a stretch of work held up the sessions that wait for it is its wall time.  On a host
that other processes share, part of that is the scheduler giving the CPU to someone else, and
that part says nothing about the server's code.  Linux counts it per thread
(``/proc/self/task/TID/schedstat``, the second field: nanoseconds spent runnable on a run
queue), so subtracting it leaves what the thread's own work and its own waits cost: computing,
sleeping, waiting on a lock, the interpreter lock, a socket or the GPU.  A callback that blocks
an event loop shows in full, however busy the host; a host that is merely busy shows little
(tests/test_own_clock.py).  One way a busy host still shows: a wait on a lock (the interpreter
lock included) whose holder is itself waiting for a CPU counts as the waiter's own time.

Where the kernel does not say (not Linux, or no schedstat), the clock is plain wall time.
"""

from __future__ import annotations

import os
import threading
import time


class OwnClock:
    """``now()``: a monotonic clock in seconds that stands still while this thread waits for a
    CPU.  Made on, and read from, the thread it measures (the counter is that thread's)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def waited_s(self) -> float:
        """Seconds this thread has spent runnable, waiting for a CPU (0.0 where unknown)."""
        if self._fd is None:
            return 0.0
        # One pread of a few bytes (~10 us): cheap enough for every 50 ms beat or engine job.
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def now(self) -> float:
        return time.monotonic() - self.waited_s()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
