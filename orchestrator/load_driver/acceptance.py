"""The per-session acceptance checks (spec §7.2 step 4), as data in and a verdict out.

``evaluate`` always computes every statistic first, then names the first check that fails,
so a failed session still reports all its numbers.  Failure messages are built from local
counts only, never from wire text, so they are safe to export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import metrics
from .packets import PacketLog
from .wire import SAMPLE_RATE_HZ

# Below this the output is corrupt or effectively zero (speech is judged per frame).
MIN_AUDIO_RMS = 1e-5

# Check names in evaluation order.  The reference's names, plus ``audio_packets`` (an invalid
# packet; the reference raises on it) and ``session_identity`` (a delta whose
# metadata.session_id names another session).
CHECKS = ("audio_packets", "pcm16_output", "audio_rms", "sample_rate", "input_frames", "whole_codec_frames",
          "audio_chunks", "frame_deficit", "voiced_frames", "scheduler_data_plane", "response_identity",
          "session_identity")


@dataclass(frozen=True)
class Thresholds:
    max_frame_deficit: int = 4
    min_voiced_frames: int = 5
    minimum_audio_chunks: int = 2
    voiced_frame_rms_threshold: float = 1e-3
    # vLLM-Omni's deltas prove its scheduler data plane in metadata.vllm_omni; other servers
    # (ours included) do not send that block, so by default the check only reports.
    require_scheduler_data_plane: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"max_frame_deficit": self.max_frame_deficit, "min_voiced_frames": self.min_voiced_frames,
                "minimum_audio_chunks": self.minimum_audio_chunks,
                "voiced_frame_rms_threshold": self.voiced_frame_rms_threshold,
                "require_scheduler_data_plane": self.require_scheduler_data_plane}


@dataclass(frozen=True)
class Failure:
    check: str
    message: str


class AcceptanceError(AssertionError):
    """A session failed ``check``; ``stats`` holds its numbers."""

    def __init__(self, failure: Failure, stats: dict[str, Any]) -> None:
        super().__init__(f"{failure.check}: {failure.message}")
        self.check = failure.check
        self.stats = stats


def server_fed(log: PacketLog, *, input_frames: int, input_ended_at: float | None) -> tuple[int, str | None]:
    """Output frames made from silence the server fed itself, and how that was known.

    "metadata": the deltas said so (``wire.silence_fed_frames``); "timing": no delta said, so
    the frames past the input's count that arrived after the last input frame was sent
    (``metrics.frames_completed_after``); None: neither is known (no send time given)."""
    if log.reported_silence_frames is not None:
        return log.reported_silence_frames, "metadata"
    if input_ended_at is None:
        return 0, None
    return metrics.frames_completed_after(log.arrivals, log.samples, input_frames, input_ended_at), "timing"


def session_stats(log: PacketLog, *, input_frames: int, thresholds: Thresholds,
                  input_ended_at: float | None = None) -> dict[str, Any]:
    """The session statistics of spec §7.4 (plus the data-plane report and the frames the
    server fed from its own silence, which are not answers to the input)."""
    if log.audio.voiced_rms_threshold != thresholds.voiced_frame_rms_threshold:
        raise ValueError("the packet log judged voiced frames at another RMS threshold than the acceptance's")
    fed, source = server_fed(log, input_frames=input_frames, input_ended_at=input_ended_at)
    audio = log.audio.stats(input_frames, fed)
    return {
        "audio_chunks": log.chunks,
        "audio_samples": audio["audio_samples"],
        "audio_rms": audio["audio_rms"],
        "output_frames": audio["output_frames"],
        "server_fed_frames": fed,
        "server_fed_frames_source": source,
        "voiced_frames": audio["voiced_frames"],
        "silent_frames": audio["silent_frames"],
        "frame_deficit": audio["frame_deficit"],
        "frame_coverage_ratio": audio["frame_coverage_ratio"],
        "response_ids": sorted(log.response_id_set),
        "scheduler_data_plane": log.data_plane_proven,
        "_whole_codec_frames": audio["whole_codec_frames"],
    }


def first_failure(log: PacketLog, stats: dict[str, Any], *, input_frames: int, thresholds: Thresholds,
                  minimum_chunks: int | None = None, session_id: str | None = None) -> Failure | None:
    """The first failing check of ``CHECKS``, or None."""
    minimum_chunks = thresholds.minimum_audio_chunks if minimum_chunks is None else minimum_chunks
    rms = stats["audio_rms"]
    if log.invalid:
        codes = sorted({p["code"] for p in log.invalid})
        return Failure("audio_packets", f"{len(log.invalid)} invalid audio packets: {', '.join(codes)}")
    if not log.output_samples:
        return Failure("pcm16_output", f"no PCM16 output: chunks={log.chunks}, bytes=0")
    if rms is None or not math.isfinite(rms) or rms <= MIN_AUDIO_RMS:
        return Failure("audio_rms", f"output is silent or non-finite: samples={stats['audio_samples']}, rms={rms}")
    if log.rates != {SAMPLE_RATE_HZ}:
        return Failure("sample_rate", f"output sample rates {sorted(log.rates)}, expected [{SAMPLE_RATE_HZ}]")
    if input_frames < 1:
        return Failure("input_frames", f"audio without input frames: input_frames={input_frames}")
    if not stats["_whole_codec_frames"]:
        return Failure("whole_codec_frames", f"{stats['audio_samples']} samples is not a whole number of "
                                             "1920-sample frames")
    if log.chunks < minimum_chunks:
        return Failure("audio_chunks", f"{log.chunks} audio chunks, minimum {minimum_chunks}")
    deficit = stats["frame_deficit"]
    if not 0 <= deficit <= thresholds.max_frame_deficit:
        return Failure("frame_deficit", f"input_frames={input_frames} output_frames={stats['output_frames']} "
                                        f"server_fed_frames={stats['server_fed_frames']} "
                                        f"deficit={deficit}, allowed [0, {thresholds.max_frame_deficit}]")
    if stats["voiced_frames"] < thresholds.min_voiced_frames:
        return Failure("voiced_frames", f"{stats['voiced_frames']} voiced frames (RMS >= "
                                        f"{thresholds.voiced_frame_rms_threshold}), "
                                        f"minimum {thresholds.min_voiced_frames}")
    if thresholds.require_scheduler_data_plane and not log.data_plane_proven:
        return Failure("scheduler_data_plane", "no audio delta carried metadata.vllm_omni of the scheduler data plane")
    if len(log.response_id_set) != 1:
        return Failure("response_identity", f"a continuous stream needs exactly one response id, got "
                                            f"{len(log.response_id_set)}")
    if session_id is not None and log.metadata_session_ids - {session_id}:
        return Failure("session_identity", f"{len(log.metadata_session_ids - {session_id})} other session id(s) "
                                           "in delta metadata")
    return None


def evaluate(log: PacketLog, *, input_frames: int, thresholds: Thresholds, minimum_chunks: int | None = None,
             session_id: str | None = None, input_ended_at: float | None = None
             ) -> tuple[dict[str, Any], Failure | None]:
    """Statistics (without private keys) and the first failure.  ``input_ended_at``: when the
    last input frame finished sending (lets surplus frames be told from server-fed ones)."""
    stats = session_stats(log, input_frames=input_frames, thresholds=thresholds, input_ended_at=input_ended_at)
    failure = first_failure(log, stats, input_frames=input_frames, thresholds=thresholds,
                            minimum_chunks=minimum_chunks, session_id=session_id)
    return {k: v for k, v in stats.items() if not k.startswith("_")}, failure
