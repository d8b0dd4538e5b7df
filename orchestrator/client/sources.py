"""Where the client's 80 ms frames come from (a WAV file, the microphone) and where the
model's audio goes live (the speakers).  The microphone and speakers need the optional
``sounddevice`` package; without it only files work."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import soxr

from engines.audio_io import frames_of, read_audio
from engines.config import FRAME_PERIOD_S as FRAME_S
from engines.config import FRAME_SAMPLES, SAMPLE_RATE
from engines.errors import AudioInputError

from ..protocol.audio import InputStream

class SourceError(Exception):
    """The input cannot be used (unreadable file, no sound device); the message says why."""


def load_sounddevice() -> Any:
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: the package is there, PortAudio is not
        raise SourceError("the microphone needs the 'sounddevice' package and PortAudio "
                          f"(pip install sounddevice): {exc}") from None
    return sounddevice


class WavSource:
    """A WAV file (any rate, first channel) as whole 24 kHz frames, plus ``tail_s`` of silence
    so the model can finish what it is saying after the file ends."""

    def __init__(self, path: Path, tail_s: float) -> None:
        try:
            pcm = read_audio(path)
        except AudioInputError as exc:
            raise SourceError(str(exc)) from None
        tail = np.zeros(round(tail_s / FRAME_S) * FRAME_SAMPLES, dtype=np.float32)
        self.frames = frames_of(np.concatenate((pcm, tail)))

    async def stream(self, stop: asyncio.Event, *, realtime: bool) -> AsyncIterator[np.ndarray]:
        """The frames; ``realtime`` paces them on an 80 ms grid like a microphone would.

        The grid is absolute, so sleep overshoot never accumulates; a send that falls more
        than a frame behind restarts the grid rather than bursting to catch up (a burst
        would hide the stall from the server)."""
        loop = asyncio.get_running_loop()
        start, offset = loop.time(), 0
        for index, frame in enumerate(self.frames):
            if stop.is_set():
                return
            if realtime:
                due = start + (index - offset) * FRAME_S
                now = loop.time()
                if now - due > FRAME_S:
                    start, offset = now, index
                elif due > now:
                    await asyncio.sleep(due - now)
            yield frame


class MicSource:
    """The default microphone, resampled to 24 kHz and cut into frames, until ``stop``."""

    def __init__(self) -> None:
        self._sd = load_sounddevice()
        try:
            self.rate = int(self._sd.query_devices(kind="input")["default_samplerate"])
        except Exception as exc:  # noqa: BLE001 - PortAudio errors are plain exceptions
            raise SourceError(f"no usable microphone: {exc}") from None

    async def stream(self, stop: asyncio.Event, *, realtime: bool = True) -> AsyncIterator[np.ndarray]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[np.ndarray] = asyncio.Queue()
        framer = InputStream(self.rate)

        def captured(indata: np.ndarray, _frames: int, _time: Any, _status: Any) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, indata[:, 0].copy())

        try:
            device = self._sd.InputStream(samplerate=self.rate, channels=1, dtype="float32", callback=captured)
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"cannot open the microphone: {exc}") from None
        with device:
            while not stop.is_set():
                getter = asyncio.ensure_future(chunks.get())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait((getter, stopper), return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not getter.done():
                    getter.cancel()
                    return
                for frame in framer.push(getter.result()):
                    yield frame


class Speaker:
    """Plays the model's 24 kHz PCM16 on the default output device as it arrives."""

    PREBUFFER_S = 0.12  # a small jitter buffer: start (and restart after running dry) at this

    def __init__(self) -> None:
        sd = load_sounddevice()
        try:
            self.rate = int(sd.query_devices(kind="output")["default_samplerate"])
            self._stream = sd.OutputStream(samplerate=self.rate, channels=1, dtype="float32", callback=self._fill)
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"cannot open the speakers: {exc}") from None
        self._resampler = None if self.rate == SAMPLE_RATE else soxr.ResampleStream(SAMPLE_RATE, self.rate, 1,
                                                                                     dtype="float32")
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._queued = 0
        self._playing = False
        self._lock = threading.Lock()
        self._stream.start()

    def play(self, pcm16: np.ndarray) -> None:
        samples = pcm16.astype(np.float32) / 32768.0
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        with self._lock:
            self._queue.append(samples)
            self._queued += len(samples)

    def _fill(self, outdata: np.ndarray, frames: int, _time: Any, _status: Any) -> None:
        out = outdata[:, 0]
        out[:] = 0.0
        with self._lock:
            if not self._playing and self._queued < self.PREBUFFER_S * self.rate:
                return
            self._playing = True
            filled = 0
            while filled < frames and self._queue:
                chunk = self._queue[0]
                n = min(frames - filled, len(chunk))
                out[filled:filled + n] = chunk[:n]
                filled += n
                self._queued -= n
                if n == len(chunk):
                    self._queue.popleft()
                else:
                    self._queue[0] = chunk[n:]
            if filled < frames:
                self._playing = False  # ran dry: prebuffer again

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()
