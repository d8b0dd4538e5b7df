"""Plot tick time against the number of sessions from an ``engines.tools.bench`` JSON report.

    python -m engines.tools.bench_plot bench.json --output tick-vs-batch.png

One line per engine variant (p50 solid, p99 dashed) and the same-run baseline, with the
80 ms real-time frame budget and the 60 ms p99 target drawn for reference.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from engines.config import FRAME_MS  # one frame of audio: a tick slower than this cannot keep up

log = logging.getLogger("engines.tools.bench_plot")

P99_TARGET_MS = 60.0  # spec/performance.md


def series(rows: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(B, p50, p99) of the rows that ran (rows with an ``error`` are skipped)."""
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["batch"])
    return [r["batch"] for r in ok], [r["tick_ms_p50"] for r in ok], [r["tick_ms_p99"] for r in ok]


def plot(report: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = [(name, result["ours"]) for name, result in report.get("configs", {}).items()]
    if "ours" in report:  # reports written before engine variants existed
        lines.append(("ours", report["ours"]))
    if report.get("baseline"):
        lines.append(("baseline: moshi 0.2.13", report["baseline"]))
    for name, rows in lines:
        b, p50, p99 = series(rows)
        if not b:
            continue
        (line,) = ax.plot(b, p50, marker="o", label=f"{name} p50")
        ax.plot(b, p99, linestyle="--", color=line.get_color(), label=f"{name} p99")
    ax.axhline(FRAME_MS, color="grey", linewidth=0.8)
    ax.text(1, FRAME_MS + 1, "80 ms frame (real time)", color="grey", fontsize=8)
    ax.axhline(P99_TARGET_MS, color="red", linewidth=0.8, linestyle=":")
    ax.text(1, P99_TARGET_MS + 1, "60 ms p99 target", color="red", fontsize=8)
    ax.set_xlabel("sessions in the lockstep tick (B)")
    ax.set_ylabel("tick time (ms)")
    ax.set_title(f"{report.get('gpu', '?')}, {report.get('date', '?')}, rev {report.get('git_revision', '?')}",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.tools.bench_plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="JSON written by python -m engines.tools.bench")
    parser.add_argument("--output", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: cannot read {args.report}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(report, dict) or not ("configs" in report or "ours" in report):
        print(f"error: {args.report} is not an engines.tools.bench report", file=sys.stderr)
        return 2
    plot(report, Path(args.output))
    log.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
