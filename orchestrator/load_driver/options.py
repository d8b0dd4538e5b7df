"""Every setting of a driver run in one typed place (the CLI builds it from its flags)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import wire
from .acceptance import Thresholds

DEFAULT_URL = "ws://127.0.0.1:8000/v1/realtime?duplex=1"
DEFAULT_OUTPUT_DIR = "/tmp/personaplex-realtime-duplex"
DEFAULT_VOICE = "NATF2.pt"
DEFAULT_PERSONA = "You are a concise and helpful assistant."
DEFAULT_SECONDARY_PERSONA = "You are a calm and precise assistant."
DEFAULT_REPLACEMENT_PERSONA = "You are a cheerful travel assistant."
PROTOCOLS = ("realtime", "native")
MAX_LOAD_SESSIONS = 1024
MAX_LOAD_FRAMES = 10_000
# Load mode's real-time gate (a session fails past either) and the default process split.
DEFAULT_MAX_STREAM_LAG_MS = 250.0
DEFAULT_MAX_GAP_MS = 500.0
SESSIONS_PER_PROCESS = 32
MAX_PROCESSES = 256
# A capacity run is valid only while the client keeps its grid this well (spec performance.md).
CLIENT_LATENESS_LIMIT_MS = 20.0
# A session "holds" real time when its stream lag p99 and its longest output gap stay within
# these (spec performance.md): stricter than the gate, reported, not enforced.
HOLD_STREAM_LAG_P99_MS = 100.0
HOLD_MAX_GAP_MS = 200.0


class OptionsError(ValueError):
    """A setting is out of range; the message names the flag."""


@dataclass(frozen=True)
class Options:
    model: str
    input_wav: Path
    url: str = DEFAULT_URL
    output_dir: Path = Path(DEFAULT_OUTPUT_DIR)
    expected_input_sha256: str | None = None
    api_key: str | None = field(default=None, repr=False)  # from --api-key-env; never exported
    protocol: str = "realtime"  # realtime | native (/api/chat, Ogg/Opus; load mode only)
    # Voice and personas.
    voice: str = DEFAULT_VOICE
    persona: str = DEFAULT_PERSONA
    secondary_persona: str = DEFAULT_SECONDARY_PERSONA
    replacement_persona: str = DEFAULT_REPLACEMENT_PERSONA
    # Timing.
    tail_s: float = 2.0
    drain_s: float = 2.0
    timeout_s: float = 180.0
    cleanup_timeout_s: float = 5.0
    progress_s: float = 5.0
    # Acceptance.
    thresholds: Thresholds = Thresholds()
    replacement_frames: int = 0
    admission_limit: int | None = None  # None: the server's advertised max_sessions (lifecycle.py)
    # Load mode (sessions=None selects the lifecycle mode).
    sessions: int | None = None
    load_frames: int = 1000
    max_client_rtf: float | None = None
    max_stream_rtf: float | None = None
    max_lag_drift_ms: float | None = None
    max_stream_lag_ms: float = DEFAULT_MAX_STREAM_LAG_MS
    max_gap_ms: float = DEFAULT_MAX_GAP_MS
    start_spread_ms: float = 0.0  # session starts spread over this window (random phases)
    processes: int | None = None  # None: one per SESSIONS_PER_PROCESS sessions, at most the CPU count
    server_revision: str | None = None
    server_hardware: str | None = None
    plot: bool = False

    @property
    def load_mode(self) -> bool:
        return self.sessions is not None

    def process_count(self, cpus: int | None = None) -> int:
        """Driver processes of a load run: ``processes`` if set, else one per
        ``SESSIONS_PER_PROCESS`` sessions, capped by the CPU count (never more than sessions)."""
        sessions = self.sessions or 1
        if self.processes is not None:
            return min(self.processes, sessions)
        cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        return max(1, min(math.ceil(sessions / SESSIONS_PER_PROCESS), cpus))

    def validate(self) -> None:
        """Raise ``OptionsError`` naming the first flag out of range."""
        def finite(name: str, value: float, *, positive: bool = False) -> None:
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise OptionsError(f"--{name} must be finite and {'> 0' if positive else '>= 0'}, got {value}")

        for name, value in (("tail-s", self.tail_s), ("drain-s", self.drain_s)):
            finite(name, value)
        for name, value in (("timeout-s", self.timeout_s), ("cleanup-timeout-s", self.cleanup_timeout_s),
                            ("progress-s", self.progress_s)):
            finite(name, value, positive=True)
        t = self.thresholds
        if t.max_frame_deficit < 0:
            raise OptionsError(f"--max-frame-deficit must be >= 0, got {t.max_frame_deficit}")
        if t.min_voiced_frames < 1:
            raise OptionsError(f"--min-voiced-frames must be >= 1, got {t.min_voiced_frames}")
        if t.minimum_audio_chunks < 1:
            raise OptionsError(f"--minimum-audio-chunks must be >= 1, got {t.minimum_audio_chunks}")
        finite("voiced-frame-rms-threshold", t.voiced_frame_rms_threshold)
        if self.replacement_frames < 0:
            raise OptionsError(f"--replacement-frames must be >= 0, got {self.replacement_frames}")
        if self.admission_limit is not None and self.admission_limit < 2:
            raise OptionsError(f"--admission-limit must be >= 2 (the lifecycle runs two sessions at once), "
                               f"got {self.admission_limit}")
        if self.sessions is not None and not 1 <= self.sessions <= MAX_LOAD_SESSIONS:
            raise OptionsError(f"--sessions must be in [1, {MAX_LOAD_SESSIONS}], got {self.sessions}")
        if not 1 <= self.load_frames <= MAX_LOAD_FRAMES:
            raise OptionsError(f"--load-frames must be in [1, {MAX_LOAD_FRAMES}], got {self.load_frames}")
        for name, value in (("max-client-rtf", self.max_client_rtf), ("max-stream-rtf", self.max_stream_rtf)):
            if value is not None:
                finite(name, value, positive=True)
        if self.max_lag_drift_ms is not None:
            finite("max-lag-drift-ms", self.max_lag_drift_ms)
        finite("max-stream-lag-ms", self.max_stream_lag_ms, positive=True)
        finite("max-gap-ms", self.max_gap_ms, positive=True)
        finite("start-spread-ms", self.start_spread_ms)
        if self.start_spread_ms > 1000.0 * wire.FRAME_PERIOD_S:
            raise OptionsError(f"--start-spread-ms must be at most one frame period (80), got {self.start_spread_ms}")
        if self.processes is not None:
            if not 1 <= self.processes <= MAX_PROCESSES:
                raise OptionsError(f"--processes must be in [1, {MAX_PROCESSES}], got {self.processes}")
            if self.sessions is None:
                raise OptionsError("--processes needs --sessions (the lifecycle mode runs in one process)")
            if self.processes > self.sessions:
                raise OptionsError(f"--processes {self.processes} is more than --sessions {self.sessions}")
        if self.protocol not in PROTOCOLS:
            raise OptionsError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.protocol == "native" and self.sessions is None:
            raise OptionsError("--protocol native needs --sessions (the lifecycle mode is the Realtime protocol's)")
        if not self.url.startswith(("ws://", "wss://")):
            raise OptionsError(f"--url must be a ws:// or wss:// URL, got {self.url.split('?')[0]!r}")
