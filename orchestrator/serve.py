"""``personaplex-serve --workers K ...`` (``python -m orchestrator.serve [orchestrator:app] ...``):
hypercorn's command line, with every server setting as a flag too (``--help`` lists them), and
a master that keeps the server up when one worker dies.

hypercorn's own master (``hypercorn --workers K``) stops every worker as soon as one exits
with an error, so one crashed worker ends every session of the server.  This master takes
the same arguments (it is hypercorn's parser; only the supervision differs) and:

- accepts every connection itself and hands it to the serving worker that holds the fewest
  live connections (``handoff.py``: with one socket shared by K workers a burst of
  connections lands on two or three of them); the K workers run hypercorn's connection
  handling on an ``asyncio`` loop (``uvloop`` with ``-k uvloop``);
- replaces a worker that exits while the server is serving (after a pause that grows while
  workers keep dying within ``QUICK_DEATH_S`` of their start): the engine processes free
  the dead worker's sessions, and the other workers' sessions are not touched;
- checks the settings before it starts anything, and listens before it starts workers: a
  bad setting or a port in use is one line and exit status 3 (``START_FAILED_EXIT``);
- starts the engine host itself, before the workers (``start_engine_host``): the engine's
  loading does not wait for a worker to import the app;
- stops with exit status 3 when a worker reports a failed start-up (its one line is already
  logged: no CUDA, an engine host that cannot start), and with 1 when a worker exits with
  another error during start-up (within ``QUICK_DEATH_S`` of the start, before any worker has
  lived that long), where hypercorn's own master reports 0; a worker killed by a signal is
  replaced;
- on SIGTERM or SIGINT tells every worker to shut down gracefully (each drains its
  sessions) and waits for all of them.

The engine host follows this process (it is the workers' parent), as it follows hypercorn's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from collections.abc import MutableMapping
from typing import Any

from .frontend.start_failure import START_FAILED_EXIT
from .settings import Settings, SettingsError, env_name
from .settings_help import setting_flags, settings_help

log = logging.getLogger("orchestrator.serve")

DEFAULT_APP = "orchestrator:app"

QUICK_DEATH_S = 10.0
MAX_BACKOFF_S = 10.0


def supervise(config: Any) -> int:
    """Run ``config.workers`` workers and keep them running until SIGTERM/SIGINT."""
    from hypercorn.asyncio.run import asyncio_worker, uvloop_worker

    from .handoff import Dispatcher, serve_worker

    if config.worker_class not in ("asyncio", "uvloop"):
        raise SystemExit(f"orchestrator.serve: worker class {config.worker_class!r} is not supported "
                         "(asyncio or uvloop)")
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        log.error("cannot start: cannot listen on %s: %s (is another server using it? choose another with "
                  "--bind HOST:PORT)", ", ".join(config.bind), exc.strerror or exc)
        return START_FAILED_EXIT
    # The master accepts and hands each connection to the worker holding the fewest
    # (handoff.py); QUIC stays on hypercorn's workers, which share the sockets.
    dispatcher = None
    if not sockets.quic_sockets:
        try:
            dispatcher = Dispatcher([(sock, True) for sock in sockets.secure_sockets]
                                    + [(sock, False) for sock in sockets.insecure_sockets], config.backlog)
        except OSError as exc:
            log.error("cannot start: cannot listen on %s: %s", ", ".join(config.bind), exc.strerror or exc)
            return START_FAILED_EXIT
    if not start_engine_host():
        return START_FAILED_EXIT
    context = multiprocessing.get_context("spawn")
    shutdown = context.Event()
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if dispatcher is not None:
            dispatcher.stop_accepting()
        shutdown.set()

    # Workers inherit an ignored SIGINT: Ctrl-C reaches the master, which shuts them down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    workers: dict[Any, tuple[float, int]] = {}  # process -> (start time, slot)
    quick_deaths = 0

    def start_worker(slot: int) -> None:
        kwargs: dict[str, Any] = {"config": config, "sockets": sockets, "shutdown_event": shutdown}
        if dispatcher is None:
            target: Any = uvloop_worker if config.worker_class == "uvloop" else asyncio_worker
            channel = None
        else:
            target = serve_worker
            channel = kwargs["channel"] = dispatcher.attach(slot)
            kwargs["worker_class"] = config.worker_class
        process = context.Process(target=target, kwargs=kwargs)
        process.start()
        if channel is not None:
            channel.close()  # the worker has its own copy
        workers[process] = (time.monotonic(), slot)

    if dispatcher is not None:
        dispatcher.start()
    for slot in range(max(1, config.workers)):
        start_worker(slot)
    for signame in ("SIGINT", "SIGTERM"):
        signal.signal(getattr(signal, signame), on_signal)
    exitcode = 0
    began = time.monotonic()
    served = False  # a worker has lived past QUICK_DEATH_S: start-up is over
    while workers:
        ended = wait([p.sentinel for p in workers], timeout=0.5)
        now = time.monotonic()
        served = served or any(now - started >= QUICK_DEATH_S for started, _ in workers.values())
        if dispatcher is not None and dispatcher.failed and not shutdown.is_set():
            shutdown.set()  # nothing accepts connections any more: end, and let the supervisor restart us
            exitcode = 1
        if shutdown.is_set() and dispatcher is not None:
            dispatcher.stop_accepting()
        for process in [p for p in list(workers) if p.sentinel in ended]:
            started, slot = workers.pop(process)
            process.join()
            if dispatcher is not None:
                dispatcher.detach(slot)
            if shutdown.is_set():
                exitcode = exitcode or (process.exitcode if process.exitcode and process.exitcode > 0 else 0)
                continue
            if process.exitcode == START_FAILED_EXIT and not served:
                # It said why in one line (frontend/start_failure.py); the others would too.
                shutdown.set()
                exitcode = START_FAILED_EXIT
                continue
            if not served and now - began < QUICK_DEATH_S and (process.exitcode or 0) > 0:
                # It raised before the server had been up for long (a signal is another
                # matter: a kill, an OOM): start-up failed; starting it again would fail the
                # same way.
                log.error("worker %d failed at start-up (exit code %s); stopping the server (see the error above)",
                          process.pid, process.exitcode)
                shutdown.set()
                exitcode = 1
                continue
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < QUICK_DEATH_S else 0
            delay = 0.0 if quick_deaths <= 1 else min(MAX_BACKOFF_S, 2.0 ** (quick_deaths - 2))
            log.error("worker %d ended (exit code %s) while serving; starting another%s", process.pid,
                      process.exitcode, f" in {delay:g} s" if delay else "")
            if quick_deaths > 5:
                log.error("workers keep dying at start; stopping the server")
                shutdown.set()
                exitcode = 1
                continue
            time.sleep(delay)
            start_worker(slot)
    if dispatcher is not None:
        dispatcher.join()
    for sock in [*sockets.secure_sockets, *sockets.insecure_sockets]:
        sock.close()
    return exitcode


def start_engine_host() -> bool:
    """Start the server's engine host before any worker (False, the reason logged in one line,
    if the server cannot start), so that the engine loads while the workers import the app
    (a few seconds of every start); the workers find it running.  The access settings are
    checked first, as a worker would: a public server without keys loads no model."""
    from .engine_host.launch import HostStartError, start_host
    from .frontend.access import check_access_settings
    from .frontend.listeners import find_listeners
    from .ipc.endpoints import default_run_dir

    settings = Settings.from_env()
    try:
        check_access_settings(settings, find_listeners())
        start_host(settings, Path(settings.run_dir) if settings.run_dir else default_run_dir(), os.getpid())
    except (SettingsError, HostStartError) as exc:
        log.error("cannot start: %s", exc)
        return False
    return True


USAGE = """usage: personaplex-serve [APP] [--bind HOST:PORT] [--workers K] [--SETTING VALUE ...] [hypercorn options]

Serves full-duplex speech-to-speech models of the Moshi family (NVIDIA PersonaPlex) over
websockets: /v1/realtime?duplex=1 (OpenAI Realtime), /api/chat (NVIDIA's Ogg/Opus protocol),
/health, /ready, /metrics, /v1/models, /v1/voices and a talk page at /.  APP defaults to
orchestrator:app.  The same server runs as `hypercorn orchestrator:app` with the settings in
PERSONAPLEX_* variables; personaplex-serve adds a master that hands each connection to the
least busy worker and replaces a worker that dies, and ends a start-up that cannot succeed
with one line and exit status 3.

Common options:
  --bind HOST:PORT       where to listen (hypercorn's option; default 127.0.0.1:8000; repeatable)
  --workers K            front-end workers (hypercorn's option; default 1; about one per 38
                         sessions on an H200 host; docs/ORCHESTRATOR.md says how to size it)
  --checkpoint DIR|REPO  the model (default: the embedded tiny demo model)
  --max-sessions N|auto  sessions per device (default auto: the GPU's memory plan)
  --api-keys K1,K2       keys clients must send (required when listening beyond loopback)
  --help-hypercorn       hypercorn's own options (TLS, logging, timeouts), all accepted here

Example:
  personaplex-serve --bind 0.0.0.0:8000 --workers 4 --checkpoint nvidia/personaplex-7b-v1 \\
      --api-keys "$KEY"

"""


def apply_setting_flags(args: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """``args`` without the settings' flags (``--max-sessions 8``, ``--checkpoint=DIR``), each
    put in ``environ`` as its ``PERSONAPLEX_*`` variable unless that is set already (the
    environment wins; logged when they differ).  ``SettingsError`` for a flag without a value."""
    flags = setting_flags()
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag, has_value, value = args[i].partition("=")
        name = flags.get(flag)
        if name is None:
            rest.append(args[i])
            i += 1
            continue
        if not has_value:
            if i + 1 >= len(args):
                raise SettingsError(f"{flag} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        variable = env_name(name)
        if variable in environ:
            if environ[variable] != value:
                log.info("%s=%r from the environment wins over %s %r", variable, environ[variable], flag, value)
            continue
        environ[variable] = value
    return rest


def main(argv: list[str] | None = None) -> int:
    """hypercorn's command line with the server's settings as flags too (``--help`` lists
    them); the application defaults to ``orchestrator:app`` when the arguments begin with an
    option (``personaplex-serve --bind 127.0.0.1:8000``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(USAGE + settings_help())
        return 0
    import hypercorn.__main__ as hypercorn_cli

    if "--help-hypercorn" in args:
        return hypercorn_cli.main(["--help"])
    # The settings are the server's: one that is wrong fails here, before any worker starts.
    try:
        args = apply_setting_flags(args, os.environ)
        Settings.from_env().check_checkpoint_available()
    except SettingsError as exc:
        log.error("cannot start: %s", exc)
        return START_FAILED_EXIT
    if not args or (args[0].startswith("-") and args[0] != "--version"):
        args.insert(0, DEFAULT_APP)
    # hypercorn's parser builds the Config and hands it to ``run``: ours supervises instead.
    hypercorn_cli.run = supervise
    return hypercorn_cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
