"""Where a start's torch.compile time went, graph by graph, from a server log written with
``TORCH_LOGS=dynamo,recompiles`` (tests/e2e/online_serving/h200_startup_run.sh sets it):
per compiled graph (dynamo's frame/variant id), its function, the seconds dynamo spent
tracing it and the seconds its compiler took (Inductor; from the caches on a restart), and
what made each recompilation.  Usage: python -m tests.e2e.online_serving.compile_timeline LOG [LOG ...]
(a .gz log is read as is)."""

from __future__ import annotations

import gzip
import re
import sys

_LINE = re.compile(r"[IVW]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] \[([\d/_]+)\] (.*)")


def timeline(lines: list[str]) -> list[tuple[str, str, float, float]]:
    """(graph id, function, trace seconds, compile seconds) per compiled graph, in order."""
    started: dict[str, tuple[float, str]] = {}
    traced: dict[str, float] = {}
    rows = []
    for line in lines:
        match = _LINE.match(line)
        if not match:
            continue
        t = int(match[1]) * 3600 + int(match[2]) * 60 + float(match[3])
        graph, message = match[4], match[5]
        if message.startswith("Step 1: torchdynamo start tracing"):
            started[graph] = (t, message.split("tracing ", 1)[1].split(" ")[0])
        elif message.startswith("Step 1: torchdynamo done tracing") and graph in started:
            traced[graph] = t
        elif message.startswith("Step 2: done compiler function") and graph in traced:
            begin, name = started[graph]
            rows.append((graph, name, traced[graph] - begin, t - traced[graph]))
    return rows


def recompilations(lines: list[str]) -> list[str]:
    """The first guard failure named for each recompilation."""
    causes, pending = [], False
    for line in lines:
        if "Recompiling function" in line:
            pending = True
            name = line.split("Recompiling function ", 1)[1].split(" ")[0]
        elif pending and "    - " in line:
            causes.append(f"{name}: {line.split('    - ', 1)[1].strip()[:160]}")
            pending = False
    return causes


def main(paths: list[str]) -> None:
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", errors="replace") as f:
            lines = f.read().splitlines()
        rows = timeline(lines)
        print(f"== {path}: {len(rows)} graphs, tracing {sum(r[2] for r in rows):.1f} s, "
              f"compiling {sum(r[3] for r in rows):.1f} s")
        print(f"{'graph':8s} {'function':28s} {'trace s':>8s} {'compile s':>10s}")
        for graph, name, trace, compile_s in rows:
            print(f"{graph:8s} {name:28s} {trace:8.1f} {compile_s:10.1f}")
        for cause in recompilations(lines):
            print("recompiled:", cause)


if __name__ == "__main__":
    main(sys.argv[1:])
