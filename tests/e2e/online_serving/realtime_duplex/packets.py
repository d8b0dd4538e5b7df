"""From a recorded event stream to the audio packet log that metrics and acceptance read.

Every audio delta (GA or legacy name) is validated on its own (``wire.audio_packet_pcm``);
an invalid one is kept as ``{event_index, received_at_s, code}`` and contributes no audio.
Arrival times are the client's, never a timestamp supplied by the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import wire


@dataclass
class PacketLog:
    arrivals: list[float] = field(default_factory=list)  # non-empty valid packets only
    samples: list[int] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)  # per non-empty valid packet
    pcm16: bytearray = field(default_factory=bytearray)
    invalid: list[dict[str, Any]] = field(default_factory=list)
    audio_events: int = 0  # every audio delta seen, valid or not, empty or not
    rates: set[int] = field(default_factory=set)  # integer sample_rate_hz of every audio delta
    first_text_at: float | None = None
    data_plane_proven: bool = False
    metadata_session_ids: set[str] = field(default_factory=set)

    @property
    def chunks(self) -> int:
        """Non-empty valid audio packets."""
        return len(self.arrivals)

    @property
    def output_samples(self) -> int:
        return sum(self.samples)

    @property
    def response_id_set(self) -> set[str]:
        return set(self.response_ids)

    def timeline(self) -> list[dict[str, Any]]:
        return [{"received_at_s": t, "samples": n, "response_id": r}
                for t, n, r in zip(self.arrivals, self.samples, self.response_ids)]


def packet_log(events: Sequence[Mapping[str, Any]], received_at: Sequence[float],
               upto: int | None = None) -> PacketLog:
    """The packet log of ``events[:upto]`` (``upto`` excludes what arrived during cleanup)."""
    log = PacketLog()
    end = len(events) if upto is None else min(upto, len(events))
    for index in range(end):
        event, at = events[index], received_at[index]
        if log.first_text_at is None and wire.visible_text(event):
            log.first_text_at = at
            continue
        if not wire.is_audio_delta(event):
            continue
        log.audio_events += 1
        rate = event.get("sample_rate_hz")
        if isinstance(rate, int) and not isinstance(rate, bool):
            log.rates.add(rate)
        if wire.proves_scheduler_data_plane(event):
            log.data_plane_proven = True
        owner = wire.metadata_session_id(event)
        if owner is not None:
            log.metadata_session_ids.add(owner)
        try:
            pcm = wire.audio_packet_pcm(event)
        except wire.InvalidAudioPacket as exc:
            log.invalid.append({"event_index": index, "received_at_s": at, "code": exc.code})
            continue
        if pcm:
            log.arrivals.append(at)
            log.samples.append(len(pcm) // wire.PCM16_BYTES)
            log.response_ids.append(str(event["response_id"]))
            log.pcm16 += pcm
    return log
