"""Paced multi-session load mode (``--sessions N``): spec §7.4.

1. All N sessions open first (admission is not part of the measurement).  A refused or
   failed open becomes a failed row; it never blocks the others.
2. One shared ``time.monotonic()`` start; every session sends its input on its own 80 ms
   grid from it (``pacing.send_paced``).
3. A fixed ``--drain-s`` window, then the acceptance checks; what arrives later (during
   cleanup) is excluded.
4. ``session.close`` and its ``session.closed`` share one ``--cleanup-timeout-s`` budget.
5. One row per session, ``load-result.json`` opened with mode "x" (a previous run's evidence
   is never overwritten).  Credentials and audio never reach the result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from . import acceptance, metrics, wire
from .audio import InputAudio, load_input
from .options import Options
from .packets import PacketLog, packet_log
from .pacing import send_paced
from .probe import RealtimeProbe
from .report import write_json

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

# Session statistics: null for a session that never got past admission.
SESSION_STAT_FIELDS = ("frame_deficit", "output_frames", "voiced_frames", "silent_frames", "frame_coverage_ratio",
                       "audio_rms", "audio_chunks", "audio_samples", "scheduler_data_plane")


class CapabilityMismatch(AssertionError):
    """session.created did not advertise 80 ms chunks and same-replica multi-session."""


def client_metrics(plog: PacketLog, sends: list[metrics.Send]) -> dict[str, Any]:
    """The client-side measurements of one session (spec §7.4), from its packet log and its
    send timeline."""
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
        "client_send_lateness_ms": lateness,
        "client_pacing_warning": metrics.pacing_warning(lateness),
        "audio_underrun_s": None if flow is None else flow.max_underrun_s,
        "audio_underrun_event_count": None if flow is None else flow.underrun_event_count,
        "audio_continuity_ok": None if flow is None else flow.is_continuous,
        **metrics.stream_timing(plog.arrivals, plog.samples, sends),
    }


def _timelines(plog: PacketLog, sends: list[metrics.Send]) -> dict[str, Any]:
    return {
        "input_timeline": [{"frame_index": i, "planned_at_s": p, "send_started_at_s": s, "send_completed_at_s": c}
                           for i, (p, s, c) in enumerate(sends)],
        "audio_packet_timeline": plog.timeline(),
        "invalid_audio_packets": plog.invalid,
    }


class _Session:
    """One load session: its probe, its sends, and the row it becomes."""

    def __init__(self, opts: Options, audio: InputAudio, index: int) -> None:
        self.opts = opts
        self.audio = audio
        self.index = index
        self.label = f"personaplex-load-{index}"
        self.session_id = self.label  # replaced by the server's id once admitted
        self.probe = RealtimeProbe(wire.realtime_url(opts.url, opts.model), label=self.label, api_key=opts.api_key,
                                   close_timeout_s=opts.cleanup_timeout_s)
        self.sends: list[metrics.Send] = []
        self.admitted = False

    async def run(self, ready: asyncio.Future, start: asyncio.Future) -> dict[str, Any]:
        opts, probe = self.opts, self.probe
        phase = "admission"
        error: str | None = None
        check: str | None = None
        cleanup_error: str | None = None
        cutoff: int | None = None
        stats: dict[str, Any] | None = None
        try:
            try:
                await asyncio.wait_for(probe.connect(opts.timeout_s), opts.timeout_s)
                await probe.send(wire.session_update(model=opts.model, voice=opts.voice, persona=opts.persona),
                                 opts.timeout_s)
                created = await probe.wait_event("session.created", opts.timeout_s)
                self.admitted = True
                self.session_id = wire.session_id_of(created) or self.label
                if wire.capability_mismatches(wire.capabilities_of(created), wire.LOAD_CAPABILITIES):
                    raise CapabilityMismatch("capabilities")
                ready.set_result(None)
                phase = "stream"
                stream_start = await asyncio.shield(start)
                await send_paced(lambda event: probe.send(event, opts.timeout_s), self.audio.pcm,
                                 start=stream_start, sends=self.sends, before_send=probe.check)
                phase = "drain"
                await asyncio.sleep(opts.drain_s)  # fixed window: closing must not extend it
                probe.check()
                cutoff = len(probe.events)
                stats, failure = acceptance.evaluate(packet_log(probe.events, probe.received_at, cutoff),
                                                     input_frames=len(self.sends), thresholds=opts.thresholds,
                                                     session_id=self.session_id)
                if failure is not None:
                    check = failure.check
                    error = f"drain: AcceptanceError: {failure.check}: {failure.message}"
            except Exception as exc:  # noqa: BLE001 - every failure becomes the row's error
                # Only the phase and the exception type: messages may quote wire data.
                error = f"{phase}: {type(exc).__name__}"
                log.debug("%s failed in %s", self.label, phase, exc_info=True)
            finally:
                if cutoff is None:
                    cutoff = len(probe.events)
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
        return self._row(cutoff, error, check, cleanup_error, stats)

    async def _close(self) -> None:
        await self.probe.send(wire.session_close())
        await self.probe.wait_event("session.closed", self.opts.cleanup_timeout_s, fail_fast=False)

    def _row(self, cutoff: int, error: str | None, check: str | None, cleanup_error: str | None,
             stats: dict[str, Any] | None) -> dict[str, Any]:
        opts, probe = self.opts, self.probe
        plog = packet_log(probe.events, probe.received_at, cutoff)
        measured = client_metrics(plog, self.sends)
        if stats is None and self.admitted:  # stopped before the drain ended: numbers, no verdict
            stats, _ = acceptance.evaluate(plog, input_frames=len(self.sends), thresholds=opts.thresholds)
        if cleanup_error:
            error = f"{error}; {cleanup_error}" if error else cleanup_error
        if probe.errors():
            error = error or "server emitted a Realtime error"
        if plog.invalid:
            error = error or "invalid audio packets"
        if probe.violations:
            error = error or "protocol violation"
        first_audio = measured["client_first_audio_after_stream_start_ms"]
        if first_audio is not None and first_audio < 0:
            error = error or "audio arrived before the first input frame"
        error = error or _cap_error(opts, measured)
        row: dict[str, Any] = {
            "index": self.index,
            "session_id": self.session_id,
            "ok": error is None,
            "error": error,
            "acceptance_check": check,
            "server_error_count": len(probe.errors()),
            "server_error_codes": probe.error_codes(),
            "protocol_violations": [v["code"] for v in probe.violations],
            **measured,
            **{name: (stats or {}).get(name) for name in SESSION_STAT_FIELDS},
            **_timelines(plog, self.sends),
        }
        return row


def _cap_error(opts: Options, measured: dict[str, Any]) -> str | None:
    """The first opt-in real-time ceiling the session exceeds, if any."""
    for limit, key in ((opts.max_client_rtf, "client_stream_rtf"), (opts.max_stream_rtf, "server_stream_rtf"),
                       (opts.max_lag_drift_ms, "stream_lag_drift_ms")):
        value = measured[key]
        if limit is not None and value is not None and value > limit:
            return f"{key} exceeds {limit}"
    return None


async def _report_progress(sessions: list[_Session], total_frames: int, started: float, every_s: float) -> None:
    """A log line every ``every_s`` while the sessions stream (long runs should not look hung)."""
    while True:
        await asyncio.sleep(every_s)
        live = [s for s in sessions if s.admitted]
        if not live:
            continue
        sent = [len(s.sends) for s in live]
        out = [s.probe.output_frames for s in live]
        errors = sum(len(s.probe.errors()) for s in sessions)
        log.info("t=%5.1f s  frames sent %d..%d of %d  output frames %d..%d  server errors %d",
                 time.monotonic() - started, min(sent), max(sent), total_frames, min(out), max(out), errors)


def _shared_response_ids(rows: list[dict[str, Any]]) -> set[str]:
    seen: set[str] = set()
    shared: set[str] = set()
    for row in rows:
        ids = set(row["response_ids"])
        shared |= seen & ids
        seen |= ids
    return shared


async def run_load(opts: Options) -> dict[str, Any]:
    """Run the load and write ``load-result.json``; returns the result."""
    assert opts.sessions is not None
    output_dir = Path(opts.output_dir)
    result_path = output_dir / RESULT_NAME
    if result_path.exists():
        raise FileExistsError(f"{result_path} exists: refusing to overwrite a previous run's result")
    audio = load_input(Path(opts.input_wav), tail_s=opts.tail_s, expected_sha256=opts.expected_input_sha256,
                       max_frames=opts.load_frames)
    output_dir.mkdir(parents=True, exist_ok=True)
    log.info("load: %d sessions x %d frames (%.1f s of audio each) against %s", opts.sessions, audio.frames,
             audio.frames * wire.FRAME_PERIOD_S, wire.redacted_url(opts.url))

    loop = asyncio.get_running_loop()
    start: asyncio.Future[float] = loop.create_future()
    sessions = [_Session(opts, audio, i) for i in range(opts.sessions)]
    ready = [loop.create_future() for _ in sessions]
    tasks = [asyncio.create_task(s.run(r, start), name=s.label) for s, r in zip(sessions, ready)]
    progress: asyncio.Task | None = None
    try:
        await asyncio.gather(*ready)
        admitted = sum(s.admitted for s in sessions)
        log.info("load: %d of %d sessions admitted; streaming", admitted, opts.sessions)
        start.set_result(time.monotonic())
        progress = asyncio.create_task(_report_progress(sessions, audio.frames, start.result(), opts.progress_s))
        rows = list(await asyncio.gather(*tasks))
    finally:
        if progress is not None:
            progress.cancel()
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    shared = _shared_response_ids(rows)
    for row in rows:
        if shared.intersection(row["response_ids"]):
            message = "concurrent sessions shared a response id"
            row.update(ok=False, error=f"{row['error']}; {message}" if row["error"] else message)

    result = {
        "schema_version": SCHEMA_VERSION,
        "mode": "paced_multi_session",
        "model": opts.model,
        "requested_sessions": opts.sessions,
        "passed_sessions": sum(row["ok"] is True for row in rows),
        "ok": all(row["ok"] is True for row in rows),
        "input": {"path": audio.path, "sha256": audio.sha256, "tail_s": opts.tail_s, "load_frames": opts.load_frames},
        "frame_period_s": wire.FRAME_PERIOD_S,
        "drain_s": opts.drain_s,
        "cleanup_timeout_s": opts.cleanup_timeout_s,
        "client_pacing_warning_threshold_ms": wire.FRAME_PERIOD_S * 1000.0,
        "client_pacing_warning_sessions": [row["index"] for row in rows if row["client_pacing_warning"]],
        "max_client_rtf": opts.max_client_rtf,
        "max_stream_rtf": opts.max_stream_rtf,
        "max_lag_drift_ms": opts.max_lag_drift_ms,
        "acceptance": opts.thresholds.as_dict(),
        "shared_response_ids": sorted(shared),
        "sessions": rows,
        "reported_server": {"revision": opts.server_revision, "hardware": opts.server_hardware},
        "measurement_origin": MEASUREMENT_ORIGIN,
        "interval_definition": INTERVAL_DEFINITION,
        "stream_timing_definition": STREAM_TIMING_DEFINITION,
    }
    write_json(result_path, result, exclusive=True)
    log.info("load: wrote %s", result_path)
    if opts.plot:
        from .plot import plot_load_result, plot_safely

        plot_safely(lambda: plot_load_result(result, output_dir / PLOT_NAME))
    return result
