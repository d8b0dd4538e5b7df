"""Ogg/Opus streams of the native ``/api/chat`` protocol (spec/native-protocol.md).

Out: one 1920-sample frame (80 ms at 24 kHz) in, the Ogg pages it completes out (the stream's
OpusHead and OpusTags pages come with the first frame).  In: any chunking of a client's Ogg
stream in, the PCM decoded so far out.

Two codecs do the work:
- ``libopus`` (``protocol/libopus.py``, the default wherever the library loads): our own Ogg
  pages (``protocol/ogg.py``) around libopus packets; each encode and decode runs without the
  interpreter lock.  The stream is laid out as sphn 0.1's writer lays it out (what NVIDIA's
  server sends): serial 42, an OpusHead with a pre-skip of 3840 and an input rate of 24 kHz,
  one 80 ms packet per page, granule positions counting 1920 per frame.  Incoming audio is
  decoded packet by packet, all of it (no pre-skip trimmed, as sphn's reader does).
- ``sphn`` (the fallback where libopus does not load; it holds the interpreter lock while it
  encodes).  sphn changed these classes between 0.1 and 0.2, and both are in use (NVIDIA's
  server pins 0.1):
  - 0.1: ``OpusStreamWriter.append_pcm`` returns None and ``read_bytes`` hands back one page
    per call; ``OpusStreamReader`` decodes on a thread of its own (without the interpreter
    lock), so ``read_pcm`` gives, one packet per call, what that thread has finished, and
    None once the thread has stopped (the end of the stream, or bytes it could not parse).
  - 0.2: ``append_pcm`` returns the pages; ``append_bytes`` decodes at once and returns the
    PCM, raising ``ValueError`` on bytes that are not Ogg/Opus.
The classes below give one behaviour over all three.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable

import numpy as np

from engines.config import FRAME_SAMPLES, SAMPLE_RATE

from . import libopus
from .audio import AudioError
from .ogg import OggWriter, ogg_crc

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.float32)
_CAPTURE = b"OggS"
_HEADER_BYTES = 27  # up to and including the segment count
_HEADER_PACKETS = 2  # OpusHead, OpusTags


# Frame duration of each Opus TOC configuration in units of 2.5 ms (RFC 6716 section 3.1):
# SILK 10/20/40/60 ms, hybrid 10/20 ms, CELT 2.5/5/10/20 ms.
_CONFIG_QUARTER_MS = (4, 8, 16, 24) * 3 + (4, 8) * 2 + (1, 2, 4, 8) * 4
_OPUS_HEADERS = (b"OpusHead", b"OpusTags")
MAX_PAGE_BYTES = _HEADER_BYTES + 255 + 255 * 255

# The outgoing stream's constants, as sphn 0.1's writer has them (module docstring).
STREAM_SERIAL = 42
_PRE_SKIP = 3840
_VENDOR = b"personaplex-serve"
CODECS = ("libopus", "sphn")


def default_codec() -> str:
    """``libopus`` where the library loads, else ``sphn``."""
    return "libopus" if libopus.available() else "sphn"


def opus_packet_samples(packet: bytes, rate: int = SAMPLE_RATE) -> int:
    """Samples at ``rate`` that one Opus packet decodes to, from its TOC byte (and frame
    count byte); 0 for an empty or truncated one."""
    if not packet:
        return 0
    toc = packet[0]
    code = toc & 3
    if code == 0:
        count = 1
    elif code in (1, 2):
        count = 2
    elif len(packet) > 1:
        count = packet[1] & 0x3F
    else:
        return 0
    return _CONFIG_QUARTER_MS[toc >> 3] * count * rate // 400


class OggPages:
    """The pages of an Ogg/Opus stream as it arrives in chunks: each must start with the
    capture pattern (sphn 0.1 silently skips bytes up to the next page while 0.2 refuses
    them; checking here gives one answer, a typed error, on both).  Each page is held until
    whole (at most ``MAX_PAGE_BYTES``), then its packets are counted (``packets``: those whose
    last byte has arrived, headers included) and their audio reckoned from their TOC bytes
    (``samples`` at 24 kHz, headers excluded), before the reader is given them: what a
    stream will decode to is known before it is decoded."""

    def __init__(self, keep_packets: bool = False) -> None:
        """``keep_packets``: also check each page's CRC and keep its whole packets in
        ``packets_ready`` (for a decoder that takes packets, not bytes)."""
        self._keep = keep_packets
        self.packets_ready: list[bytes] = []
        self._page = bytearray()  # the page being received
        self._need = _HEADER_BYTES  # its length, once known; until then the header's
        self._continued = b""  # the start of a packet that goes on past its page
        self.packets = 0
        self.samples = 0

    def check(self, data: bytes) -> list[int]:
        """Follow ``data``; returns the offsets in it just past each page that ends there."""
        ends: list[int] = []
        at = 0
        while at < len(data):
            take = min(self._need - len(self._page), len(data) - at)
            self._page += data[at:at + take]
            at += take
            if not self._page[:4].startswith(_CAPTURE[:len(self._page)]):
                raise AudioError("bad_audio", "a page does not begin with OggS")
            if len(self._page) < self._need:
                break
            if self._need == _HEADER_BYTES:
                self._need += self._page[26]
                continue
            if self._need == _HEADER_BYTES + self._page[26]:
                body = sum(self._page[_HEADER_BYTES:self._need])
                if body:
                    self._need += body
                    continue
            self._count(bytes(self._page))
            ends.append(at)
            self._page = bytearray()
            self._need = _HEADER_BYTES
        return ends

    def _count(self, page: bytes) -> None:
        if self._keep and ogg_crc(page[:22] + bytes(4) + page[26:]) != int.from_bytes(page[22:26], "little"):
            raise AudioError("bad_audio", "an Ogg page's checksum does not match its bytes")
        segments = page[26]
        lacing = page[_HEADER_BYTES:_HEADER_BYTES + segments]
        start = _HEADER_BYTES + segments
        size = 0
        for value in lacing:
            size += value
            if value < 255:  # a packet ends here
                self._packet(self._continued + page[start:start + size])
                self._continued = b""
                start, size = start + size, 0
        if size:  # goes on on the next page: keep its start (its TOC bytes), or all of it
            self._continued += page[start:start + size]
            if not self._keep:
                self._continued = self._continued[:2]
            elif len(self._continued) > libopus.MAX_PACKET_BYTES * 4:  # Opus packets are far smaller
                raise AudioError("bad_audio", "an Opus packet runs on past any size Opus allows")

    def _packet(self, packet: bytes) -> None:
        if not packet:
            # Opus packets are at least one byte (RFC 6716, section 3.4, R1); a decoder takes an
            # empty one as a lost packet and conceals it at whatever length it is asked for:
            # pages of them would be minutes of audio charged nothing against the budget.
            raise AudioError("bad_audio", "an empty Opus packet (a packet is at least one byte)")
        if self._keep:
            self.packets_ready.append(packet)
        self.packets += 1
        if not packet.startswith(_OPUS_HEADERS):
            self.samples += opus_packet_samples(packet)


def split_pages(data: bytes) -> list[bytes]:
    """Whole Ogg pages, one bytes each (sphn 0.2 hands a frame's pages back joined)."""
    pages = []
    at = 0
    while at < len(data):
        segments = data[at + 26]
        end = at + _HEADER_BYTES + segments + sum(data[at + _HEADER_BYTES: at + _HEADER_BYTES + segments])
        pages.append(data[at:end])
        at = end
    return pages


class OggOpusEncoder:
    """One outgoing Ogg/Opus stream, mono 24 kHz, one Opus packet and one page per frame.
    ``codec``: ``libopus`` or ``sphn`` (default: ``default_codec()``)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE, codec: str | None = None) -> None:
        self.codec = codec or default_codec()
        if self.codec == "libopus":
            self._opus = libopus.OpusEncoder(sample_rate)
            self._ogg = OggWriter(STREAM_SERIAL)
            self._frames = 0
            return
        if self.codec != "sphn":
            raise ValueError(f"unknown Opus codec {codec!r} (one of {', '.join(CODECS)})")
        import sphn

        self._writer = sphn.OpusStreamWriter(sample_rate)
        self._pulls_pages = hasattr(self._writer, "read_bytes")  # sphn 0.1

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """The pages completed by one frame of float32 samples in [-1, 1], one bytes per page
        (the first frame's list starts with the OpusHead and OpusTags pages)."""
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        if pcm.shape != (FRAME_SAMPLES,):
            raise ValueError(f"an Opus frame here is {FRAME_SAMPLES} samples, got shape {pcm.shape}")
        if self.codec == "libopus":
            return self._encode_libopus(pcm)
        pages = self._writer.append_pcm(pcm)
        if not self._pulls_pages:
            return split_pages(bytes(pages))
        chunks = []
        while page := self._writer.read_bytes():
            chunks.append(page)
        return chunks

    def _encode_libopus(self, pcm: np.ndarray) -> list[bytes]:
        packet = self._opus.encode(pcm)  # the interpreter lock is released in here
        pages = []
        if self._frames == 0:
            head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, _PRE_SKIP, SAMPLE_RATE, 0, 0)
            tags = b"OpusTags" + struct.pack("<I", len(_VENDOR)) + _VENDOR + struct.pack("<I", 0)
            pages = [self._ogg.page(head, 0), self._ogg.page(tags, 0)]
        self._frames += 1
        pages.append(self._ogg.page(packet, self._frames * FRAME_SAMPLES))
        return pages


class OggOpusDecoder:
    """One incoming Ogg/Opus stream.  ``feed`` takes any chunk of it and returns the PCM ready
    so far; with sphn 0.1 more may become ready a moment later (``poll``; ``waiting`` says how
    many packets are still being decoded).  Bytes that are not an Ogg/Opus stream, or a
    packet Opus cannot decode, raise ``AudioError("bad_audio")``, then and on every later
    call: the stream cannot be resynchronised."""

    def __init__(self, sample_rate: int = SAMPLE_RATE, max_ahead_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, codec: str | None = None) -> None:
        """``max_ahead_s``: how far the audio fed may run ahead of real time (None: no
        limit).  A stream's audio is a budget that fills at one second per second up to
        ``max_ahead_s``; each page spends its duration (read from its packets' TOC bytes,
        before decoding: a few bytes of Opus can stand for a second of audio); a page over
        budget is refused with ``AudioError("input_backpressure")`` and the stream ends.
        ``codec``: ``libopus`` or ``sphn`` (default: ``default_codec()``)."""
        self.codec = codec or default_codec()
        self._broken: str | None = None
        self._pages = OggPages(keep_packets=self.codec == "libopus")
        if self.codec == "libopus":
            self._opus = libopus.OpusDecoder(sample_rate)
            self._decodes_aside = False
        elif self.codec == "sphn":
            import sphn

            self._reader = sphn.OpusStreamReader(sample_rate)
            self._decodes_aside = hasattr(self._reader, "read_pcm")  # sphn 0.1: a decoding thread
        else:
            raise ValueError(f"unknown Opus codec {codec!r} (one of {', '.join(CODECS)})")
        self._decoded = 0  # audio packets handed back (sphn 0.1)
        self._packets_taken = 0  # packets decoded or skipped, headers included (libopus)
        self._max_ahead_s = max_ahead_s
        self._clock = clock
        self._budget_s = max_ahead_s or 0.0
        self._budget_at = clock()

    @property
    def waiting(self) -> int:
        """Audio packets fed whole and not yet handed back: sphn 0.1's thread is still on
        them (always 0 with 0.2, which decodes in ``feed``).  The stream's first two packets
        are its OpusHead and OpusTags, which decode to nothing."""
        if not self._decodes_aside or self._broken is not None:
            return 0
        return max(0, self._pages.packets - _HEADER_PACKETS - self._decoded)

    def feed(self, data: bytes) -> np.ndarray:
        self._check()
        before = self._pages.samples
        try:
            ends = self._pages.check(data)
        except AudioError as exc:
            self._fail(str(exc))
        self._spend((self._pages.samples - before) / SAMPLE_RATE)
        if self.codec == "libopus":
            return self._decode_packets()
        if not self._decodes_aside:
            # sphn 0.2 decodes a chunk into a buffer of its own size (~5 s of audio): a chunk
            # holding more fails, so it gets one page at a time.
            pieces = [data[a:b] for a, b in zip([0, *ends], [*ends, len(data)]) if b > a]
            try:
                out = [np.asarray(self._reader.append_bytes(piece), dtype=np.float32) for piece in pieces]
            except ValueError as exc:  # sphn's message is the library's: the log has it, the client ours
                log.debug("sphn refused a page: %s", exc)
                self._fail("the Ogg/Opus stream could not be decoded")
            return np.concatenate(out) if len(out) > 1 else out[0] if out else _EMPTY
        self._reader.append_bytes(data)
        return self.poll()

    def _decode_packets(self) -> np.ndarray:
        """Decode the whole packets received (libopus): the first must be an OpusHead, the
        second the OpusTags; header packets after those (a chained stream) decode to nothing,
        and no packet decodes to more than its TOC bytes say (what the stream's budget was
        charged; empty packets never get here: ``OggPages``).  A packet that fails ends the
        stream; the PCM before it is handed back first, and the next call raises (as with
        sphn 0.1)."""
        packets, self._pages.packets_ready = self._pages.packets_ready, []
        out = []
        for packet in packets:
            self._packets_taken += 1
            if self._packets_taken <= _HEADER_PACKETS:
                header = _OPUS_HEADERS[self._packets_taken - 1]
                if not packet.startswith(header):
                    self._fail(f"packet {self._packets_taken} of the stream is not its {header.decode()}")
                continue
            if packet.startswith(_OPUS_HEADERS):
                continue
            try:
                out.append(self._opus.decode(packet, opus_packet_samples(packet)))  # the interpreter lock is released in here
            except AudioError as exc:
                if not out:
                    self._fail(str(exc))
                self._broken = str(exc)
                break
        return np.concatenate(out) if len(out) > 1 else out[0] if out else _EMPTY

    def poll(self) -> np.ndarray:
        """PCM decoded since the last call (sphn 0.1's decoding thread); empty otherwise."""
        self._check()
        if not self._decodes_aside:
            return _EMPTY
        chunks = []
        while True:
            try:
                pcm = self._reader.read_pcm()
            except Exception as exc:  # noqa: BLE001 - sphn's own error type: Opus refused a packet
                log.debug("sphn could not decode a packet: %s", exc)
                pcm = None
                why = "an Opus packet could not be decoded"
            else:
                why = "the Ogg/Opus stream could not be decoded"
            if pcm is None:  # the decoding thread stopped: it could not parse the stream
                if chunks:  # hand over what came before; the next call raises
                    self._broken = why
                    break
                self._fail(why)
            if pcm.shape[-1] == 0:
                break
            chunks.append(pcm)
        self._decoded += len(chunks)
        if not chunks:
            return _EMPTY
        return np.concatenate(chunks).astype(np.float32, copy=False)

    def close(self) -> None:
        """Stop sphn 0.1's decoding thread (the others have none)."""
        close = getattr(getattr(self, "_reader", None), "close", None)
        if close is not None:
            close()

    def _spend(self, seconds: float) -> None:
        if self._max_ahead_s is None or not seconds:
            return
        now = self._clock()
        self._budget_s = min(self._max_ahead_s, self._budget_s + now - self._budget_at) - seconds
        self._budget_at = now
        if self._budget_s < 0:
            self._broken = "input_backpressure"
            raise AudioError("input_backpressure", f"the audio sent runs more than {self._max_ahead_s:g} s ahead of "
                             "real time")

    def _check(self) -> None:
        if self._broken == "input_backpressure":
            raise AudioError("input_backpressure", "this stream was ended: its audio ran ahead of real time")
        if self._broken is not None:
            raise AudioError("bad_audio", f"input audio is not Ogg/Opus: {self._broken}")

    def _fail(self, why: str) -> None:
        self._broken = why
        self._check()
