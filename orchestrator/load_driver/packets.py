"""From server events to the audio packet log that metrics and acceptance read.

``PacketLog.add`` takes one event as it arrives and updates the log in constant time: the
driver never re-reads its event history, so its cost per event stays flat over a 3000-frame
stream.  Every audio delta (GA or legacy name) is validated on its own
(``wire.audio_packet_pcm``); an invalid one is kept as ``{event_index, received_at_s, code}``
and contributes no audio.  Arrival times are the client's, never a timestamp from the server.

The audio itself is reduced as it arrives (``AudioTally``: sample count, sum of squares, RMS
of each whole 1920-sample frame), so a load session holds no PCM; the lifecycle mode, which
writes the output WAV, asks to keep it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from . import wire


class AudioTally:
    """Running statistics of a PCM16 stream, fed packet by packet.

    Voiced frames are judged on whole 1920-sample frames of the concatenated stream (a packet
    boundary need not fall on a frame boundary), exactly as if the whole output were split
    into frames at the end."""

    def __init__(self, voiced_rms_threshold: float, *, keep_pcm: bool = False) -> None:
        self.voiced_rms_threshold = voiced_rms_threshold
        self.samples = 0
        self.sum_squares = 0.0
        self.whole_frames = 0
        self.voiced_frames = 0
        self._partial = np.zeros(0, dtype=np.float64)  # samples after the last whole frame
        self.pcm16: bytearray | None = bytearray() if keep_pcm else None

    def add(self, pcm: bytes) -> None:
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0
        if self.pcm16 is not None:
            self.pcm16 += pcm
        self.samples += audio.size
        self.sum_squares += float(np.dot(audio, audio))
        if self._partial.size:
            audio = np.concatenate([self._partial, audio])
        whole = audio.size // wire.FRAME_SAMPLES
        if whole:
            frames = audio[: whole * wire.FRAME_SAMPLES].reshape(whole, wire.FRAME_SAMPLES)
            rms = np.sqrt(np.mean(frames * frames, axis=1))
            self.voiced_frames += int(np.count_nonzero(rms >= self.voiced_rms_threshold))
            self.whole_frames += whole
        self._partial = audio[whole * wire.FRAME_SAMPLES:].copy()

    @property
    def rms(self) -> float | None:
        return float(np.sqrt(self.sum_squares / self.samples)) if self.samples else None

    def stats(self, input_frames: int, server_fed_frames: int = 0) -> dict[str, object]:
        """Sample, frame and loudness statistics.  ``frame_deficit`` is input frames minus the
        whole output frames that answer them (output made from server-fed silence after the
        input ended is not an answer, so it is not counted against the deficit)."""
        answered = self.whole_frames - server_fed_frames
        return {
            "audio_samples": self.samples,
            "audio_rms": self.rms,
            "output_frames": self.whole_frames,
            "voiced_frames": self.voiced_frames,
            "silent_frames": self.whole_frames - self.voiced_frames,
            "frame_deficit": input_frames - answered,
            "frame_coverage_ratio": (answered / input_frames) if input_frames > 0 else None,
            "whole_codec_frames": self.samples % wire.FRAME_SAMPLES == 0,
        }


@dataclass
class PacketLog:
    voiced_rms_threshold: float = 1e-3
    keep_pcm: bool = False
    arrivals: list[float] = field(default_factory=list)  # non-empty valid packets only
    samples: list[int] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)  # per non-empty valid packet
    invalid: list[dict[str, Any]] = field(default_factory=list)
    audio_events: int = 0  # every audio delta seen, valid or not, empty or not
    rates: set[int] = field(default_factory=set)  # integer sample_rate_hz of every audio delta
    first_text_at: float | None = None
    data_plane_proven: bool = False
    metadata_session_ids: set[str] = field(default_factory=set)
    # Frames the server says it made from its own silence (None: no packet said either way).
    reported_silence_frames: int | None = None
    events: int = 0  # events seen (the next event's index)
    audio: AudioTally = field(init=False)

    def __post_init__(self) -> None:
        self.audio = AudioTally(self.voiced_rms_threshold, keep_pcm=self.keep_pcm)

    @property
    def chunks(self) -> int:
        """Non-empty valid audio packets."""
        return len(self.arrivals)

    @property
    def output_samples(self) -> int:
        return self.audio.samples

    @property
    def response_id_set(self) -> set[str]:
        return set(self.response_ids)

    @property
    def pcm16(self) -> bytes:
        """The concatenated output (only with ``keep_pcm``)."""
        if self.audio.pcm16 is None:
            raise RuntimeError("this packet log does not keep its PCM (keep_pcm=False)")
        return bytes(self.audio.pcm16)

    def add(self, event: Mapping[str, Any], at: float) -> None:
        """Take the next event (received at ``at`` on the client's clock)."""
        index = self.events
        self.events += 1
        if self.first_text_at is None and wire.visible_text(event):
            self.first_text_at = at
            return
        if not wire.is_audio_delta(event):
            return
        self.audio_events += 1
        rate = event.get("sample_rate_hz")
        if isinstance(rate, int) and not isinstance(rate, bool):
            self.rates.add(rate)
        if wire.proves_scheduler_data_plane(event):
            self.data_plane_proven = True
        owner = wire.metadata_session_id(event)
        if owner is not None:
            self.metadata_session_ids.add(owner)
        try:
            pcm = wire.audio_packet_pcm(event)
        except wire.InvalidAudioPacket as exc:
            self.invalid.append({"event_index": index, "received_at_s": at, "code": exc.code})
            return
        if not pcm:
            return
        samples = len(pcm) // wire.PCM16_BYTES
        silence = wire.silence_fed_frames(event, samples // wire.FRAME_SAMPLES)
        if silence is not None:
            self.reported_silence_frames = (self.reported_silence_frames or 0) + silence
        self.arrivals.append(at)
        self.samples.append(samples)
        self.response_ids.append(str(event["response_id"]))
        self.audio.add(pcm)

    def add_packet(self, at: float, samples: int, response_id: str, rate: int) -> None:
        """A valid non-empty audio packet whose PCM is tallied later (``audio.add``): the
        native protocol's Opus pages, counted from their TOC bytes on arrival."""
        self.audio_events += 1
        self.rates.add(rate)
        self.arrivals.append(at)
        self.samples.append(samples)
        self.response_ids.append(response_id)

    def timeline(self) -> list[dict[str, Any]]:
        return [{"received_at_s": t, "samples": n, "response_id": r}
                for t, n, r in zip(self.arrivals, self.samples, self.response_ids)]


def packet_log(events: Sequence[Mapping[str, Any]], received_at: Sequence[float], upto: int | None = None, *,
               voiced_rms_threshold: float = 1e-3, keep_pcm: bool = True) -> PacketLog:
    """The packet log of ``events[:upto]`` (``upto`` excludes what arrived during cleanup)."""
    log = PacketLog(voiced_rms_threshold, keep_pcm)
    end = len(events) if upto is None else min(upto, len(events))
    for index in range(end):
        log.add(events[index], received_at[index])
    return log
