"""Busy-looping processes beside a test (the CPU a co-tenant takes): ``pytest --busy-processes N``
for the whole suite (tests/conftest.py), or one test's own contention (tests/test_own_clock.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# Compute until the parent that started it is gone: a test run killed from outside (a CI
# timeout) leaves no busy process behind on a shared machine.
_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the host's count)."""
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that compute for as long as the block runs."""
    hogs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            hogs.append(subprocess.Popen([sys.executable, "-c", _LOOP]))
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
