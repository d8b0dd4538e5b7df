"""A client of the native ``/api/chat`` protocol for the tests, built as NVIDIA's clients
behave: the query string describes the session, audio goes out as Ogg/Opus (sphn's writer)
only after the handshake, what comes back is read with sphn's reader."""

from __future__ import annotations

import asyncio
import struct
import time
import urllib.parse
from typing import Any

import numpy as np
import sphn
import websockets

from orchestrator.protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder

from .orch_support import _OPEN_CLIENTS, FRAME

# What NVIDIA's web client sends besides the persona and the voice (it ignores nothing).
STOCK_QUERY = {"text_temperature": "0.7", "text_topk": "25", "audio_temperature": "0.8", "audio_topk": "250",
               "pad_mult": "0", "text_seed": "42", "audio_seed": "42", "repetition_penalty_context": "64",
               "repetition_penalty": "1.0"}
GREEDY = {"text_temperature": "0", "audio_temperature": "0"}
# Pages the server writes per 80 ms frame (it runs this sphn too): 0.1 writes one 80 ms Opus
# packet, 0.2 two 40 ms packets, a page each.
PAGES_PER_FRAME = 1 if hasattr(sphn.OpusStreamWriter, "read_bytes") else 2


def chat_url(server_ws: str, **query: str) -> str:
    """``ws://HOST:PORT/api/chat?...``; keys with the value None are left out."""
    return f"{server_ws}/api/chat?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})


def ogg_page(packets: list[bytes], sequence: int, serial: int = 42) -> bytes:
    """One Ogg page holding ``packets`` (each under 255 bytes, at most 255 of them), with a
    valid CRC: for streams no encoder would write."""
    header = bytearray(b"OggS\x00\x00" + struct.pack("<qIII", 0, serial, sequence, 0) + bytes([len(packets)]))
    header += bytes(len(p) for p in packets)
    page = bytearray(header + b"".join(packets))
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    page[22:26] = struct.pack("<I", crc)
    return bytes(page)


def page_ids(page: bytes) -> tuple[int, int]:
    """(serial, sequence) of an Ogg page."""
    return struct.unpack("<II", page[14:22])


def ogg_pages(frames: np.ndarray) -> list[bytes]:
    """Real Ogg/Opus pages of float32 frames [n, 1920] (headers with the first)."""
    encoder = OggOpusEncoder()
    return [page for frame in frames for page in encoder.encode(frame)]


def ogg_per_frame(frames: np.ndarray) -> list[bytes]:
    """The Ogg/Opus bytes of each frame (the first with the stream's headers)."""
    encoder = OggOpusEncoder()
    return [b"".join(encoder.encode(frame)) for frame in frames]


def decode_ogg(stream: bytes, samples: int, wait_s: float = 10.0) -> np.ndarray:
    """All PCM of an Ogg/Opus byte stream, as the server decodes it (same library)."""
    decoder = OggOpusDecoder()
    try:
        out = [decoder.feed(stream)]
        deadline = time.monotonic() + wait_s
        while sum(len(x) for x in out) < samples and time.monotonic() < deadline:
            time.sleep(0.005)
            out.append(decoder.poll())
    finally:
        decoder.close()
    return np.concatenate(out)


class NativeClient:
    """Records every server message: ``kinds`` (in order), the audio pages, text pieces,
    error reasons, and the close."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.kinds: list[int] = []
        self.pages: list[bytes] = []
        self.texts: list[str] = []
        self.errors: list[str] = []
        self.handshake_at: float | None = None
        self.closed = False
        self.close_code: int | None = None
        self.close_reason: str | None = None

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> "NativeClient":
        kwargs.setdefault("proxy", None)
        kwargs.setdefault("max_size", 64 * 2**20)
        client = cls(await websockets.connect(url, **kwargs))
        _OPEN_CLIENTS.append(client)
        return client

    async def close(self) -> None:
        await self.ws.close()

    async def _recv(self, timeout: float) -> bool:
        """One message; False once the socket is closed."""
        try:
            message = await asyncio.wait_for(self.ws.recv(), timeout)
        except websockets.ConnectionClosed as exc:
            self.closed = True
            self.close_code = exc.rcvd.code if exc.rcvd else None
            self.close_reason = exc.rcvd.reason if exc.rcvd else None
            return False
        assert isinstance(message, bytes) and message, f"not a binary message with a kind: {message!r}"
        kind, payload = message[0], message[1:]
        assert kind <= 6, f"kind {kind}: NVIDIA's client throws on it"
        self.kinds.append(kind)
        if kind == 0:
            assert payload == b"", payload
            self.handshake_at = time.monotonic()
        elif kind == 1:
            assert payload.startswith(b"OggS"), payload[:8]
            self.pages.append(payload)
        elif kind == 2:
            self.texts.append(payload.decode("utf-8"))
        elif kind == 5:
            self.errors.append(payload.decode("utf-8"))
        return True

    async def read_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.closed and (remaining := deadline - time.monotonic()) > 0:
            try:
                if not await self._recv(remaining):
                    return
            except asyncio.TimeoutError:
                return

    async def wait_for(self, predicate: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.closed:
                raise AssertionError(f"condition not met within {timeout} s (closed={self.close_code}, "
                                     f"errors={self.errors}, kinds so far={self.kinds[:10]}...)")
            try:
                await self._recv(remaining)
            except asyncio.TimeoutError:
                pass

    async def handshake(self, timeout: float = 30.0) -> None:
        await self.wait_for(lambda: self.handshake_at is not None, timeout)
        assert self.kinds[0] == 0, self.kinds[:5]

    async def wait_closed(self, timeout: float = 20.0) -> tuple[int | None, str | None]:
        await self.wait_for(lambda: self.closed, timeout)
        return self.close_code, self.close_reason

    def audio_frames(self) -> int:
        """80 ms model frames received (the first two pages are the stream's headers)."""
        return max(0, len(self.pages) - 2) // PAGES_PER_FRAME

    def audio_stream(self) -> bytes:
        return b"".join(self.pages)

    async def send_pages(self, pages: list[bytes], *, pace_s: float = 0.0, chunk: int | None = None) -> None:
        """Send the pages as 0x01 messages: one page each, or ``chunk`` bytes each (any cut)."""
        stream = b"".join(pages)
        pieces = pages if chunk is None else [stream[i:i + chunk] for i in range(0, len(stream), chunk)]
        for piece in pieces:
            await self.ws.send(b"\x01" + piece)
            if pace_s:
                await asyncio.sleep(pace_s)
            else:
                await self.read_for(0)


async def read_until_frames(client: NativeClient, frames: int, timeout: float = 60.0) -> None:
    await client.wait_for(lambda: client.audio_frames() >= frames, timeout)


def samples_of(frames: int) -> int:
    return frames * FRAME
