"""Where one server's engine processes and workers meet: its run directory.

Every process of one server (hypercorn's workers, the engine host, its engine processes)
finds the others through one directory, named after the server's *group*: the hypercorn
process that spawned the workers (``multiprocessing.parent_process()`` in a worker), or the
process itself when it serves alone.  Two servers on one machine therefore never meet, and
a restarted server starts from an empty directory.  ``PERSONAPLEX_RUN_DIR`` names it
explicitly (one server per directory).

Contents: ``host.lock`` (held by the engine host for its life), ``settings.json`` (the
workers' settings, which the engine processes read), ``layout.json`` (the engines the host
started: device, label, admission, endpoint), ``engine-<i>.sock`` (each engine's ROUTER),
``metrics/`` (prometheus_client's multiprocess files).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from pathlib import Path


def server_group_pid() -> int:
    """The pid shared by every worker of this server (see the module doc)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getpid()


def default_run_dir() -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return base / f"personaplex-serve-{os.getuid()}" / str(server_group_pid())


def engine_endpoint(run_dir: Path, index: int) -> str:
    return f"ipc://{run_dir / f'engine-{index}.sock'}"


def engine_socket_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"engine-{index}.sock"


def settings_path(run_dir: Path) -> Path:
    return run_dir / "settings.json"


def layout_path(run_dir: Path) -> Path:
    return run_dir / "layout.json"


def lock_path(run_dir: Path) -> Path:
    return run_dir / "host.lock"


def speaker_path(run_dir: Path) -> Path:
    """The pid of the worker that logs what concerns the whole server (engine_host/launch.py)."""
    return run_dir / "speaker"


def metrics_dir(run_dir: Path) -> Path:
    return run_dir / "metrics"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a worker, the server's master: all on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
