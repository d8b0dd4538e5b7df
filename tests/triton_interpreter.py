"""Running a script under Triton's CPU interpreter: in a subprocess, since the interpreter is
chosen when Triton is imported.  The kernel tests' scripts print their worst error last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(script: str) -> str:
    """Run ``script`` with ``TRITON_INTERPRET=1`` and return what it printed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def worst_error_in_interpreter(script: str) -> float:
    """Run ``script`` with ``TRITON_INTERPRET=1`` and return the number on its last line."""
    return float(run_in_interpreter(script).strip().splitlines()[-1])
