"""One ``/api/chat`` websocket for the load driver (``--protocol native``): the Realtime
probe's transport and record, with the native protocol's binary messages.

On arrival, in constant time: ``0x00`` marks the handshake; each ``0x01`` Ogg page of audio
adds its packets' samples (from their TOC bytes) to the packet timeline at its arrival time,
and its bytes to the stream; ``0x02`` text marks the first text; ``0x05`` is recorded as an
error event with the code before its colon.  Anything else (text frames, unknown kinds,
kinds only clients send, an audio message that is not one whole Ogg page) is a violation.

The Opus stream is decoded once, after the measured window (``settle``, on a thread: the
other sessions' last packets must not wait for it), and its PCM goes through the same tally
(RMS, voiced frames) as Realtime audio, so the same acceptance checks hold for both protocols.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from orchestrator.protocol.ogg_opus import OggOpusDecoder

from . import native_wire
from .probe import RealtimeProbe
from .wire import FRAME_SAMPLES, SAMPLE_RATE_HZ

HANDSHAKE, AUDIO, TEXT, ERROR = 0, 1, 2, 5
SERVER_KINDS = frozenset({HANDSHAKE, AUDIO, TEXT, 4, ERROR, 6})  # 3 (control) is the client's
DECODE_WAIT_S = 10.0  # sphn 0.1 decodes on a thread of its own: how long to wait for it


class NativeProbe(RealtimeProbe):
    def __init__(self, url: str, *, label: str, **kwargs: Any) -> None:
        super().__init__(url, label=label, **kwargs)
        self.handshake_at: float | None = None
        self._stream = bytearray()  # the Ogg/Opus bytes received within the window
        self._decoded = False

    async def wait_handshake(self, timeout_s: float) -> None:
        await self.wait_for(lambda: self.handshake_at is not None, timeout_s, "handshake")

    def _record(self, message: str | bytes, at: float) -> None:
        index = self.event_count
        if not isinstance(message, bytes) or not message or message[0] not in SERVER_KINDS:
            self._violation("not_a_native_message", index, at)
            return
        self.event_count += 1
        kind, payload = message[0], message[1:]
        if kind == HANDSHAKE:
            self.handshake_at = self.handshake_at or at
        elif kind == AUDIO:
            self._audio(payload, at, index)
        elif kind == TEXT:
            if self.packets.first_text_at is None and payload.strip():
                self.packets.first_text_at = at
        elif kind == ERROR:
            code = payload.decode("utf-8", "replace").split(":", 1)[0].strip() or "unknown"
            event = {"type": "error", "error": {"code": code}}
            self.error_events.append(event)
            self.counts["error"] += 1
        self._wake.set()

    def _audio(self, page: bytes, at: float, index: int) -> None:
        packets = native_wire.page_packets(page)
        if packets is None:
            self.packets.invalid.append({"event_index": index, "received_at_s": at, "code": "not_one_ogg_page"})
            return
        if self.packets_frozen:
            return
        self._stream += page
        samples = sum(native_wire.opus_packet_samples(p) for p in packets
                      if not p.startswith(native_wire.OPUS_HEADER_MAGICS))
        if samples:
            self.packets.add_packet(at, samples, self.label, SAMPLE_RATE_HZ)

    @property
    def output_frames(self) -> int:
        return sum(self.packets.samples) // FRAME_SAMPLES

    async def settle(self) -> None:
        """Decode the window's audio (once) into the tally the acceptance checks read."""
        if self._decoded:
            return
        self._decoded = True
        expected = sum(self.packets.samples)
        pcm = await asyncio.to_thread(_decode, bytes(self._stream), expected)
        if pcm is None or len(pcm) != expected:
            self.packets.invalid.append({"event_index": self.event_count, "received_at_s": self.clock(),
                                         "code": "opus_stream_does_not_decode_to_its_packets"})
            return
        self.packets.audio.add(np.clip(np.rint(pcm * 32768.0), -32768, 32767).astype("<i2").tobytes())


def _decode(stream: bytes, expected: int) -> np.ndarray | None:
    """All PCM of an Ogg/Opus stream (None if it does not decode)."""
    if not stream:
        return np.zeros(0, dtype=np.float32)
    decoder = OggOpusDecoder()
    try:
        chunks = [decoder.feed(stream)]
        deadline = time.monotonic() + DECODE_WAIT_S
        while decoder.waiting and time.monotonic() < deadline:
            time.sleep(0.002)
            chunks.append(decoder.poll())
    except ValueError:  # AudioError
        return None
    finally:
        decoder.close()
    return np.concatenate(chunks) if chunks else None
