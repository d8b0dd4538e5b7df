"""The engine host: starts one engine process per device, restarts one that dies, and stops
them all when the server is gone.

One host per server (``ipc/endpoints.py``): it holds ``host.lock`` for its whole life, so a
second one started by a racing worker exits at once.  It resolves the devices from the
settings, writes ``layout.json`` (what the workers connect to) and then supervises:

- an engine process that exits is started again (its sessions were already told by their
  workers, which see its heartbeat stop or its pid change); one that keeps dying within
  ``QUICK_DEATH_S`` of its start is restarted after a growing pause (1, 2, 4 .. 30 s);
- when the server's hypercorn process (``--watch-pid``) has exited, or on SIGTERM/SIGINT,
  every engine gets SIGTERM, then SIGKILL after ``STOP_GRACE_S``.

The host itself never loads a model, so a bad GPU cannot take it down.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..ipc.endpoints import (engine_endpoint, engine_socket_path, layout_path, lock_path, metrics_dir, pid_alive,
                             settings_path, speaker_path, write_atomic)
from ..metrics import Metrics, mark_process_dead

log = logging.getLogger(__name__)

POLL_S = 0.05
QUICK_DEATH_S = 30.0
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 10.0
LOCK_TRIES = 20  # x 10 ms before the lock counts as another host's


class _Engine:
    def __init__(self, run_dir: Path, index: int, label: str, metrics: Any) -> None:
        self.run_dir, self.index, self.label = run_dir, index, label
        self.metrics = metrics
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.quick_deaths = 0
        self.restart_at: float | None = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.engine_host", "engine", "--run-dir",
                                      str(self.run_dir), "--index", str(self.index)])
        self.started = time.monotonic()
        self.restart_at = None
        log.info("engine host: started the engine of %s (pid %d)", self.label, self.proc.pid)

    def check(self, now: float) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.quick_deaths = self.quick_deaths + 1 if now - self.started < QUICK_DEATH_S else 0
            delay = 0.0 if self.quick_deaths <= 1 else min(MAX_BACKOFF_S, 2.0 ** (self.quick_deaths - 2))
            log.error("engine host: the engine process of %s (pid %d) ended (%s); restarting it%s", self.label,
                      self.proc.pid, how, f" in {delay:g} s" if delay else "")
            self.metrics.inc("engine_restarts", self.label)
            mark_process_dead(self.proc.pid)
            self.proc = None
            self.restart_at = now + delay
        if self.proc is None and self.restart_at is not None and now >= self.restart_at:
            self.start()


def run_host(run_dir: Path, watch_pid: int) -> int:
    lock = open(lock_path(run_dir), "a+")
    # The worker that started this host looks at the lock by taking it for an instant
    # (launch._host_running): only a lock still held after a few tries is another host's.
    for attempt in range(LOCK_TRIES):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == LOCK_TRIES - 1:
                log.info("engine host: another host already serves %s", run_dir)
                return 0
            time.sleep(0.01)
    from ..settings import Settings, SettingsError, device_labels

    try:
        settings = Settings.from_mapping(json.loads(settings_path(run_dir).read_text()))
        devices = settings.resolved_devices()
    except (OSError, ValueError, SettingsError) as exc:
        # The worker that started this host reports it (one line, then start-up ends).
        log.debug("engine host: cannot start: %s", exc)
        _write_layout(run_dir, [], error=str(exc))
        return 2
    labels = device_labels(devices)
    shutil.rmtree(metrics_dir(run_dir), ignore_errors=True)  # a previous server's values
    metrics_dir(run_dir).mkdir()
    metrics = Metrics(metrics_dir(run_dir))
    engines = [_Engine(run_dir, i, label, metrics) for i, label in enumerate(labels)]
    _write_layout(run_dir, [{"index": i, "device": d, "label": label, "endpoint": engine_endpoint(run_dir, i)}
                            for i, (d, label) in enumerate(zip(devices, labels))])
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    log.info("engine host (pid %d) for server %d: %d engine(s): %s", os.getpid(), watch_pid, len(engines),
             ", ".join(labels))
    try:
        while not stopping and pid_alive(watch_pid):
            now = time.monotonic()
            for engine in engines:
                engine.check(now)
            time.sleep(POLL_S)
    finally:
        _stop(engines)
        for engine in engines:
            try:
                engine_socket_path(run_dir, engine.index).unlink()
            except FileNotFoundError:
                pass
        _clean(run_dir)
    log.info("engine host: stopped (%s)", "signal" if stopping else "the server has exited")
    return 0


def _clean(run_dir: Path) -> None:
    """Remove what this server put in its run directory (the workers have exited by now), and
    the directory itself if nothing else is in it."""
    shutil.rmtree(metrics_dir(run_dir), ignore_errors=True)
    for path in (layout_path(run_dir), settings_path(run_dir), speaker_path(run_dir), run_dir / "spawn.lock",
                 lock_path(run_dir)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    try:
        run_dir.rmdir()
    except OSError:  # not empty: an operator's directory (PERSONAPLEX_RUN_DIR) with more in it
        pass


def _stop(engines: list[_Engine]) -> None:
    running = [e.proc for e in engines if e.proc is not None and e.proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("engine host: engine pid %d did not stop in %g s; killing it", proc.pid, STOP_GRACE_S)
            proc.kill()
            proc.wait(5)


def _write_layout(run_dir: Path, engines: list[dict], error: str | None = None) -> None:
    body: dict = {"host_pid": os.getpid(), "engines": engines}
    if error is not None:
        body["error"] = error
    write_atomic(layout_path(run_dir), json.dumps(body))
