"""Ending a server that cannot start: one line, then a nonzero exit status.

A worker whose start-up fails (bad settings, no CUDA where it is asked for, an engine host
that cannot start) logs what is wrong as one line and leaves at once with
``START_FAILED_EXIT``, so that neither Quart's nor hypercorn's tracebacks bury the line.
Who sees that status:

- ``python -m orchestrator.serve`` / ``personaplex-serve`` (our master) exits with it;
- a worker that is the server's only process (``hypercorn --workers 0``) exits with it;
- hypercorn's own master (``hypercorn orchestrator:app``) would report 0 once its workers have
  all exited, whatever their status (hypercorn 0.18, pgjones/hypercorn#269), and a supervisor
  (systemd, Kubernetes) would take a failed start for a clean stop.  So the worker ends that
  master with ``SIGUSR1``, whose default action terminates it: the shell sees status 138.
  Every worker of a server fails its start-up the same way (the settings are the server's),
  so no worker is left serving without its master.

With several workers, the first to fail reports (it holds a name that one process of the
server can hold, ``_claim_the_report``) and waits a moment for the others, which then exit
without repeating the line.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path

from ..ipc.endpoints import pid_alive, server_group_pid

log = logging.getLogger("orchestrator")

START_FAILED_EXIT = 3  # the worker's status: start-up failed, and the reason has been logged
MASTER_SIGNAL = signal.SIGUSR1
SIBLING_WAIT_S = 2.0  # the longest the reporting worker waits for the others to fail too
_HELD: list[socket.socket] = []


def end_start_up(reason: str) -> None:
    """Log ``reason`` as the one line of this failure and end the server (does not return)."""
    parent = multiprocessing.parent_process()
    siblings = _siblings(parent.pid) if parent is not None and parent.pid is not None else []
    if _claim_the_report():  # the first worker of this server to fail says why; the others do not repeat it
        log.error("cannot start: %s", reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        # Hold the claim while the other workers, failing the same way, come to it.
        deadline = time.monotonic() + SIBLING_WAIT_S
        while any(pid_alive(pid) for pid in siblings) and time.monotonic() < deadline:
            time.sleep(0.02)
    if parent is not None and parent.pid is not None and _is_hypercorn_master(parent.pid):
        _release_shared_semaphores()
        try:
            os.kill(parent.pid, MASTER_SIGNAL)
        except ProcessLookupError:  # another worker ended it first
            pass
    os._exit(START_FAILED_EXIT)  # no unwinding: Quart and hypercorn would log the failure again


def _siblings(master: int) -> list[int]:
    """The other workers of this server (the master's other children), while it has them."""
    try:
        children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    except OSError:
        return []
    return [int(pid) for pid in children if int(pid) != os.getpid()]


def _claim_the_report() -> bool:
    """Whether this worker is the first of its server to report a failed start: a name in
    Linux's abstract socket namespace, one per server (its master's pid), that only one
    process can hold and that vanishes with it.  Where there is no such namespace, every
    worker reports."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        claim.bind(f"\0personaplex-serve-start-failed-{server_group_pid()}")
    except OSError as exc:
        claim.close()
        return exc.errno != errno.EADDRINUSE
    _HELD.append(claim)  # held until this process exits
    return True


def _release_shared_semaphores() -> None:
    """Unlink the named semaphores of the master's ``multiprocessing`` events (hypercorn's
    shutdown event, shared with its workers) and take them off its resource tracker's list.
    Once the master has been ended by a signal, the tracker would unlink them itself and warn
    about "leaked semaphore objects": done here, the line above stays the only one.  Best
    effort: these are ``multiprocessing`` internals, and a failure here costs only the warning."""
    import gc
    from multiprocessing import resource_tracker, synchronize

    try:
        import _multiprocessing

        for event in [o for o in gc.get_objects() if isinstance(o, synchronize.Event)]:
            condition = event._cond
            for lock in (condition._lock, condition._sleeping_count, condition._woken_count,
                         condition._wait_semaphore, event._flag):
                name = lock._semlock.name
                if name:
                    _multiprocessing.sem_unlink(name)
                    resource_tracker.unregister(name, "semaphore")
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _is_hypercorn_master(pid: int) -> bool:
    """``pid`` runs hypercorn's own command line (not ``orchestrator.serve``'s, which reports
    a worker's start-up failure itself)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # ``hypercorn ...`` runs as ``python .../bin/hypercorn ...``; ``python -m hypercorn ...`` too.
    return "hypercorn" in (os.path.basename(arg.decode(errors="replace")) for arg in argv)
