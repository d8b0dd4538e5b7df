"""Re-read an existing ``load-result.json`` (this driver's, an earlier one's, or the reference
driver's) with today's real-time columns: per-session stream lag p50/p99, the longest output
gap, whether the session holds real time, and the same pooled over the run.

Everything is recomputed from the result's own timelines (``input_timeline`` and
``audio_packet_timeline``), so figures published before the lag gate existed can be read
against it.  ``python -m orchestrator.load_driver.reread RESULT [RESULT ...]`` prints one
table per file; ``--json`` prints the figures instead.  Gzipped files are read as such.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from . import metrics
from .load import holds_real_time, pooled, sends_of
from .options import HOLD_MAX_GAP_MS, HOLD_STREAM_LAG_P99_MS
from .report import fmt_cell, pair


def read_result(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as stream:
        return json.load(stream)


def reread(result: dict[str, Any]) -> dict[str, Any]:
    """The real-time figures of every session of ``result`` and of the whole run."""
    rows: list[dict[str, Any]] = []
    for row in result["sessions"]:
        sends = sends_of(row)
        packets = row["audio_packet_timeline"]
        arrivals = [p["received_at_s"] for p in packets]
        measured = {"stream_lag_ms": metrics.distribution(
                        metrics.stream_lags_ms(arrivals, [p["samples"] for p in packets], sends)),
                    "max_output_gap_ms": metrics.longest_gap_ms(arrivals)}
        rows.append({"index": row["index"], "ok": row["ok"], **measured, "holds_real_time": holds_real_time(measured),
                     "send_lateness_p99_ms": metrics.distribution(metrics.send_lateness_ms(sends))["p99"],
                     "input_timeline": row["input_timeline"], "audio_packet_timeline": packets})
    run = pooled(rows)
    for row in rows:
        del row["input_timeline"], row["audio_packet_timeline"]
    return {"sessions": rows, **run}


def table(path: Path, figures: dict[str, Any]) -> str:
    lines = [f"{path}", f"{'#':>4} {'ok':>3} {'holds':>5} {'lag p50/p99 ms':>15} {'max gap ms':>10} {'send late p99':>13}"]
    for s in figures["sessions"]:
        lag = s["stream_lag_ms"]
        lines.append(f"{s['index']:>4} {fmt_cell(s['ok']):>3} {fmt_cell(s['holds_real_time']):>5} "
                     f"{pair(lag):>15} "
                     f"{fmt_cell(s['max_output_gap_ms']):>10} {fmt_cell(s['send_lateness_p99_ms']):>13}")
    lag = figures["stream_lag_ms"]
    lines.append(f"{'all':>4} {'':>3} {figures['holding_sessions']:>5} "
                 f"{pair(lag):>15} "
                 f"{fmt_cell(figures['max_output_gap_ms']):>10} {fmt_cell(figures['client_send_lateness_ms']['p99']):>13}")
    lines.append(f"{figures['holding_sessions']} of {len(figures['sessions'])} sessions hold real time "
                 f"(lag p99 <= {HOLD_STREAM_LAG_P99_MS:g} ms, gaps <= {HOLD_MAX_GAP_MS:g} ms)"
                 + ("; the client was the bottleneck" if figures["client_bottleneck"] else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.load_driver.reread", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT", help="load-result.json (or .json.gz)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for path in args.results:
        try:
            figures = reread(read_result(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: {path}: not a readable load result ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        out[str(path)] = figures
        if not args.json:
            print(table(path, figures))
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
