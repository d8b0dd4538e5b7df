"""``python -m orchestrator.engine_host host|engine ...``: started by the server itself.

``host --run-dir D --watch-pid P``: the engine host of one server (``host.py``).
``engine --run-dir D --index I``: one engine process (``run_engine.py``).
Operators do not run these by hand: the first front-end worker of ``hypercorn
orchestrator:app`` starts the host, and the host starts the engines.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["engine"]:
        from .run_engine import main as engine_main

        return engine_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m orchestrator.engine_host host",
                                     description="The engine host of one server (started by the server).")
    parser.add_argument("command", choices=["host"])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--watch-pid", type=int, required=True, help="stop when this process (the server) exits")
    args = parser.parse_args(argv)
    from .host import run_host

    return run_host(args.run_dir, args.watch_pid)


if __name__ == "__main__":
    sys.exit(main())
