"""Paced multi-session load mode (``--sessions N``): spec §7.4.

1. All N sessions open first (admission is not part of the measurement).  A refused or
   failed open becomes a failed row; it never blocks the others.
2. One shared ``time.monotonic()`` start; every session sends its input on its own 80 ms
   grid from it (``pacing.send_paced``).  With ``--processes P`` the sessions are split over
   P worker processes (``processes``) that open theirs, report, and start at one common
   monotonic instant (the clock is the host's, shared by every process).
3. A fixed ``--drain-s`` window, then the acceptance checks and the real-time gate (stream
   lag p99 and the longest output gap); what arrives later (during cleanup) is excluded.
4. ``session.close`` and its ``session.closed`` share one ``--cleanup-timeout-s`` budget.
5. One row per session and one result (``assemble_result``, whichever way the sessions
   ran), ``load-result.json`` opened with mode "x" (a previous run's evidence is never
   overwritten).  Credentials and audio never reach the result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from . import acceptance, metrics, wire
from .audio import InputAudio
from .options import (CLIENT_LATENESS_LIMIT_MS, HOLD_MAX_GAP_MS, HOLD_STREAM_LAG_P99_MS, Options)
from .packets import PacketLog
from .native_probe import NativeProbe
from .native_wire import chat_url
from .pacing import send_paced
from .probe import RealtimeProbe

log = logging.getLogger(__name__)

RESULT_NAME = "load-result.json"
PLOT_NAME = "load-timeline.png"
SCHEMA_VERSION = 1

MEASUREMENT_ORIGIN = "client monotonic clock; admission excluded; streaming and drain retained"
INTERVAL_DEFINITION = "nonempty audio packet arrivals, not server ticks or per-frame inference latency"
STREAM_TIMING_DEFINITION = (
    "output frame k completes when cumulative output samples reach k*1920; its reference is the send "
    "completion of input frame k-1 plus 80 ms; server_stream_rtf is the least-squares slope of completion "
    "against reference over the 10-90% output-frame window, on the last frame each packet completes; "
    "playout_stall_ms plays from 120 ms after the first nonempty audio packet (strict), "
    "steady_playout_stall_ms from 120 ms after the second (the first when there is only one)")
STREAM_LAG_DEFINITION = (
    "stream_lag_ms: per output frame k, its completion minus the send completion of input frame k minus 80 ms; "
    "max_output_gap_ms: the longest time between two consecutive nonempty audio packets; a session fails past "
    "max_stream_lag_ms (p99) or max_gap_ms, and holds real time when its p99 <= hold_stream_lag_p99_ms and its "
    "longest gap <= hold_max_gap_ms")
SERVER_FED_DEFINITION = (
    "server_fed_frames: output frames made from silence the server fed itself, not answers to input frames and "
    "not counted in frame_deficit; from the deltas' metadata.timing when the server says so (source metadata), "
    "else the frames past the input's count that completed after the last input frame was sent (source timing)")

GOLDEN_FRACTION = 0.6180339887498949

# Session statistics: null for a session that never got past admission.
SESSION_STAT_FIELDS = ("frame_deficit", "output_frames", "server_fed_frames", "server_fed_frames_source",
                       "voiced_frames", "silent_frames", "frame_coverage_ratio", "audio_rms", "audio_chunks",
                       "audio_samples", "scheduler_data_plane")


class CapabilityMismatch(AssertionError):
    """session.created did not advertise 80 ms chunks and same-replica multi-session."""


def client_metrics(plog: PacketLog, sends: list[metrics.Send], dues: list[float]) -> dict[str, Any]:
    """The client-side measurements of one session (spec §7.4, plus the stream lag gate's
    inputs), from its packet log and its send timeline."""
    first_send = sends[0][1] if sends else None
    lateness = metrics.distribution(metrics.send_lateness_ms(sends))
    flow = metrics.continuity(plog.arrivals, plog.samples)
    return {
        "input_frames": len(sends),
        "output_samples": plog.output_samples,
        "response_ids": sorted(plog.response_id_set),
        "client_first_audio_after_stream_start_ms":
            metrics.first_after_ms(plog.arrivals[0] if plog.arrivals else None, first_send),
        "client_first_text_after_stream_start_ms": metrics.first_after_ms(plog.first_text_at, first_send),
        "client_stream_rtf": metrics.client_stream_rtf(plog.arrivals, plog.samples, first_send),
        "client_audio_packet_interval_ms": metrics.distribution(metrics.packet_intervals_ms(plog.arrivals)),
        "max_output_gap_ms": metrics.longest_gap_ms(plog.arrivals),
        "client_send_lateness_ms": lateness,
        "client_pacing_warning": metrics.pacing_warning(lateness),
        "client_grid_restarts": metrics.grid_restarts(sends, dues),
        "audio_underrun_s": None if flow is None else flow.max_underrun_s,
        "audio_underrun_event_count": None if flow is None else flow.underrun_event_count,
        "audio_continuity_ok": None if flow is None else flow.is_continuous,
        **metrics.stream_timing(plog.arrivals, plog.samples, sends),
    }


def holds_real_time(measured: dict[str, Any]) -> bool | None:
    """The capacity rule: stream lag p99 <= 100 ms and no output gap over 200 ms."""
    p99, gap = measured["stream_lag_ms"]["p99"], measured["max_output_gap_ms"]
    if p99 is None or gap is None:
        return None
    return p99 <= HOLD_STREAM_LAG_P99_MS and gap <= HOLD_MAX_GAP_MS


def _timelines(plog: PacketLog, sends: list[metrics.Send], dues: list[float]) -> dict[str, Any]:
    return {
        "input_timeline": [{"frame_index": i, "planned_at_s": p, "due_at_s": d, "send_started_at_s": s,
                            "send_completed_at_s": c} for i, ((p, s, c), d) in enumerate(zip(sends, dues))],
        "audio_packet_timeline": plog.timeline(),
        "invalid_audio_packets": plog.invalid,
    }


class LoadSession:
    """One load session: its probe, its sends, and the row it becomes."""

    def __init__(self, opts: Options, audio: InputAudio, index: int, worker: int = 0) -> None:
        self.opts = opts
        self.audio = audio
        self.index = index
        self.worker = worker
        self.label = f"personaplex-load-{index}"
        self.session_id = self.label  # replaced by the server's id once admitted
        self.native = opts.protocol == "native"
        probe_kind, url = ((NativeProbe, chat_url(opts.url, voice=opts.voice, persona=opts.persona)) if self.native
                           else (RealtimeProbe, wire.realtime_url(opts.url, opts.model)))
        self.probe = probe_kind(url, label=self.label, api_key=opts.api_key, close_timeout_s=opts.cleanup_timeout_s,
                                voiced_rms_threshold=opts.thresholds.voiced_frame_rms_threshold)
        # Real clients send at arbitrary phases of the 80 ms period: with --start-spread-ms each
        # session starts this much after the shared instant (golden-ratio steps: spread evenly
        # for any N, the same for a given index in any process split).
        self.start_offset_s = opts.start_spread_ms / 1000.0 * ((index * GOLDEN_FRACTION) % 1.0)
        self.sends: list[metrics.Send] = []
        self.dues: list[float] = []  # each frame's time on the grid in force (pacing.send_paced)
        self.admitted = False

    async def run(self, ready: asyncio.Future, start: asyncio.Future) -> dict[str, Any]:
        opts, probe = self.opts, self.probe
        phase = "admission"
        error: str | None = None
        check: str | None = None
        cleanup_error: str | None = None
        stats: dict[str, Any] | None = None
        try:
            try:
                await asyncio.wait_for(probe.connect(opts.timeout_s), opts.timeout_s)
                await self._open()
                ready.set_result(None)
                phase = "stream"
                stream_start = await asyncio.shield(start) + self.start_offset_s
                frames = self.audio.native_messages if self.native else self.audio.frame_texts
                await send_paced(lambda message: probe.send_text(message, opts.timeout_s), frames,
                                 start=stream_start, sends=self.sends, before_send=probe.check, dues=self.dues)
                phase = "drain"
                await asyncio.sleep(opts.drain_s)  # fixed window: closing must not extend it
                probe.check()
                probe.freeze_packets()
                await probe.settle()
                stats, failure = acceptance.evaluate(probe.packets, input_frames=len(self.sends),
                                                     thresholds=opts.thresholds, session_id=self.session_id,
                                                     input_ended_at=self._input_ended_at)
                if failure is not None:
                    check = failure.check
                    error = f"drain: AcceptanceError: {failure.check}: {failure.message}"
            except Exception as exc:  # noqa: BLE001 - every failure becomes the row's error
                # Only the phase and the exception type: messages may quote wire data.
                error = f"{phase}: {type(exc).__name__}"
                log.debug("%s failed in %s", self.label, phase, exc_info=True)
            finally:
                probe.freeze_packets()
                if self.admitted and not probe.count("session.closed") and not probe.closed:
                    try:
                        await asyncio.wait_for(self._close(), opts.cleanup_timeout_s)
                    except Exception as exc:  # noqa: BLE001
                        cleanup_error = f"cleanup: {type(exc).__name__}"
        finally:
            if not ready.done():
                ready.set_result(None)  # a failed open must not hold the others at the barrier
            try:
                await asyncio.wait_for(probe.close(), opts.cleanup_timeout_s)
            except Exception:  # noqa: BLE001 - the socket is abandoned either way
                pass
        return self.row(error, check, cleanup_error, stats)

    @property
    def _input_ended_at(self) -> float | None:
        return self.sends[-1][2] if self.sends else None

    async def _open(self) -> None:
        """Realtime: ``session.update`` until ``session.created`` (its capabilities checked);
        native: the query did it, wait for the handshake (the prompt is in)."""
        opts, probe = self.opts, self.probe
        if isinstance(probe, NativeProbe):
            await probe.wait_handshake(opts.timeout_s)
            self.admitted = True
            return
        await probe.send(wire.session_update(model=opts.model, voice=opts.voice, persona=opts.persona), opts.timeout_s)
        created = await probe.wait_event("session.created", opts.timeout_s)
        self.admitted = True
        self.session_id = wire.session_id_of(created) or self.label
        if wire.capability_mismatches(wire.capabilities_of(created), wire.LOAD_CAPABILITIES):
            raise CapabilityMismatch("capabilities")

    async def _close(self) -> None:
        if self.native:  # no close message in this protocol: the socket's close ends the session
            return
        await self.probe.send(wire.session_close())
        await self.probe.wait_event("session.closed", self.opts.cleanup_timeout_s, fail_fast=False)

    def row(self, error: str | None, check: str | None = None, cleanup_error: str | None = None,
            stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """The session's result row (also for a session that never ran: all statistics null)."""
        opts, probe = self.opts, self.probe
        plog = probe.packets
        measured = client_metrics(plog, self.sends, self.dues)
        if stats is None and self.admitted:  # stopped before the drain ended: numbers, no verdict
            stats, _ = acceptance.evaluate(plog, input_frames=len(self.sends), thresholds=opts.thresholds,
                                           input_ended_at=self._input_ended_at)
        if cleanup_error:
            error = f"{error}; {cleanup_error}" if error else cleanup_error
        if probe.errors():
            error = error or "server emitted an error"
        if plog.invalid:
            error = error or "invalid audio packets"
        if probe.violations:
            error = error or "protocol violation"
        first_audio = measured["client_first_audio_after_stream_start_ms"]
        if first_audio is not None and first_audio < 0:
            error = error or "audio arrived before the first input frame"
        error = error or _realtime_error(opts, measured)
        return {
            "index": self.index,
            "worker": self.worker,
            "session_id": self.session_id,
            "ok": error is None,
            "error": error,
            "acceptance_check": check,
            "server_error_count": len(probe.errors()),
            "server_error_codes": probe.error_codes(),
            "protocol_violations": [v["code"] for v in probe.violations],
            **measured,
            "holds_real_time": holds_real_time(measured),
            **{name: (stats or {}).get(name) for name in SESSION_STAT_FIELDS},
            **_timelines(plog, self.sends, self.dues),
        }


def _realtime_error(opts: Options, measured: dict[str, Any]) -> str | None:
    """The first real-time ceiling the session exceeds, if any: the lag gate (always on), then
    the opt-in RTF and drift caps."""
    p99 = measured["stream_lag_ms"]["p99"]
    if p99 is not None and p99 > opts.max_stream_lag_ms:
        return f"stream_lag_ms p99 {p99:.0f} exceeds --max-stream-lag-ms {opts.max_stream_lag_ms:g}"
    gap = measured["max_output_gap_ms"]
    if gap is not None and gap > opts.max_gap_ms:
        return f"max_output_gap_ms {gap:.0f} exceeds --max-gap-ms {opts.max_gap_ms:g}"
    for limit, key in ((opts.max_client_rtf, "client_stream_rtf"), (opts.max_stream_rtf, "server_stream_rtf"),
                       (opts.max_lag_drift_ms, "stream_lag_drift_ms")):
        value = measured[key]
        if limit is not None and value is not None and value > limit:
            return f"{key} exceeds {limit}"
    return None


class LoadRun:
    """The sessions one process drives: open them all, start them together, collect rows."""

    def __init__(self, opts: Options, audio: InputAudio, indexes: Sequence[int], worker: int = 0) -> None:
        self.opts = opts
        # Encode every frame once, before any clock starts.
        audio.native_messages if opts.protocol == "native" else audio.frame_texts
        self.sessions = [LoadSession(opts, audio, i, worker) for i in indexes]
        self._tasks: list[asyncio.Task] = []
        self._start: asyncio.Future[float] | None = None

    async def open_all(self) -> int:
        """Open every session (concurrently); returns how many were admitted."""
        loop = asyncio.get_running_loop()
        self._start = loop.create_future()
        ready = [loop.create_future() for _ in self.sessions]
        self._tasks = [asyncio.create_task(s.run(r, self._start), name=s.label) for s, r in zip(self.sessions, ready)]
        await asyncio.gather(*ready)
        return sum(s.admitted for s in self.sessions)

    def start(self, at: float) -> None:
        """Every admitted session sends its first frame at monotonic time ``at``."""
        assert self._start is not None, "open_all first"
        self._start.set_result(at)

    async def finish(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*self._tasks))

    async def abort(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def progress(self) -> dict[str, int] | None:
        """Frames sent and received (min/max over admitted sessions) and server errors."""
        live = [s for s in self.sessions if s.admitted]
        if not live:
            return None
        sent = [len(s.sends) for s in live]
        out = [s.probe.output_frames for s in live]
        return {"sent_min": min(sent), "sent_max": max(sent), "out_min": min(out), "out_max": max(out),
                "errors": sum(len(s.probe.errors()) for s in self.sessions)}


def log_progress(elapsed_s: float, total_frames: int, snapshots: Sequence[dict[str, int] | None]) -> None:
    """One progress line over the snapshots of every process (long runs should not look hung)."""
    live = [p for p in snapshots if p]
    if not live:
        return
    log.info("t=%5.1f s  frames sent %d..%d of %d  output frames %d..%d  server errors %d", elapsed_s,
             min(p["sent_min"] for p in live), max(p["sent_max"] for p in live), total_frames,
             min(p["out_min"] for p in live), max(p["out_max"] for p in live), sum(p["errors"] for p in live))


async def _report_progress(run: LoadRun, total_frames: int, started: float, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        log_progress(time.monotonic() - started, total_frames, [run.progress()])


async def run_sessions_here(opts: Options, audio: InputAudio) -> list[dict[str, Any]]:
    """Drive every session from this process's event loop; returns the rows."""
    assert opts.sessions is not None
    run = LoadRun(opts, audio, range(opts.sessions))
    progress: asyncio.Task | None = None
    try:
        admitted = await run.open_all()
        log.info("load: %d of %d sessions admitted; streaming", admitted, opts.sessions)
        started = time.monotonic()
        run.start(started)
        progress = asyncio.create_task(_report_progress(run, audio.frames, started, opts.progress_s))
        return await run.finish()
    finally:
        if progress is not None:
            progress.cancel()
        await run.abort()


def _shared_response_ids(rows: list[dict[str, Any]]) -> set[str]:
    seen: set[str] = set()
    shared: set[str] = set()
    for row in rows:
        ids = set(row["response_ids"])
        shared |= seen & ids
        seen |= ids
    return shared


def sends_of(row: dict[str, Any]) -> list[metrics.Send]:
    """A result row's send timeline as ``(planned, started, completed)`` tuples."""
    return [(f["planned_at_s"], f["send_started_at_s"], f["send_completed_at_s"]) for f in row["input_timeline"]]


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Run-wide figures over every frame of every session: stream lag and send lateness
    distributions, the longest gap, the sessions that hold real time."""
    lags: list[float] = []
    lateness: list[float] = []
    for row in rows:
        sends = sends_of(row)
        packets = row["audio_packet_timeline"]
        lags += metrics.stream_lags_ms([p["received_at_s"] for p in packets], [p["samples"] for p in packets], sends)
        lateness += metrics.send_lateness_ms(sends)
    gaps = [row["max_output_gap_ms"] for row in rows if row["max_output_gap_ms"] is not None]
    lateness_stats = metrics.distribution(lateness)
    p99 = lateness_stats["p99"]
    return {
        "stream_lag_ms": metrics.distribution(lags),
        "max_output_gap_ms": max(gaps) if gaps else None,
        "client_send_lateness_ms": lateness_stats,
        "client_bottleneck": None if p99 is None else p99 > CLIENT_LATENESS_LIMIT_MS,
        "holding_sessions": sum(row["holds_real_time"] is True for row in rows),
    }


def assemble_result(opts: Options, audio: InputAudio, rows: list[dict[str, Any]], processes: int) -> dict[str, Any]:
    """The whole run's result from its rows (in index order), one way for any process split."""
    assert opts.sessions is not None
    rows = sorted(rows, key=lambda row: row["index"])
    shared = _shared_response_ids(rows)
    for row in rows:
        if shared.intersection(row["response_ids"]):
            message = "concurrent sessions shared a response id"
            row.update(ok=False, error=f"{row['error']}; {message}" if row["error"] else message)
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": "paced_multi_session",
        "protocol": opts.protocol,
        "model": opts.model,
        "requested_sessions": opts.sessions,
        "passed_sessions": sum(row["ok"] is True for row in rows),
        "ok": all(row["ok"] is True for row in rows),
        "input": {"path": audio.path, "sha256": audio.sha256, "tail_s": opts.tail_s, "load_frames": opts.load_frames},
        "frame_period_s": wire.FRAME_PERIOD_S,
        "drain_s": opts.drain_s,
        "cleanup_timeout_s": opts.cleanup_timeout_s,
        "processes": processes,
        "start_spread_ms": opts.start_spread_ms,
        "client_pacing_warning_threshold_ms": wire.FRAME_PERIOD_S * 1000.0,
        "client_pacing_warning_sessions": [row["index"] for row in rows if row["client_pacing_warning"]],
        "client_bottleneck_threshold_ms": CLIENT_LATENESS_LIMIT_MS,
        "max_client_rtf": opts.max_client_rtf,
        "max_stream_rtf": opts.max_stream_rtf,
        "max_lag_drift_ms": opts.max_lag_drift_ms,
        "max_stream_lag_ms": opts.max_stream_lag_ms,
        "max_gap_ms": opts.max_gap_ms,
        "hold_stream_lag_p99_ms": HOLD_STREAM_LAG_P99_MS,
        "hold_max_gap_ms": HOLD_MAX_GAP_MS,
        "acceptance": opts.thresholds.as_dict(),
        "shared_response_ids": sorted(shared),
        **pooled(rows),
        "sessions": rows,
        "reported_server": {"revision": opts.server_revision, "hardware": opts.server_hardware},
        "measurement_origin": MEASUREMENT_ORIGIN,
        "interval_definition": INTERVAL_DEFINITION,
        "stream_timing_definition": STREAM_TIMING_DEFINITION,
        "stream_lag_definition": STREAM_LAG_DEFINITION,
        "server_fed_definition": SERVER_FED_DEFINITION,
    }
