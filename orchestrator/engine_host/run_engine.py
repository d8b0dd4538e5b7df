"""``python -m orchestrator.engine_host engine --run-dir D --index I``: one engine process.

Reads the server's settings (``settings.json``, written by the worker that started the
host) and its device from ``layout.json``, sizes its admission, binds its socket and serves
(``engine_process.EngineProcess``).  The model loads on the engine thread after the socket
is up, so the workers see a restarted engine (its new pid, state ``loading``) at once.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ..ipc.endpoints import layout_path, settings_path

log = logging.getLogger(__name__)


def run_engine(run_dir: Path, index: int) -> int:
    from ..settings import Settings

    settings = Settings.from_mapping(json.loads(settings_path(run_dir).read_text()))
    # The engine thread gives the interpreter up around every GPU call and needs it back
    # promptly from the IPC thread: a short switch interval bounds that wait.
    sys.setswitchinterval(0.0005)
    entry = json.loads(layout_path(run_dir).read_text())["engines"][index]
    device, label = entry["device"], entry["label"]
    import functools

    from engines.runtime.factory import build_engine

    from ..fault_injection import with_fault_injection
    from ..ipc.endpoints import metrics_dir
    from ..lockstep.scheduler import TickScheduler
    from ..metrics import Metrics
    from .engine_process import EngineProcess

    spec = settings.engine_spec(device)
    max_sessions = spec.max_slots
    factory = functools.partial(with_fault_injection(build_engine, settings.fault_injection, label), spec)
    metrics = Metrics(metrics_dir(run_dir))
    metrics.declare_device(label)
    scheduler = TickScheduler(factory, policy=settings.tick_policy_object(), silence_grace_s=settings.silence_grace_s,
                              warmup_frames=settings.warmup_frames, metrics=metrics, device=label,
                              concurrent_joins=settings.concurrent_joins, join_wait_s=settings.join_wait_s)
    process = EngineProcess(run_dir, index, label, max_sessions, scheduler, metrics=metrics,
                            watchdog_deadline_s=settings.watchdog_deadline_s)
    process.bind()
    log.info("engine %s: pid %d, max_sessions=%s, loading the model", label, process.status()["pid"],
             "auto (the memory plan's)" if max_sessions is None else max_sessions)
    process.serve()
    return 0


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m orchestrator.engine_host engine")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    return run_engine(args.run_dir, args.index)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
