"""Names for OS threads, so that an operator's ``top -H`` tells the server's threads apart."""

from __future__ import annotations

import ctypes

PR_SET_NAME = 15  # prctl(2)


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: what ``top -H``, ``ps -L`` and
    ``/proc/PID/task/TID/comm`` show; 15 bytes at most), so an operator can tell the engine
    thread's CPU from the event loop's.  Python's own thread names stay inside Python."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode("ascii", "replace")[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, or no prctl: a cosmetic loss only
        pass
