"""Compile every Triton kernel the engine may launch for named GPU targets, without a GPU.

    python -m engines.tools.check_targets --arch 80,90

For each registered launch (``engines.fastpath.kernel_registry``) and each target it asks the
engine whether it would take that kernel on a GPU of that capability (``gpu_arch``'s
decisions, through the modules' own availability tests) and compiles it with Triton for that
target (down to a cubin: ptxas comes with Triton).  A table says, per kernel and target:
``ok``, ``refused: <why>``, or ``not taken`` (with what compiling it gave).

Exit status 0 when every kernel the engine would take compiles for every target (and every
``@triton.jit`` function under ``engines/`` is registered); 1 otherwise; 2 without Triton.
So an engine decision that takes an e4m3 kernel on sm_80 fails here, on a CPU machine.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import re
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from engines.fastpath import gpu_arch, kernel_registry

log = logging.getLogger(__name__)

# The device the decisions are asked for (under gpu_arch.simulated: no GPU is touched).
DEVICE = torch.device("cuda", 0)


@dataclass(frozen=True)
class Cell:
    taken: bool
    error: str | None  # None: it compiled

    @property
    def ok(self) -> bool:
        return not self.taken or self.error is None

    def text(self) -> str:
        compiled = "compiles" if self.error is None else f"refused: {self.error}"
        if not self.taken:
            return f"not taken on this arch ({compiled})"
        return "ok" if self.error is None else compiled


def capability_of(arch: int) -> tuple[int, int]:
    """80 -> (8, 0), 90 -> (9, 0), 100 -> (10, 0)."""
    return divmod(arch, 10)


def compile_for(index: int, arch: int) -> str | None:
    """Compile registered launch ``index`` for ``sm_<arch>``; None, or why it was refused.
    (By index, so that a worker process finds the launch in its own registry.)"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _quiet()
    launch = kernel_registry.launches()[index]
    source = ASTSource(fn=launch.fn, signature=launch.signature(), constexprs=launch.constexprs,
                       attrs=launch.attrs())
    try:
        triton.compile(source, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    except Exception as exc:  # noqa: BLE001 - a refusal is a result, whatever its type
        return _reason(exc)
    return None


def _quiet() -> None:
    """Triton 3.9 warns at every first compile that its FP-fusion default will change: not
    what this table is about (in each worker too: spawned ones start without our filters)."""
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def _reason(exc: BaseException) -> str:
    """The compiler's own words, on one line: a CompilationError's message ends with them."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    # ValueError("type fp8e4nv not supported in this architecture. The supported ...") -> its
    # first sentence.
    quoted = re.fullmatch(r"\w+\((['\"])(.*)\1\)", text)
    if quoted:
        text = quoted.group(2).split(". ")[0]
    return text if len(text) <= 120 else text[:117] + "..."


def decisions(archs: list[int]) -> list[list[bool]]:
    """Whether the engine takes each launch on a GPU of each target's capability."""
    launches = kernel_registry.launches()
    taken = []
    for launch in launches:
        row = []
        for arch in archs:
            with gpu_arch.simulated(capability_of(arch)):
                row.append(bool(launch.taken(DEVICE)))
        taken.append(row)
    return taken


def check(archs: list[int], jobs: int = 1) -> tuple[list[str], list[list[Cell]]]:
    """(launch names, cells [launch][arch]).  Compiles in ``jobs`` processes."""
    launches = kernel_registry.launches()
    taken = decisions(archs)
    work = [(i, arch) for i in range(len(launches)) for arch in archs]
    if jobs > 1:
        # Fresh interpreters (spawn): forking a process that has loaded torch is not safe.
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = list(pool.map(compile_for, *zip(*work)))
    else:
        errors = [compile_for(i, arch) for i, arch in work]
    cells = [[Cell(taken[i][j], errors[i * len(archs) + j]) for j in range(len(archs))] for i in range(len(launches))]
    return [launch.name for launch in launches], cells


def table(names: list[str], archs: list[int], cells: list[list[Cell]]) -> str:
    header = ["kernel", *(f"sm_{arch}" for arch in archs)]
    rows = [[name, *(("" if cell.ok else "FAIL ") + cell.text() for cell in row)] for name, row in zip(names, cells)]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.tools.check_targets", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities as sm numbers "
                        "(80: A100, 86: A10, 89: L4/L40, 90: H100/H200); default 80,90")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="compile in this many processes (default: the cores, at most 4)")
    args = parser.parse_args(argv)
    _quiet()
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--arch takes numbers such as 80,90, got {args.arch!r}")
    if not archs:
        parser.error("--arch names no target")
    if kernel_registry.triton is None:
        print("Triton is not installed: nothing to compile", file=sys.stderr)
        return 2
    missing = kernel_registry.unregistered()
    names, cells = check(archs, args.jobs)
    print(table(names, archs, cells))
    failed = sum(not cell.ok for row in cells for cell in row)
    for name in missing:
        print(f"FAIL {name}: a @triton.jit function that no launch in engines/fastpath/kernel_registry.py compiles")
    if failed or missing:
        print(f"{failed} kernel(s) the engine would take do not compile; {len(missing)} unregistered")
        return 1
    print(f"every kernel the engine would take compiles for {', '.join(f'sm_{a}' for a in archs)}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
