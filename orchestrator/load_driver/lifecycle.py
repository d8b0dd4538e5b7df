"""Lifecycle acceptance mode (no ``--sessions``): spec §7.2.

1. open: a primary and a secondary session (different personas) are admitted with distinct
   server ids and identical capabilities that match PersonaPlex's;
2. admission: with ``--admission-limit`` sessions open (fillers beyond the two), one more is
   refused with ``resource_exhausted``;
3. stream: both sessions get the input at the same time, paced in real time; each passes the
   acceptance checks and they share no response id;
4. recycle: the primary closes (``session.close`` -> ``session.closed``) and a replacement
   opens with another persona: a fresh id, the same capabilities;
5. continue: the secondary (undisturbed: same response) and the replacement (no earlier
   response id) stream again and pass the checks;
6. any server ``error`` event fails the run.

Writes ``result.json`` (also on failure, naming the failed step) and, per session,
``<name>-events.jsonl`` (every event as received) and ``<name>-output.wav``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import acceptance, wire
from .audio import InputAudio, load_input, write_pcm16_wav
from .metrics import Send
from .options import Options
from .pacing import send_paced
from .probe import RealtimeProbe
from .report import write_json

log = logging.getLogger(__name__)

RESULT_NAME = "result.json"
PLOT_NAME = "lifecycle-timeline.png"
DEFAULT_ADMISSION_LIMIT = 2  # the reference deployment's max_sessions
NAMES = ("primary", "secondary", "replacement")


class LifecycleFailure(AssertionError):
    def __init__(self, step: str, message: str, check: str | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.check = check


@dataclass
class _Member:
    """One session of the scenario."""

    name: str
    probe: RealtimeProbe
    session_id: str | None = None
    capabilities: dict[str, Any] | None = None
    input_frames: int = 0
    sends: list[Send] = field(default_factory=list)
    saved: bool = False


class _Scenario:
    def __init__(self, opts: Options, audio: InputAudio, output_dir: Path) -> None:
        self.opts = opts
        self.audio = audio
        self.output_dir = output_dir
        self.url = wire.realtime_url(opts.url, opts.model)
        self.members: dict[str, _Member] = {}
        self.extra: list[RealtimeProbe] = []  # fillers and the refused session
        self.step = "open"
        self.result: dict[str, Any] = {
            "ok": False, "model": opts.model,
            "input": {"path": audio.path, "sha256": audio.sha256, "tail_s": opts.tail_s},
            "capabilities": None, "overflow_error_code": None,
            "primary": None, "secondary": None, "replacement": None,
            "errors": [], "failure": None, "output_dir": str(output_dir),
        }

    # Steps --------------------------------------------------------------------------------------
    async def run(self) -> None:
        opts = self.opts
        self.step = "open"
        primary = await self._open("primary", opts.persona)
        secondary = await self._open("secondary", opts.secondary_persona)
        if not primary.session_id or not secondary.session_id or primary.session_id == secondary.session_id:
            raise LifecycleFailure("open", "the server did not allocate two distinct session ids", "session_ids")
        caps = primary.capabilities
        if secondary.capabilities != caps:
            raise LifecycleFailure("open", "concurrent sessions advertised different capabilities", "capabilities")
        wrong = wire.capability_mismatches(caps, wire.LIFECYCLE_CAPABILITIES)
        if wrong:
            raise LifecycleFailure("open", f"unexpected capability values for {', '.join(wrong)}", "capabilities")
        self.result["capabilities"] = caps

        self.step = "admission"
        await self._check_admission_limit()

        self.step = "stream"
        log.info("lifecycle: streaming %d frames to primary and secondary", self.audio.frames)
        await self._stream([primary, secondary], max_frames=None)
        primary_stats = self._accept(primary, opts.thresholds.minimum_audio_chunks)
        secondary_stats = self._accept(secondary, opts.thresholds.minimum_audio_chunks)
        first_ids = {"primary": set(primary_stats["response_ids"]), "secondary": set(secondary_stats["response_ids"])}
        if first_ids["primary"] & first_ids["secondary"]:
            raise LifecycleFailure("stream", "primary and secondary shared a response id", "response_identity")
        self.result["primary"] = {"session_id": primary.session_id, "input_frames": primary.input_frames,
                                  **primary_stats}
        first_phase_frames = secondary.input_frames

        self.step = "recycle"
        await self._close(primary, opts.timeout_s)
        replacement = await self._open("replacement", opts.replacement_persona)
        if replacement.session_id in (primary.session_id, secondary.session_id) or not replacement.session_id:
            raise LifecycleFailure("recycle", "the replacement session id was not freshly allocated", "session_ids")
        if replacement.capabilities != caps:
            raise LifecycleFailure("recycle", "the replacement advertised different capabilities", "capabilities")

        self.step = "continue"
        limit = opts.replacement_frames or None
        log.info("lifecycle: streaming %d frames to secondary and replacement",
                 min(self.audio.frames, limit or self.audio.frames))
        await self._stream([secondary, replacement], max_frames=limit)
        secondary_stats = self._accept(secondary, opts.thresholds.minimum_audio_chunks + 1)
        replacement_stats = self._accept(replacement, 1)
        if set(secondary_stats["response_ids"]) != first_ids["secondary"]:
            raise LifecycleFailure("continue", "the surviving session's response changed while a slot was recycled",
                                   "response_identity")
        if set(replacement_stats["response_ids"]) & (first_ids["primary"] | first_ids["secondary"]):
            raise LifecycleFailure("continue", "the replacement reused an earlier response id", "response_identity")
        self.result["secondary"] = {
            "session_id": secondary.session_id, "input_frames": secondary.input_frames,
            "continuation_frames_after_recycle": secondary.input_frames - first_phase_frames, **secondary_stats}
        self.result["replacement"] = {"session_id": replacement.session_id,
                                      "input_frames": replacement.input_frames, **replacement_stats}

        self.step = "close"
        await _all_or_nothing([self._close(secondary, opts.timeout_s), self._close(replacement, opts.timeout_s)])

    async def _open(self, name: str, persona: str) -> _Member:
        probe = await self._connect(name, persona)
        member = _Member(name, probe)
        self.members[name] = member
        created = await self._created_or_error(probe)
        if created["type"] == "error":
            raise LifecycleFailure(self.step, f"{name} session refused with {wire.error_code_of(created)}", "admission")
        member.session_id = wire.session_id_of(created)
        member.capabilities = wire.capabilities_of(created)
        log.info("lifecycle: %s session %s open", name, member.session_id)
        return member

    async def _connect(self, label: str, persona: str) -> RealtimeProbe:
        probe = RealtimeProbe(self.url, label=label, api_key=self.opts.api_key,
                              close_timeout_s=self.opts.cleanup_timeout_s, keep_events=True,
                              voiced_rms_threshold=self.opts.thresholds.voiced_frame_rms_threshold)
        await asyncio.wait_for(probe.connect(self.opts.timeout_s), self.opts.timeout_s)
        await probe.send(wire.session_update(model=self.opts.model, voice=self.opts.voice, persona=persona),
                         self.opts.timeout_s)
        return probe

    async def _created_or_error(self, probe: RealtimeProbe) -> dict[str, Any]:
        """The first ``session.created`` or ``error`` of an opening session."""
        return await probe.wait_first_of(("session.created", "error"), self.opts.timeout_s, "session.created")

    def admission_limit(self) -> tuple[int, str]:
        """``--admission-limit``, else the ``max_sessions`` the server advertises in its
        capabilities (personaplex-serve does), else the reference deployment's 2; and where
        the number came from."""
        if self.opts.admission_limit is not None:
            return self.opts.admission_limit, "--admission-limit"
        advertised = (self.result.get("capabilities") or {}).get("max_sessions")
        if isinstance(advertised, int) and not isinstance(advertised, bool) and advertised >= 2:
            return advertised, "the server's capabilities"
        return DEFAULT_ADMISSION_LIMIT, "the reference deployment's"

    async def _check_admission_limit(self) -> None:
        limit, source = self.admission_limit()
        self.result["admission_limit"] = limit
        log.info("lifecycle: admission limit %d (%s)", limit, source)
        fillers = []
        for i in range(limit - 2):
            probe = await self._connect(f"filler-{i}", self.opts.persona)
            self.extra.append(probe)
            answer = await self._created_or_error(probe)
            if answer["type"] == "error":
                raise LifecycleFailure("admission", f"session {i + 3} of the admission limit {limit} was refused "
                                                    f"with {wire.error_code_of(answer)}", "admission")
            fillers.append(probe)
        overflow = await self._connect("overflow", self.opts.persona)
        self.extra.append(overflow)
        answer = await self._created_or_error(overflow)
        if answer["type"] == "session.created":
            raise LifecycleFailure("admission", f"session {limit + 1} was admitted: the server did not enforce "
                                                f"--admission-limit {limit}", "admission")
        code = wire.error_code_of(answer)
        self.result["overflow_error_code"] = code
        log.info("lifecycle: session %d refused with %s", limit + 1, code)
        if code != "resource_exhausted":
            raise LifecycleFailure("admission", f"session {limit + 1} was refused with {code}, expected "
                                                "resource_exhausted", "admission")
        await _quietly(overflow.close(), self.opts.cleanup_timeout_s)
        for probe in fillers:
            await self._send_close(probe, self.opts.cleanup_timeout_s)

    async def _stream(self, members: list[_Member], max_frames: int | None) -> None:
        """Send the input to ``members`` at the same time, wait until each caught up to within
        the allowed deficit, then drain for ``--drain-s``."""
        opts = self.opts
        start = time.monotonic() + 0.01
        counts = await _all_or_nothing([
            send_paced(lambda text, p=m.probe: p.send_text(text, opts.timeout_s), self.audio.frame_texts, start=start,
                       sends=m.sends, before_send=m.probe.check, max_frames=max_frames) for m in members])
        for member, sent in zip(members, counts):
            member.input_frames += sent
        await _all_or_nothing([
            m.probe.wait_for(lambda m=m: m.probe.output_frames >= m.input_frames - opts.thresholds.max_frame_deficit,
                             opts.timeout_s, f"{m.name} frame coverage") for m in members])
        await asyncio.sleep(opts.drain_s)
        for member in members:
            member.probe.check()

    def _accept(self, member: _Member, minimum_chunks: int) -> dict[str, Any]:
        stats, failure = acceptance.evaluate(member.probe.packets, input_frames=member.input_frames,
                                             thresholds=self.opts.thresholds, minimum_chunks=minimum_chunks,
                                             session_id=member.session_id,
                                             input_ended_at=member.sends[-1][2] if member.sends else None)
        if failure is not None:
            self.result[member.name] = {"session_id": member.session_id, "input_frames": member.input_frames,
                                        **stats, "acceptance_check": failure.check}
            raise LifecycleFailure(self.step, f"{member.name}: {failure.check}: {failure.message}", failure.check)
        return {**stats, "acceptance_check": None}

    async def _close(self, member: _Member, timeout_s: float) -> None:
        self._save(member)
        await self._send_close(member.probe, timeout_s)

    async def _send_close(self, probe: RealtimeProbe, timeout_s: float) -> None:
        await probe.send(wire.session_close(), timeout_s)
        await probe.wait_event("session.closed", timeout_s, fail_fast=False)
        await _quietly(probe.close(), self.opts.cleanup_timeout_s)

    # Output -------------------------------------------------------------------------------------
    def _save(self, member: _Member) -> None:
        """Write the member's events and output audio (once; later events are not added)."""
        if member.saved:
            return
        member.saved = True
        probe = member.probe
        with (self.output_dir / f"{member.name}-events.jsonl").open("w", encoding="utf-8") as stream:
            for event in probe.events:
                stream.write(json.dumps(event, ensure_ascii=False) + "\n")
        write_pcm16_wav(self.output_dir / f"{member.name}-output.wav", probe.packets.pcm16)

    async def cleanup(self) -> None:
        """Close whatever is still open (bounded), saving each named session first."""
        budget = self.opts.cleanup_timeout_s
        for member in self.members.values():
            self._save(member)
            if not member.probe.closed and not member.probe.count("session.closed"):
                await _quietly(self._send_close(member.probe, budget), budget)
            await _quietly(member.probe.close(), budget)
        for probe in self.extra:
            if not probe.closed and probe.count("session.created") and not probe.count("session.closed"):
                await _quietly(self._send_close(probe, budget), budget)
            await _quietly(probe.close(), budget)

    def plot_series(self) -> list[dict[str, Any]]:
        series = []
        for member in self.members.values():
            plog = member.probe.packets
            series.append({"label": member.name, "sends": member.sends, "arrivals": plog.arrivals,
                           "samples": plog.samples})
        return series


async def _all_or_nothing(coroutines: list) -> list:
    """Run concurrently; on the first failure cancel the rest and raise that failure (no
    orphan keeps streaming into a session that is being cleaned up)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _quietly(awaitable, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except Exception:  # noqa: BLE001 - best-effort cleanup
        log.debug("cleanup step failed", exc_info=True)


async def run_lifecycle(opts: Options) -> dict[str, Any]:
    """Run the scenario and write its files; returns the result (``ok`` false on failure)."""
    audio = load_input(Path(opts.input_wav), tail_s=opts.tail_s, expected_sha256=opts.expected_input_sha256)
    audio.frame_texts  # encode every frame once, before any clock starts
    output_dir = Path(opts.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    log.info("lifecycle: %d input frames (%.1f s) against %s", audio.frames, audio.frames * wire.FRAME_PERIOD_S,
             wire.redacted_url(opts.url))
    scenario = _Scenario(opts, audio, output_dir)
    result = scenario.result
    try:
        await scenario.run()
    except LifecycleFailure as failure:
        result["failure"] = {"step": failure.step, "check": failure.check, "message": failure.message}
    except Exception as exc:  # noqa: BLE001 - reported in result.json, not as a traceback
        result["failure"] = {"step": scenario.step, "check": None, "message": f"{type(exc).__name__}: {exc}"}
        log.debug("lifecycle step %s failed", scenario.step, exc_info=True)
    finally:
        await scenario.cleanup()
    errors = [event for name in NAMES if name in scenario.members for event in scenario.members[name].probe.errors()]
    result["errors"] = errors
    if result["failure"] is None and errors:
        result["failure"] = {"step": "errors", "check": None,
                             "message": f"the server sent {len(errors)} error event(s): "
                                        f"{sorted({wire.error_code_of(e) for e in errors})}"}
    result["ok"] = result["failure"] is None
    write_json(output_dir / RESULT_NAME, result)
    if opts.plot:
        from .plot import plot_series, plot_safely

        plot_safely(lambda: plot_series(scenario.plot_series(), output_dir / PLOT_NAME, title="lifecycle"))
    return result

