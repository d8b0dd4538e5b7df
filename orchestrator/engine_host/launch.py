"""A front-end worker's way to its server's engine host: find it, or start it.

Every worker of a server calls ``ensure_host``; the first to take ``spawn.lock`` writes the
settings and starts the host (in a session of its own, so that neither a worker's death nor a
terminal's Ctrl-C reaches it before the server itself has gone: the host follows the
server's hypercorn process and stops its engines after that); the others find it running.
All of them then read ``layout.json``; the first to read it speaks for the server in the log.
``personaplex-serve``'s master starts the host itself (``start_host``) before any worker.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..ipc.endpoints import layout_path, lock_path, settings_path, speaker_path, write_atomic
from ..settings import StartupError

log = logging.getLogger(__name__)

LAYOUT_TIMEOUT_S = 120.0  # the host resolves the devices (may import torch) before writing it


class HostStartError(StartupError):
    """The engine host could not be started or reported an error (its message says which)."""


def _host_running(run_dir: Path) -> bool:
    """True while some process holds ``host.lock``."""
    try:
        with open(lock_path(run_dir), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True


def start_host(settings: Any, run_dir: Path, watch_pid: int) -> bool:
    """Start this server's engine host unless it runs (without waiting for its layout): True
    if this call started it.  ``personaplex-serve``'s master calls it before its workers exist,
    so that the engine's loading starts while they import the app."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "spawn.lock", "a+") as spawn:
        fcntl.flock(spawn, fcntl.LOCK_EX)
        if _host_running(run_dir):
            return False
        for stale in (layout_path(run_dir), speaker_path(run_dir)):  # of a host that is gone
            try:
                stale.unlink()
            except FileNotFoundError:
                pass
        write_atomic(settings_path(run_dir), json.dumps(dataclasses.asdict(settings)))
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.engine_host", "host", "--run-dir",
                                 str(run_dir), "--watch-pid", str(watch_pid)], start_new_session=True)
        log.info("started the engine host (pid %d) in %s", proc.pid, run_dir)
        deadline = time.monotonic() + 10.0
        while not _host_running(run_dir):  # keep the other workers out until it holds its lock
            if proc.poll() is not None:  # it may have failed whole before this loop looked
                raise HostStartError(_reported_error(run_dir)
                                     or f"the engine host exited at start (code {proc.returncode})")
            if time.monotonic() > deadline:
                raise HostStartError("the engine host did not start within 10 s")
            time.sleep(0.02)
    return True


def ensure_host(settings: Any, run_dir: Path, watch_pid: int) -> tuple[dict[str, Any], bool]:
    """Start this server's engine host unless it runs; return its layout (``layout.json``)
    and whether this worker speaks for the server in the log (the first worker to get here
    since the host started)."""
    start_host(settings, run_dir, watch_pid)
    layout = _wait_layout(run_dir)
    return layout, _claim_speaker(run_dir)


def _claim_speaker(run_dir: Path) -> bool:
    """True for the first worker to ask since the host started (``start_host`` clears it)."""
    try:
        fd = os.open(speaker_path(run_dir), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _read_layout(run_dir: Path) -> dict[str, Any] | None:
    """The host's ``layout.json``, or None while there is none (it is written atomically)."""
    try:
        return json.loads(layout_path(run_dir).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _reported_error(run_dir: Path) -> str | None:
    """The error a failed host wrote into its layout, if it wrote one."""
    return (_read_layout(run_dir) or {}).get("error")


def _wait_layout(run_dir: Path) -> dict[str, Any]:
    deadline = time.monotonic() + LAYOUT_TIMEOUT_S
    while time.monotonic() < deadline:
        running = _host_running(run_dir)
        # Read after looking at the lock: a host that fails writes its error and then exits,
        # so a layout missing *after* the host was seen gone means it wrote none.
        layout = _read_layout(run_dir)
        if layout is None:
            if not running:
                raise HostStartError(f"the engine host of {run_dir} is not running")
            time.sleep(0.02)
            continue
        if layout.get("error"):
            raise HostStartError(layout["error"])
        return layout
    raise HostStartError(f"the engine host wrote no layout within {LAYOUT_TIMEOUT_S:g} s")
