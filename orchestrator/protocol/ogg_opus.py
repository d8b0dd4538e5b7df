"""Ogg/Opus streams of the native ``/api/chat`` protocol (spec/native-protocol.md), on ``sphn``.

Out: one 1920-sample frame (80 ms at 24 kHz) in, the Ogg pages it completes out (the stream's
OpusHead and OpusTags pages come with the first frame).  In: any chunking of a client's Ogg
stream in, the PCM decoded so far out.

``sphn`` changed these classes between 0.1 and 0.2, and both are in use (NVIDIA's server
pins 0.1):
- 0.1: ``OpusStreamWriter.append_pcm`` returns None and ``read_bytes`` hands back one page
  per call; ``OpusStreamReader`` decodes on a thread of its own (without the interpreter
  lock), so ``read_pcm`` gives, one packet per call, what that thread has finished, and
  None once the thread has stopped (the end of the stream, or bytes it could not parse).
- 0.2: ``append_pcm`` returns the pages; ``append_bytes`` decodes at once and returns the
  PCM, raising ``ValueError`` on bytes that are not Ogg/Opus.
The classes below give one behaviour over both.

Cost per stream (2026-12-02, sphn 0.1.12, 500 frames; neither sphn version releases the
interpreter lock while encoding):
- the H200 machine's host CPU (Xeon, idle), a sine plus noise: encoding 1.12 ms per 80 ms
  frame, decoding 0.13 ms per 80 ms (on sphn 0.1's own thread);
- this project's 2-core CPU machine, idle, a sine: encoding ~0.42 ms; with the test suite
  running beside it, 1.2-1.4 ms (speech the higher).
So encoding is the native route's main CPU cost: at 152 sessions, ~2 cores in all.
"""

from __future__ import annotations

import numpy as np

from engines.config import FRAME_SAMPLES, SAMPLE_RATE

from .audio import AudioError

_EMPTY = np.zeros(0, dtype=np.float32)
_CAPTURE = b"OggS"
_HEADER_BYTES = 27  # up to and including the segment count
_HEADER_PACKETS = 2  # OpusHead, OpusTags


class OggPages:
    """Where the pages of an Ogg stream begin, across chunks: each must start with the
    capture pattern.  sphn 0.1 silently skips bytes up to the next page while 0.2 refuses
    them; checking here gives one answer (a typed error) on both.  Also counts the packets
    whose last byte has arrived (``packets``), so that a reader decoding on a thread of its
    own (sphn 0.1) knows how many to wait for."""

    def __init__(self) -> None:
        self._head = b""  # the start of a page header not yet complete
        self._skip = 0  # bytes of the current page still to come after its header
        self._ending = 0  # packets that end on the current page (counted once its body is in)
        self.packets = 0

    def check(self, data: bytes) -> list[int]:
        """Follow ``data``; returns the offsets in it just past each page that ends there."""
        ends: list[int] = []
        view = memoryview(data)
        while len(view):
            if self._skip:
                step = min(self._skip, len(view))
                self._skip -= step
                view = view[step:]
                if not self._skip:
                    self.packets += self._ending
                    ends.append(len(data) - len(view))
                continue
            need = _HEADER_BYTES - len(self._head) if len(self._head) < _HEADER_BYTES else 0
            if need:
                self._head += bytes(view[:need])
                view = view[need:]
                if not _CAPTURE.startswith(self._head[:4]):
                    raise AudioError("bad_audio", "a page does not begin with OggS")
                if len(self._head) < _HEADER_BYTES:
                    return ends
            segments = self._head[26]
            table = bytes(view[: _HEADER_BYTES + segments - len(self._head)])
            self._head += table
            view = view[len(table):]
            if len(self._head) < _HEADER_BYTES + segments:
                return ends
            lacing = self._head[_HEADER_BYTES:]
            self._ending = sum(1 for size in lacing if size < 255)  # a lacing value < 255 ends a packet
            self._skip = sum(lacing)
            self._head = b""
            if not self._skip:
                self.packets += self._ending
                ends.append(len(data) - len(view))
        return ends


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
    """One outgoing Ogg/Opus stream, mono 24 kHz, one Opus packet and one page per frame."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        import sphn

        self._writer = sphn.OpusStreamWriter(sample_rate)
        self._pulls_pages = hasattr(self._writer, "read_bytes")  # sphn 0.1

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """The pages completed by one frame of float32 samples in [-1, 1], one bytes per page
        (the first frame's list starts with the OpusHead and OpusTags pages)."""
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        if pcm.shape != (FRAME_SAMPLES,):
            raise ValueError(f"an Opus frame here is {FRAME_SAMPLES} samples, got shape {pcm.shape}")
        pages = self._writer.append_pcm(pcm)
        if not self._pulls_pages:
            return split_pages(bytes(pages))
        chunks = []
        while page := self._writer.read_bytes():
            chunks.append(page)
        return chunks


class OggOpusDecoder:
    """One incoming Ogg/Opus stream.  ``feed`` takes any chunk of it and returns the PCM ready
    so far; with sphn 0.1 more may become ready a moment later (``poll``; ``waiting`` says how
    many packets are still being decoded).  Bytes that are not an Ogg/Opus stream, or a
    packet Opus cannot decode, raise ``AudioError("bad_audio")``, then and on every later
    call: the stream cannot be resynchronised."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        import sphn

        self._reader = sphn.OpusStreamReader(sample_rate)
        self._decodes_aside = hasattr(self._reader, "read_pcm")  # sphn 0.1: a decoding thread
        self._broken: str | None = None
        self._pages = OggPages()
        self._decoded = 0  # audio packets handed back (sphn 0.1)

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
        try:
            ends = self._pages.check(data)
        except AudioError as exc:
            self._fail(str(exc))
        if not self._decodes_aside:
            # sphn 0.2 decodes a chunk into a buffer of its own size (~5 s of audio): a chunk
            # holding more fails, so it gets one page at a time.
            pieces = [data[a:b] for a, b in zip([0, *ends], [*ends, len(data)]) if b > a]
            try:
                out = [np.asarray(self._reader.append_bytes(piece), dtype=np.float32) for piece in pieces]
            except ValueError as exc:
                self._fail(str(exc))
            return np.concatenate(out) if len(out) > 1 else out[0] if out else _EMPTY
        self._reader.append_bytes(data)
        return self.poll()

    def poll(self) -> np.ndarray:
        """PCM decoded since the last call (sphn 0.1's decoding thread); empty with 0.2."""
        self._check()
        if not self._decodes_aside:
            return _EMPTY
        chunks = []
        while True:
            try:
                pcm = self._reader.read_pcm()
            except Exception as exc:  # noqa: BLE001 - sphn's own error type: Opus refused a packet
                pcm = None
                why = f"an Opus packet could not be decoded ({str(exc)[:200]})"
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
        """Stop sphn 0.1's decoding thread (0.2 has none)."""
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()

    def _check(self) -> None:
        if self._broken is not None:
            raise AudioError("bad_audio", f"input audio is not Ogg/Opus: {self._broken}")

    def _fail(self, why: str) -> None:
        self._broken = why
        self._check()
