"""Writing results (strict JSON) and the short human summary printed at the end of a run."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def plain(value: Any, where: str = "$") -> Any:
    """``value`` as JSON-ready Python data: numpy scalars become int/float/bool and a
    non-finite float becomes null (a missing value), with a warning naming where it was."""
    if isinstance(value, dict):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [plain(v, where) for v in sorted(value)]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        log.warning("non-finite value at %s written as null", where)
        return None
    return value


def write_json(path: Path, data: dict[str, Any], *, exclusive: bool = False) -> None:
    """Indented JSON with ``allow_nan=False``; ``exclusive`` opens with mode "x" so an
    existing file is never replaced."""
    text = json.dumps(plain(data), ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    with path.open("x" if exclusive else "w", encoding="utf-8") as stream:
        stream.write(text)


def fmt_cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def pair(stats: dict[str, Any], digits: int = 1) -> str:
    return f"{fmt_cell(stats['median'], digits)}/{fmt_cell(stats['p99'], digits)}"


def load_summary(result: dict[str, Any], path: Path) -> str:
    """One line per session, a line pooled over the run, and the verdict."""
    lines = [f"{'#':>4} {'ok':>3} {'holds':>5} {'first audio ms':>14} {'lag p50/p99 ms':>15} {'max gap ms':>10} "
             f"{'send late p99':>13} {'stream RTF':>10} {'deficit':>7} {'fed':>4}  error"]
    for row in result["sessions"]:
        lines.append(
            f"{row['index']:>4} {fmt_cell(row['ok']):>3} {fmt_cell(row['holds_real_time']):>5} "
            f"{fmt_cell(row['client_first_audio_after_stream_start_ms']):>14} {pair(row['stream_lag_ms']):>15} "
            f"{fmt_cell(row['max_output_gap_ms']):>10} {fmt_cell(row['client_send_lateness_ms']['p99']):>13} "
            f"{fmt_cell(row['server_stream_rtf'], 3):>10} {fmt_cell(row['frame_deficit']):>7} "
            f"{fmt_cell(row['server_fed_frames']):>4}  {row['error'] or ''}")
    lines.append(f"{'all':>4} {'':>3} {result['holding_sessions']:>5} {'':>14} {pair(result['stream_lag_ms']):>15} "
                 f"{fmt_cell(result['max_output_gap_ms']):>10} "
                 f"{fmt_cell(result['client_send_lateness_ms']['p99']):>13}")
    verdict = "OK" if result["ok"] else "NOT OK"
    lines.append(f"{verdict}: {result['passed_sessions']} of {result['requested_sessions']} sessions passed "
                 f"(gate: lag p99 <= {result['max_stream_lag_ms']:g} ms, gaps <= {result['max_gap_ms']:g} ms); "
                 f"{result['holding_sessions']} hold real time (lag p99 <= {result['hold_stream_lag_p99_ms']:g} ms, "
                 f"gaps <= {result['hold_max_gap_ms']:g} ms); {result['processes']} driver "
                 f"process{'' if result['processes'] == 1 else 'es'}; result in {path}")
    if result["client_bottleneck"]:
        lines.append(f"warning: the client was the bottleneck: send lateness p99 "
                     f"{fmt_cell(result['client_send_lateness_ms']['p99'])} ms > "
                     f"{result['client_bottleneck_threshold_ms']:g} ms, so these figures measure the driver as much "
                     f"as the server; rerun with more --processes")
    if result["client_pacing_warning_sessions"]:
        lines.append(f"warning: the client could not keep its 80 ms pacing in sessions "
                     f"{result['client_pacing_warning_sessions']} (send lateness p99 > 80 ms)")
    return "\n".join(lines)


def lifecycle_summary(result: dict[str, Any], path: Path) -> str:
    lines = []
    for name in ("primary", "secondary", "replacement"):
        stats = result.get(name) or {}
        if stats:
            lines.append(f"{name:>11}: {stats.get('session_id')}  input {fmt_cell(stats.get('input_frames'))} frames  "
                         f"output {fmt_cell(stats.get('output_frames'))} frames  deficit {fmt_cell(stats.get('frame_deficit'))}"
                         f"  voiced {fmt_cell(stats.get('voiced_frames'))}  check {stats.get('acceptance_check') or 'ok'}")
    failure = result.get("failure")
    verdict = "OK" if result["ok"] else f"NOT OK ({failure['step']}: {failure['message']})" if failure else "NOT OK"
    lines.append(f"{verdict}; result in {path}")
    return "\n".join(lines)
