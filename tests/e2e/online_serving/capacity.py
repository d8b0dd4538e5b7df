"""Serving capacity of several deployment layouts, measured in one run (issue 9 part 3).

For each ``--layout``, in turn: start the server process(es), wait for ``/ready``, scrape
``/metrics``, drive paced load sessions with the load driver (``orchestrator.load_driver
--sessions N --processes P``, one driver per server, its sessions split over P worker
processes that share one start), scrape ``/metrics`` again, stop the server(s).  One
``capacity.json`` collects the layouts side by side, with the stream lag columns pooled over
every session of a layout.  Run ``--help`` for the flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.load_driver.load import RESULT_NAME as LOAD_RESULT
from orchestrator.load_driver.load import pooled
from orchestrator.load_driver.options import MAX_LOAD_SESSIONS, MAX_PROCESSES
from orchestrator.load_driver.report import fmt_cell, write_json
from orchestrator.settings import SettingsError, parse_devices

log = logging.getLogger("capacity")

EXIT_OK, EXIT_NOT_OK, EXIT_USAGE = 0, 1, 2
RESULT_NAME = "capacity.json"
SCHEMA_VERSION = 1
REPO = Path(__file__).resolve().parents[3]
# Server settings this tool owns: set from the arguments, or removed from the inherited environment.
OWNED_ENV = ("PERSONAPLEX_DEVICES", "PERSONAPLEX_MAX_SESSIONS", "PERSONAPLEX_CHECKPOINT", "PERSONAPLEX_KV_CACHE")
TICK_BOUNDS_S = ("0.06", "0.08")  # bucket bounds of personaplex_tick_duration_seconds reported as fractions

EXAMPLE = """\
example (a machine with two GPUs; one command, all three layouts):
  python -m tests.e2e.online_serving.capacity --checkpoint random:personaplex-7b --kv-cache fp8 \\
      --layout process:0 --layout process:0,1 --layout split:0,1 --sessions-per-device 128 \\
      --load-frames 3000 --tail-s 200 --driver-processes 8 --input-wav input_assistant.wav --output-dir out/

layouts:
  process:DEVICES  one server process with PERSONAPLEX_DEVICES=DEVICES (one engine per device)
  split:DEVICES    one server process per device, each on its own port, each driven directly
                   (the one-process-per-GPU deployment; a balancer would only do placement)
  DEVICES is a comma list of GPU indexes (0,1), cuda:N or cpu (cpu may repeat, for tests).

Each layout gets sessions-per-device x devices sessions (PERSONAPLEX_MAX_SESSIONS is per device),
from one load driver per server whose sessions are split over --driver-processes worker
processes (default: the driver's, one per 32 sessions up to the CPU count).  A capacity point
is valid only while the client keeps its grid (pooled send lateness p99 <= 20 ms: the
client_bottleneck column).  Other PERSONAPLEX_* variables of the environment reach the
servers unchanged; %s come from the flags only.

output (--output-dir):
  capacity.json                      every layout: sessions admitted/ok, per-session aggregates
                                     from the drivers' load-result.json, server tick statistics
                                     (/metrics delta, per device), start-up time, errors; plus
                                     the command, UTC date, git revision, host and GPU names.
                                     Rewritten after each layout; an existing one is never replaced.
  <n>-<layout>/server-<i>.log        server output
  <n>-<layout>/driver-<i>/           each server's driver: load-result.json and driver.log

exit status: 0 every layout ran and every session was ok, 1 otherwise, 2 bad arguments
or an existing capacity.json.
""" % (", ".join(OWNED_ENV),)


class UsageError(Exception):
    """Bad arguments: exit status 2."""


@dataclass(frozen=True)
class Layout:
    spec: str  # as given, e.g. "split:0,1"
    kind: str  # "process" or "split"
    devices: tuple[str, ...]  # as given, e.g. ("0", "1")

    @property
    def server_devices(self) -> list[tuple[str, ...]]:
        """The devices of each server process."""
        return [self.devices] if self.kind == "process" else [(d,) for d in self.devices]


def parse_layout(spec: str) -> Layout:
    kind, sep, devices = spec.partition(":")
    if not sep or kind not in ("process", "split") or not devices:
        raise UsageError(f"--layout {spec!r}: expected process:DEVICES or split:DEVICES, e.g. process:0,1")
    items = tuple(item.strip() for item in devices.split(","))
    if "all" in (item.lower() for item in items):
        raise UsageError(f"--layout {spec!r}: list the devices ('all' has no known count)")
    try:
        parse_devices(items)  # the server's own rules: a GPU listed twice, an unknown name
    except SettingsError as exc:
        raise UsageError(f"--layout {spec!r}: {exc}") from None
    return Layout(spec, kind, items)


# Processes ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A child in its own process group (so that Ctrl-C reaches only us, and stopping the group
    also ends hypercorn's worker), its output in ``log_path``."""
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL to what is left of its process group after ``grace_s``."""
    pgid = proc.pid  # start_new_session: the group id is the child's pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (proc.poll() is None or _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None or _group_alive(pgid):
        log.warning("pid %d did not stop within %.0f s: SIGKILL to its process group", proc.pid, grace_s)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


# Metrics --------------------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Prometheus text as {(name, labels): value}; label values hold no commas or quotes here."""
    samples: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        pairs = (item.split("=", 1) for item in labels.rstrip("}").split(",") if item)
        samples[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return samples


def tick_stats(before: Samples, after: Samples, prefix: str, device: str | None = None) -> dict[str, Any]:
    """Ticks between two scrapes from the tick-duration and batch-size histograms ``prefix``
    (``personaplex`` or ``personaplex_device``), of one ``device`` label or unlabelled."""
    base = frozenset() if device is None else frozenset({("device", device)})

    def delta(name: str, extra: tuple[tuple[str, str], ...] = ()) -> float:
        key = (f"{prefix}_{name}", base | frozenset(extra))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ticks = delta("tick_duration_seconds_count")
    stats: dict[str, Any] = {"ticks": int(ticks), "mean_tick_ms": None, "mean_batch_size": None}
    for bound in TICK_BOUNDS_S:
        stats[f"ticks_le_{int(float(bound) * 1000)}ms_fraction"] = None
    if ticks > 0:
        stats["mean_tick_ms"] = 1000.0 * delta("tick_duration_seconds_sum") / ticks
        stats["mean_batch_size"] = delta("batch_size_sum") / ticks
        for bound in TICK_BOUNDS_S:
            stats[f"ticks_le_{int(float(bound) * 1000)}ms_fraction"] = (
                delta("tick_duration_seconds_bucket", (("le", bound),)) / ticks)
    return stats


def merge_tick_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Tick statistics of several servers together (weighted by their tick counts)."""
    ticks = sum(p["ticks"] for p in parts)
    merged: dict[str, Any] = {"ticks": ticks}
    for key in parts[0] if parts else ():
        if key != "ticks":
            merged[key] = (sum(p[key] * p["ticks"] for p in parts if p["ticks"]) / ticks) if ticks else None
    return merged


# One layout -----------------------------------------------------------------------------------

@dataclass
class Server:
    index: int
    devices: tuple[str, ...]
    port: int
    proc: subprocess.Popen
    model: str = ""
    before: Samples = field(default_factory=dict)


def _range(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> list[float] | None:
    values = [row[key] if sub is None else (row[key] or {}).get(sub) for row in rows]
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def session_aggregates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranges [min, max] over the load-result.json rows of a layout (null when none measured),
    and the stream lag, gap and send lateness pooled over all of them."""
    run = pooled(rows)
    return {
        "stream_lag_p50_ms": run["stream_lag_ms"]["median"],
        "stream_lag_p99_ms": run["stream_lag_ms"]["p99"],
        "max_output_gap_ms": run["max_output_gap_ms"],
        "holding_sessions": run["holding_sessions"],
        "client_send_lateness_p99_ms": run["client_send_lateness_ms"]["p99"],
        "client_bottleneck": run["client_bottleneck"],
        "session_stream_lag_p99_ms": _range(rows, "stream_lag_ms", "p99"),
        "first_audio_ms": _range(rows, "client_first_audio_after_stream_start_ms"),
        "packet_interval_p50_ms": _range(rows, "client_audio_packet_interval_ms", "median"),
        "packet_interval_p99_ms": _range(rows, "client_audio_packet_interval_ms", "p99"),
        "audio_underrun_s": _range(rows, "audio_underrun_s"),
        "frame_deficit": _range(rows, "frame_deficit"),
        "client_stream_rtf": _range(rows, "client_stream_rtf"),
        "server_stream_rtf": _range(rows, "server_stream_rtf"),
        "client_pacing_warning_sessions": sum(bool(row.get("client_pacing_warning")) for row in rows),
    }


def server_env(args: argparse.Namespace, devices: tuple[str, ...]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OWNED_ENV}
    env.update(PERSONAPLEX_DEVICES=",".join(devices), PERSONAPLEX_MAX_SESSIONS=str(args.sessions_per_device),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    if args.checkpoint:
        env["PERSONAPLEX_CHECKPOINT"] = args.checkpoint
    if args.kv_cache:
        env["PERSONAPLEX_KV_CACHE"] = args.kv_cache
    return env


def wait_ready(server: Server, deadline: float) -> None:
    base = f"http://127.0.0.1:{server.port}"
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {server.index} exited with status {server.proc.returncode} before /ready")
        try:
            if http_get(base + "/ready", 5.0)[0] == 200:
                break
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"server {server.index} not ready")
        time.sleep(0.5)
    server.model = json.loads(http_get(base + "/v1/models")[1])["data"][0]["id"]


def scrape(server: Server) -> Samples:
    return parse_metrics(http_get(f"http://127.0.0.1:{server.port}/metrics")[1])


def run_layout(args: argparse.Namespace, layout: Layout, out: Path, meta: dict[str, Any],
               children: list[subprocess.Popen]) -> dict[str, Any]:
    """Start, load, measure and stop one layout; every started process is in ``children``
    until it is stopped (the caller stops what is left on an exception)."""
    out.mkdir(parents=True)
    result: dict[str, Any] = {"layout": layout.spec, "kind": layout.kind, "devices": list(layout.devices),
                              "servers": len(layout.server_devices),
                              "sessions_requested": args.sessions_per_device * len(layout.devices),
                              "sessions_admitted": 0, "sessions_ok": 0, "startup_s": None, "drivers": [],
                              "sessions": session_aggregates([]), "ticks": None, "ticks_per_device": [],
                              "errors": [], "ok": False}
    servers: list[Server] = []
    drivers: list[tuple[dict[str, Any], subprocess.Popen]] = []
    try:
        t0 = time.monotonic()
        for i, devices in enumerate(layout.server_devices):
            port = free_port()
            cmd = [sys.executable, "-m", "hypercorn", "orchestrator:app", "--bind", f"127.0.0.1:{port}",
                   "--graceful-timeout", "5"]
            proc = start(cmd, server_env(args, devices), out / f"server-{i}.log")
            children.append(proc)
            servers.append(Server(i, devices, port, proc))
        log.info("%s: %d server(s) starting on port(s) %s", layout.spec, len(servers), [s.port for s in servers])
        try:
            for server in servers:
                wait_ready(server, t0 + args.ready_timeout_s)
        except (RuntimeError, TimeoutError, OSError, ValueError, LookupError) as exc:
            result["errors"].append(f"start-up: {exc}; see {out}/server-*.log")
            log.error("%s: %s", layout.spec, result["errors"][-1])
            return result
        result["startup_s"] = round(time.monotonic() - t0, 1)
        log.info("%s: ready after %.1f s (model %s)", layout.spec, result["startup_s"], servers[0].model)
        for server in servers:
            server.before = scrape(server)

        for server in servers:
            sessions = args.sessions_per_device * len(server.devices)
            ddir = out / f"driver-{server.index}"
            ddir.mkdir()
            cmd = [sys.executable, "-m", "orchestrator.load_driver",
                   "--url", f"ws://127.0.0.1:{server.port}/v1/realtime?duplex=1", "--model", server.model,
                   "--input-wav", str(args.input_wav), "--sessions", str(sessions),
                   "--load-frames", str(args.load_frames), "--tail-s", str(args.tail_s), "--output-dir", str(ddir),
                   "--server-revision", meta["git_revision"] or "unknown",
                   "--server-hardware", meta["gpus"] or meta["hostname"]]
            if args.driver_processes:
                cmd += ["--processes", str(min(args.driver_processes, sessions))]
            proc = start(cmd + shlex.split(args.driver_args), dict(os.environ), ddir / "driver.log")
            children.append(proc)
            drivers.append(({"server": server.index, "sessions": sessions, "output_dir": str(ddir)}, proc))
        log.info("%s: %d sessions from %d driver(s), %d frames each", layout.spec,
                 result["sessions_requested"], len(drivers), args.load_frames)

        deadline = time.monotonic() + args.driver_timeout_s
        rows: list[dict[str, Any]] = []
        for info, proc in drivers:
            try:
                info["exit_status"] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result["errors"].append(f"driver {info['output_dir']} ran past --driver-timeout-s: stopped")
                stop(proc, 5.0)
                info["exit_status"] = None
            children.remove(proc)
            path = Path(info["output_dir"]) / LOAD_RESULT
            if not path.is_file():
                result["errors"].append(f"driver {info['output_dir']} wrote no {LOAD_RESULT}; see driver.log")
                continue
            driver_result = json.loads(path.read_text())
            driver_rows = driver_result["sessions"]
            info["sessions_ok"] = sum(row["ok"] is True for row in driver_rows)
            info["processes"] = driver_result["processes"]
            rows += driver_rows
            result["drivers"].append(info)
        # load.py leaves a row's session statistics null when the session was never admitted.
        result["sessions_admitted"] = sum(row.get("frame_deficit") is not None for row in rows)
        result["sessions_ok"] = sum(row["ok"] is True for row in rows)
        result["sessions"] = session_aggregates(rows)

        after = {server.index: scrape(server) for server in servers}
        result["ticks"] = merge_tick_stats([tick_stats(s.before, after[s.index], "personaplex") for s in servers])
        for server in servers:
            labels = sorted({dict(labels)["device"] for name, labels in after[server.index]
                             if name == "personaplex_device_tick_duration_seconds_count"})
            result["ticks_per_device"] += [
                {"server": server.index, "device": device,
                 **tick_stats(server.before, after[server.index], "personaplex_device", device)} for device in labels]
        result["ok"] = not result["errors"] and result["sessions_ok"] == result["sessions_requested"]
        return result
    except Exception as exc:  # recorded; the next layout still runs
        log.exception("%s failed", layout.spec)
        result["errors"].append(f"{type(exc).__name__}: {exc}")
        return result
    finally:
        for _, proc in drivers:  # left running only when interrupted: before their servers go
            if proc in children:
                stop(proc, 10.0)
                children.remove(proc)
        for server in servers:
            stop(server.proc)
            children.remove(server.proc)
            if server.proc.returncode not in (0, -signal.SIGTERM):
                log.warning("server %d exited with status %s", server.index, server.proc.returncode)
        log.info("%s: servers stopped", layout.spec)


# Run ------------------------------------------------------------------------------------------

def _command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_metadata(argv: Sequence[str]) -> dict[str, Any]:
    revision = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if revision and _command_output(["git", "status", "--porcelain"]):
        revision += "+dirty"
    gpus = _command_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return {"command": shlex.join([sys.executable, "-m", "tests.e2e.online_serving.capacity", *argv]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_revision": revision, "hostname": socket.gethostname(),
            "gpus": "; ".join(gpus.splitlines()) if gpus else None}


def summary(layouts: list[dict[str, Any]]) -> str:
    """One line per layout: the comparison at a glance."""
    header = (f"{'layout':<16} {'srv':>3} {'ok/req':>9} {'holds':>5} {'lag p50/p99 ms':>15} {'max gap':>7} "
              f"{'send p99':>8} {'first audio':>11} {'ticks':>7} {'tick ms':>7} {'batch':>6} {'<=80ms':>6} "
              f"{'start s':>7}")
    lines = [header]

    def hi(ranges: dict[str, Any], key: str, digits: int = 1) -> str:
        return fmt_cell((ranges[key] or [None, None])[1], digits)  # the max of a [min, max] range

    for r in layouts:
        s, t = r["sessions"], r["ticks"] or {}
        le80 = t.get("ticks_le_80ms_fraction")
        lag = f"{fmt_cell(s['stream_lag_p50_ms'])}/{fmt_cell(s['stream_lag_p99_ms'])}"
        lines.append(f"{r['layout']:<16} {r['servers']:>3} {str(r['sessions_ok']) + '/' + str(r['sessions_requested']):>9} "
                     f"{fmt_cell(s['holding_sessions']):>5} {lag:>15} {fmt_cell(s['max_output_gap_ms']):>7} "
                     f"{fmt_cell(s['client_send_lateness_p99_ms']):>8} {hi(s, 'first_audio_ms'):>11} "
                     f"{fmt_cell(t.get('ticks')):>7} {fmt_cell(t.get('mean_tick_ms')):>7} {fmt_cell(t.get('mean_batch_size')):>6} "
                     f"{'-' if le80 is None else f'{100 * le80:.0f}%':>6} {fmt_cell(r['startup_s']):>7}"
                     + (f"  {r['errors'][0]}" if r["errors"] else "")
                     + ("  (client was the bottleneck: more --driver-processes)" if s["client_bottleneck"] else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.e2e.online_serving.capacity", epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve paced realtime sessions with several deployment layouts (one server process over\n"
                    "several GPUs, one process per GPU, one GPU) in one run; compare them in capacity.json.")
    parser.add_argument("--layout", action="append", required=True, metavar="KIND:DEVICES",
                        help="process:DEVICES or split:DEVICES; repeat for each layout, run in the order given")
    parser.add_argument("--sessions-per-device", type=int, required=True, metavar="N",
                        help="sessions per device (>= 2: the load driver needs a multi-session server); also each "
                             "server's PERSONAPLEX_MAX_SESSIONS")
    parser.add_argument("--input-wav", type=Path, required=True, help="speech WAV every session sends")
    parser.add_argument("--output-dir", type=Path, required=True, help="where capacity.json and the logs go")
    parser.add_argument("--load-frames", type=int, default=250, metavar="F",
                        help="80 ms frames per session, silence tail included (default: 250, 20 s; a capacity "
                             "point wants full windows: 3000 with --tail-s 200)")
    parser.add_argument("--tail-s", type=float, default=2.0, metavar="S",
                        help="seconds of silence after the input WAV, so that --load-frames can exceed its length "
                             "(default: 2)")
    parser.add_argument("--driver-processes", type=int, default=None, metavar="P",
                        help=f"worker processes of each server's load driver (1..{MAX_PROCESSES}; default: the "
                             "driver's own, one per 32 sessions up to the CPU count)")
    parser.add_argument("--checkpoint", help="PERSONAPLEX_CHECKPOINT of the servers (default: unset, the tiny demo "
                                             "model); random:personaplex-7b is the 7B shape with random weights")
    parser.add_argument("--kv-cache", help="PERSONAPLEX_KV_CACHE of the servers (e.g. fp8)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0, metavar="S",
                        help="limit for every server of a layout to answer /ready 200 (default: 600)")
    parser.add_argument("--driver-timeout-s", type=float, default=None, metavar="S",
                        help="limit for the load drivers of a layout (default: 240 + 2 x the audio duration)")
    parser.add_argument("--driver-args", default="", metavar="ARGS",
                        help="extra driver flags, one shell-quoted string, e.g. '--max-stream-rtf 1.05'")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Layout]]:
    """Parsed and checked arguments; UsageError for anything bad."""
    args = build_parser().parse_args(argv)
    layouts = [parse_layout(spec) for spec in args.layout]
    for name in ("sessions_per_device", "load_frames"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.driver_processes is not None and not 1 <= args.driver_processes <= MAX_PROCESSES:
        raise UsageError(f"--driver-processes must be in [1, {MAX_PROCESSES}], got {args.driver_processes}")
    if args.sessions_per_device > MAX_LOAD_SESSIONS:
        raise UsageError(f"--sessions-per-device must be <= {MAX_LOAD_SESSIONS} (the load driver's limit)")
    if not (args.tail_s >= 0 and math.isfinite(args.tail_s)):
        raise UsageError(f"--tail-s must be finite and >= 0, got {args.tail_s}")
    if args.sessions_per_device < 2:
        # The load driver needs a server that advertises multi-session (max_sessions >= 2).
        raise UsageError("--sessions-per-device must be >= 2: the load driver needs a multi-session server "
                         "(PERSONAPLEX_MAX_SESSIONS >= 2)")
    if not args.input_wav.is_file():
        raise UsageError(f"--input-wav {args.input_wav}: no such file")
    if (args.output_dir / RESULT_NAME).exists():
        raise UsageError(f"{args.output_dir / RESULT_NAME} exists: refusing to overwrite a previous run's result")
    args.input_wav = args.input_wav.resolve()
    if args.driver_timeout_s is None:
        args.driver_timeout_s = 240.0 + 2 * args.load_frames * 0.08
    return args, layouts


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, layouts = parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(argv)
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **meta, "complete": False,
                              "sessions_per_device": args.sessions_per_device, "load_frames": args.load_frames,
                              "checkpoint": args.checkpoint, "kv_cache": args.kv_cache, "layouts": []}
    try:
        write_json(out / RESULT_NAME, report, exclusive=True)  # claims the name before anything runs
    except FileExistsError:
        print(f"error: {out / RESULT_NAME} exists: refusing to overwrite a previous run's result", file=sys.stderr)
        return EXIT_USAGE

    # SIGTERM ends the run like Ctrl-C: through the finally below, which stops every child.
    signal.signal(signal.SIGTERM, _interrupt)
    children: list[subprocess.Popen] = []
    try:
        for n, layout in enumerate(layouts, 1):
            slug = f"{n}-{layout.kind}-{'_'.join(layout.devices).replace(':', '')}"
            report["layouts"].append(run_layout(args, layout, out / slug, meta, children))
            write_json(out / RESULT_NAME, report)  # a run cut short keeps the layouts it finished
        report["complete"] = True
    except KeyboardInterrupt:
        log.error("interrupted: stopping %d child process(es)", len(children))
    finally:
        for proc in children:
            stop(proc, 10.0)
        write_json(out / RESULT_NAME, report)
    print(summary(report["layouts"]))
    ok = report["complete"] and all(r["ok"] for r in report["layouts"])
    print(f"{'OK' if ok else 'NOT OK'}; result in {out / RESULT_NAME}")
    return EXIT_OK if ok else EXIT_NOT_OK


if __name__ == "__main__":
    sys.exit(main())
