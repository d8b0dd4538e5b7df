"""Opus work of a front-end worker's native sessions, off its event loop.

One thread per worker runs every Ogg/Opus encode and decode of that worker's ``/api/chat``
sessions (``protocol/ogg_opus.py``).  Jobs queue up while the thread works; each wake-up
takes all of them, so a tick's frames for every native session of the worker are one batch
and one hand-back, not one per session.  sphn holds the interpreter lock while it encodes
(0.4-1.1 ms per 80 ms frame): the loop can wait for one call plus the interpreter's switch
interval, never for a whole tick's worth of sessions in a row.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder


class CodecThread:
    def __init__(self, name: str = "personaplex-opus") -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def encode(self, frames: Sequence[tuple[OggOpusEncoder, np.ndarray]]) -> concurrent.futures.Future:
        """Encode one frame (int16 or float32 [1920]) for each (stream, frame); the future gives
        the pages of each, in order (an exception in place of a stream's pages if it failed)."""
        return self._submit(lambda: [_encoded(encoder, pcm) for encoder, pcm in frames])

    def decode(self, decoder: OggOpusDecoder, data: bytes) -> concurrent.futures.Future:
        """Feed ``data`` to ``decoder``; the future gives the PCM ready so far (or its AudioError)."""
        return self._submit(lambda: decoder.feed(data))

    def poll(self, decoder: OggOpusDecoder) -> concurrent.futures.Future:
        """PCM that sphn 0.1's own decoding thread finished since the last call."""
        return self._submit(decoder.poll)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError("the codec thread has stopped"))
                return future
            self._jobs.append((job, future))
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._jobs:
                    return
                batch, self._jobs = self._jobs, deque()
            for job, future in batch:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)


def _encoded(encoder: OggOpusEncoder, pcm: np.ndarray) -> bytes | Exception:
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    try:
        return encoder.encode(pcm)
    except Exception as exc:  # noqa: BLE001 - one stream's failure is that stream's
        return exc
