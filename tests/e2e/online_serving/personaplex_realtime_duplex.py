"""The reference driver's command line, kept so published measurements stay comparable:
``python -m tests.e2e.online_serving.personaplex_realtime_duplex`` is the installed load
driver (``orchestrator.load_driver``, console script ``personaplex-load``) under that name."""

from __future__ import annotations

import sys
from typing import Sequence

from orchestrator.load_driver.cli import EXIT_NOT_OK, EXIT_OK, EXIT_USAGE
from orchestrator.load_driver.cli import main as _main

PROG = "python -m tests.e2e.online_serving.personaplex_realtime_duplex"

__all__ = ["EXIT_NOT_OK", "EXIT_OK", "EXIT_USAGE", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
