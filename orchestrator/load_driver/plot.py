"""A timeline PNG of a run (``--plot``): people read timelines faster than JSON.

Top panel: stream lag over time for every session: output frame k's arrival minus the send
of input frame k minus 80 ms, against time since the stream started.  A lockstep server that
keeps real time draws a flat band (its per-frame latency); a rising line is the server
falling behind, spikes are late packets, a multi-frame packet shows as a saw-tooth.  With
many sessions the lines are thin and unlabelled, and the per-frame median and maximum over
sessions are drawn on top; the gate and the capacity rule are the dashed lines.
Bottom panel: send lateness per frame against the planned grid (the client's own ticks), with
the 20 ms line a capacity run must stay under: points above it mean the client, not the
server, fell behind.

matplotlib is imported only here (``pip install matplotlib``).  Also a small CLI to redraw an
existing result: ``python -m orchestrator.load_driver.plot load-result.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .load import sends_of
from .metrics import stream_lags_ms
from .options import CLIENT_LATENESS_LIMIT_MS, HOLD_STREAM_LAG_P99_MS
from .wire import FRAME_PERIOD_S

LABELLED_SESSIONS = 10  # above this many sessions, lines go unlabelled and summary lines are drawn

log = logging.getLogger(__name__)


def plot_series(series: Sequence[dict[str, Any]], path: Path, *, title: str,
                gate_ms: float | None = None) -> Path:
    """Draw sessions given as ``{label, sends: [(planned, started, completed)], arrivals, samples}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [s["sends"][0][0] for s in series if s["sends"]] or [a for s in series for a in s["arrivals"][:1]]
    t0 = min(starts) if starts else 0.0
    many = len(series) > LABELLED_SESSIONS
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7.5), height_ratios=(3, 2))
    colors = plt.get_cmap("tab10")
    by_frame: list[list[float]] = []
    for i, s in enumerate(series):
        sends = s["sends"]
        if not sends:
            continue
        color = "tab:blue" if many else colors(i % 10)
        style = {"linewidth": 0.4, "alpha": 0.35} if many else {"linewidth": 0.8, "marker": ".", "markersize": 2}
        label = None if many else s["label"]
        lags = stream_lags_ms(s["arrivals"], s["samples"], sends)
        times = [sends[k][0] - t0 for k in range(len(lags))]
        top.plot(times, lags, color=color, label=label, **style)
        for k, lag in enumerate(lags):
            if k == len(by_frame):
                by_frame.append([])
            by_frame[k].append(lag)
        bottom.plot([p - t0 for p, _, _ in sends], [max(0.0, st - p) * 1000.0 for p, st, _ in sends],
                    color=color, label=label, **style)
    if many and by_frame:
        grid = [k * FRAME_PERIOD_S for k in range(len(by_frame))]  # load sessions share one start
        top.plot(grid, [float(np.median(v)) for v in by_frame], color="black", linewidth=1.0,
                 label=f"median of {len(series)} sessions")
        top.plot(grid, [max(v) for v in by_frame], color="tab:red", linewidth=0.8, label="worst session")
    top.axhline(HOLD_STREAM_LAG_P99_MS, color="gray", linewidth=0.8, linestyle="--",
                label=f"holds real time (p99 <= {HOLD_STREAM_LAG_P99_MS:g} ms)")
    if gate_ms is not None:
        top.axhline(gate_ms, color="tab:red", linewidth=0.8, linestyle="--", label=f"gate ({gate_ms:g} ms)")
    top.set_ylabel("stream lag: output frame k - input frame k sent - 80 ms (ms)", fontsize=8)
    top.set_title(f"{title}: stream lag over time")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2, loc="upper left")
    bottom.axhline(CLIENT_LATENESS_LIMIT_MS, color="red", linewidth=0.8, linestyle=":",
                   label=f"client limit ({CLIENT_LATENESS_LIMIT_MS:g} ms)")
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
        sends = sends_of(row)
        packets = row["audio_packet_timeline"]
        series.append({"label": f"session {row['index']}" + ("" if row["ok"] else " (failed)"), "sends": sends,
                       "arrivals": [p["received_at_s"] for p in packets], "samples": [p["samples"] for p in packets]})
    return series


def plot_load_result(result: dict[str, Any], path: Path) -> Path:
    verdict = "ok" if result["ok"] else "NOT ok"
    # The server's configuration (its tick policy among it) as the driver was told it.
    server = (result.get("reported_server") or {}).get("hardware") or ""
    title = (f"{result['requested_sessions']} sessions, {result['passed_sessions']} passed ({verdict})"
             + (f"; {server}" if server else ""))
    return plot_series(series_from_load_result(result), path, title=title, gate_ms=result.get("max_stream_lag_ms"))


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
