"""A timeline PNG of a run (``--plot``): people read timelines faster than JSON.

Top panel: per session, when output frame k arrived relative to the planned send time of
input frame k (ms), against time since the stream started.  A lockstep server that keeps
real time draws a flat band (its per-frame latency); a rising line is the server falling
behind, spikes are late packets, a multi-frame packet shows as a saw-tooth.
Bottom panel: send lateness per frame against the planned grid (the client's own ticks), with
the 80 ms pacing-warning line: points above it mean the client, not the server, fell behind.

matplotlib is imported only here (``pip install matplotlib``).  Also a small CLI to redraw an
existing result: ``python -m tests.e2e.online_serving.realtime_duplex.plot load-result.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

from .metrics import frame_completions
from .wire import FRAME_PERIOD_S

log = logging.getLogger(__name__)


def plot_series(series: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Draw sessions given as ``{label, sends: [(planned, started, completed)], arrivals, samples}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [s["sends"][0][0] for s in series if s["sends"]] or [a for s in series for a in s["arrivals"][:1]]
    t0 = min(starts) if starts else 0.0
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7.5), height_ratios=(3, 2))
    colors = plt.get_cmap("tab10")
    for i, s in enumerate(series):
        color = colors(i % 10)
        sends = s["sends"]
        if not sends:
            continue
        completed, _ = frame_completions(s["arrivals"], s["samples"], len(sends))
        top.plot([sends[k][0] - t0 for k in range(len(completed))],
                 [(done - sends[k][0]) * 1000.0 for k, done in enumerate(completed)],
                 color=color, linewidth=0.8, marker=".", markersize=2, label=s["label"])
        bottom.plot([p - t0 for p, _, _ in sends], [max(0.0, st - p) * 1000.0 for p, st, _ in sends],
                    color=color, linewidth=0.8, marker=".", markersize=2, label=s["label"])
    top.axhline(FRAME_PERIOD_S * 1000.0, color="gray", linewidth=0.8, linestyle=":", label="one frame (80 ms)")
    top.set_ylabel("output frame k arrival - planned send of input frame k (ms)", fontsize=8)
    top.set_title(f"{title}: audio arrival vs send schedule")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2, loc="upper left")
    bottom.axhline(FRAME_PERIOD_S * 1000.0, color="red", linewidth=0.8, linestyle=":", label="pacing warning (80 ms)")
    bottom.set_ylabel("send lateness (ms)")
    bottom.set_xlabel("time since stream start (s)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def series_from_load_result(result: dict[str, Any]) -> list[dict[str, Any]]:
    series = []
    for row in result["sessions"]:
        sends = [(f["planned_at_s"], f["send_started_at_s"], f["send_completed_at_s"]) for f in row["input_timeline"]]
        packets = row["audio_packet_timeline"]
        series.append({"label": f"session {row['index']}" + ("" if row["ok"] else " (failed)"), "sends": sends,
                       "arrivals": [p["received_at_s"] for p in packets], "samples": [p["samples"] for p in packets]})
    return series


def plot_load_result(result: dict[str, Any], path: Path) -> Path:
    verdict = "ok" if result["ok"] else "NOT ok"
    title = f"{result['requested_sessions']} paced sessions, {result['passed_sessions']} passed ({verdict})"
    return plot_series(series_from_load_result(result), path, title=title)


def plot_safely(draw: Callable[[], Path]) -> None:
    """Draw, logging instead of raising: a plot never changes a run's verdict."""
    try:
        log.info("wrote %s", draw())
    except ImportError:
        log.error("--plot needs matplotlib: pip install matplotlib")
    except Exception:  # noqa: BLE001
        log.exception("could not write the plot")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redraw the timeline PNG of an existing load-result.json.")
    parser.add_argument("result", type=Path, help="a load-result.json written by the load mode")
    parser.add_argument("output", type=Path, nargs="?", help="PNG path (default: beside the result)")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text(encoding="utf-8"))
    out = args.output or args.result.with_name("load-timeline.png")
    print(plot_load_result(result, out))


if __name__ == "__main__":
    main()
