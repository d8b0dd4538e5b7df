"""Opus work of a front-end worker's native sessions, off its event loop.

Threads of each worker run every Ogg/Opus encode and decode of that worker's ``/api/chat``
sessions (``protocol/ogg_opus.py``): ``opus_encode_threads`` encode the model's frames (each
stream stays on one of them, its frames in order), one decodes the clients' audio, so that
client audio never queues behind a tick's worth of encoding (an input frame that arrives late
misses its tick).  Work is asked for from the event loop and gathered there until the loop's
current pass ends (``call_soon``): a tick's output frames, handed to the sessions in one go,
become one job per encoding thread, and client audio that arrived in the same pass another.
A thread takes every job queued when it wakes and hands all their results back in one loop
callback, where each result goes to the callback it was asked with.

With the ``libopus`` codec every encode and decode runs without the interpreter lock, so the
encoding threads work in parallel, on cores the event loop does not need, and the loop waits
only for the page framing around each packet (docs/PERFORMANCE.md, "Opus off the interpreter
lock").  With ``sphn`` (the fallback) each encode holds the lock, the worker's encodes run one
at a time whatever the threads, and the worker's switch interval is kept short while native
sessions run (``Services.codec``).

sphn 0.1 decodes on a thread of its own per stream: ``feed`` only queues the bytes, so the
PCM comes later.  Decoders with packets still in flight are polled every ``POLL_S`` (a cheap
non-blocking read) until their packets are out, or until ``STALE_S`` passes without progress
(a stream whose packets sphn skips, such as a second OpusTags).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..os_threads import name_os_thread
from ..metrics import Metrics
from ..protocol.audio import AudioError
from ..protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder

log = logging.getLogger(__name__)

POLL_S = 0.001  # how often decoders with packets in flight are read (sphn 0.1)
STALE_S = 0.25  # a decoder that hands nothing back for this long is no longer polled

Done = Callable[[Any], None]  # runs on the event loop with the result (or the exception)
Job = Callable[[], list[tuple[Done, Any]]]


class _JobThread:
    """One thread running batches of jobs, results handed back to the loop in one callback
    per batch; ``idle`` (if given) runs after each batch and every ``idle_s()`` seconds while
    that is not None."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, hand_back: Callable[[list], None],
                 idle: Job | None = None, idle_s: Callable[[], float | None] = lambda: None,
                 spent: Callable[[float], None] = lambda seconds: None) -> None:
        """``spent`` gets the thread's own CPU time of each batch (on this thread)."""
        self._loop = loop
        self._spent = spent
        self._hand_back = hand_back
        self._idle = idle
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._jobs: list[Job] = []  # guarded by _cond
        self._stopping = False
        self._name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                return  # serving has stopped: nobody waits for results any more
            self._jobs.append(job)
            self._cond.notify()

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        name_os_thread(self._name)  # top -H tells the Opus work from the event loop's
        while True:
            with self._cond:
                if not self._jobs and not self._stopping:
                    self._cond.wait(self._idle_s())
                if self._stopping:
                    return
                jobs, self._jobs = self._jobs, []
            started = time.thread_time()
            results: list[tuple[Done, Any]] = []
            for job in jobs:
                try:
                    results.extend(job())
                except Exception:  # noqa: BLE001 - a job's own errors go to its callbacks
                    log.exception("an Opus job failed")
            # The jobs hold their streams: let go now, not at this thread's next wake (a
            # closed session's encoder and its libopus state go with it).
            jobs = job = None  # type: ignore[assignment]
            if self._idle is not None:
                results.extend(self._idle())
            self._spent(time.thread_time() - started)
            if results:
                try:
                    self._loop.call_soon_threadsafe(self._hand_back, results)
                except RuntimeError:  # the loop has closed: serving is over
                    return
            results = None  # type: ignore[assignment]  # (its callbacks hold their sessions)


class CodecThreads:
    """A worker's Opus threads, and the streams they code (``new_encoder``, ``new_decoder``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, codec: str, encode_threads: int = 1,
                 metrics: Metrics | None = None) -> None:
        self._loop = loop
        self.codec = codec
        self._metrics = metrics
        # Gathered on the loop until its pass ends (loop thread only): per encoding thread.
        self._encodes: list[list[tuple[OggOpusEncoder, np.ndarray, Done]]] = [[] for _ in range(encode_threads)]
        self._decodes: list[tuple[OggOpusDecoder, bytes, Done, Done | None]] = []
        self._encoding = 0  # frames asked for and not yet handed back (loop thread only)
        # Which encoding thread each stream's frames go to: the one with the fewest streams
        # when the stream starts (a stream's count goes when its encoder does).
        self._lane_of: weakref.WeakKeyDictionary[OggOpusEncoder, int] = weakref.WeakKeyDictionary()
        self._lane_streams = [0] * encode_threads
        # Decoders whose packets sphn 0.1 is still decoding (decoding thread only):
        # decoder -> (its callback, when it last handed something back).
        self._in_flight: dict[OggOpusDecoder, tuple[Done, float]] = {}
        self._out = [_JobThread(loop, f"pp-opus-out{i}", self._hand_back_encoded,
                                spent=lambda s: self._spent("encode", s)) for i in range(encode_threads)]
        self._in = _JobThread(loop, "pp-opus-in", self._hand_back, idle=self._poll_in_flight,
                              idle_s=lambda: POLL_S if self._in_flight else None,
                              spent=lambda s: self._spent("decode", s))

    def new_encoder(self) -> OggOpusEncoder:
        return OggOpusEncoder(codec=self.codec)

    def new_decoder(self, max_ahead_s: float | None = None) -> OggOpusDecoder:
        return OggOpusDecoder(max_ahead_s=max_ahead_s, codec=self.codec)

    # Asked for on the event loop -------------------------------------------------------------
    def encode(self, encoder: OggOpusEncoder, pcm: np.ndarray, done: Done) -> None:
        """Encode one frame (int16 or float32 [1920]); ``done`` gets the list of pages (or the
        exception).  Frames of one stream are encoded in the order asked."""
        lane = self._lane_of.get(encoder)
        if lane is None:
            lane = self._lane_of[encoder] = self._lane_streams.index(min(self._lane_streams))
            self._lane_streams[lane] += 1
            weakref.finalize(encoder, self._stream_ended, lane)
        if not any(self._encodes):
            self._loop.call_soon(self._submit_encodes)
        self._encodes[lane].append((encoder, pcm, done))
        self._encoding += 1

    def decode(self, decoder: OggOpusDecoder, data: bytes, done: Done, taken: Done | None = None) -> None:
        """Feed ``data`` to ``decoder``; ``done`` gets each piece of PCM as it is decoded
        (possibly several calls) or the ``AudioError`` that ends the stream; ``taken`` (if
        given) gets ``len(data)`` once the decoder has taken the bytes (what a session counts
        as waiting for the decoding thread)."""
        if not self._decodes:
            self._loop.call_soon(self._submit_decodes)
        self._decodes.append((decoder, data, done, taken))

    def close(self, decoder: OggOpusDecoder) -> None:
        """The session is over: stop polling ``decoder`` and end sphn 0.1's decoding thread."""
        def job() -> list[tuple[Done, Any]]:
            self._in_flight.pop(decoder, None)
            decoder.close()
            return []
        self._in.submit(job)

    def stop(self, timeout: float = 5.0) -> None:
        for thread in self._out:
            thread.stop(timeout)
        self._in.stop(timeout)

    def _submit_encodes(self) -> None:
        for thread, batch in zip(self._out, self._encodes):
            if batch:
                thread.submit(lambda batch=batch: [(done, _encoded(encoder, pcm)) for encoder, pcm, done in batch])
        self._encodes = [[] for _ in self._out]

    def _stream_ended(self, lane: int) -> None:
        self._lane_streams[lane] -= 1  # one item's arithmetic: atomic under the interpreter lock

    def _hand_back_encoded(self, results: list[tuple[Done, Any]]) -> None:
        self._encoding -= len(results)
        if self._metrics is not None:
            self._metrics.opus_queue(self._encoding)
        self._hand_back(results)

    def _spent(self, direction: str, seconds: float) -> None:
        """An Opus thread's CPU time of one batch (on that thread: the counter is thread-safe)."""
        if self._metrics is not None:
            self._metrics.observe_opus(direction, seconds)

    def _submit_decodes(self) -> None:
        batch, self._decodes = self._decodes, []

        def job() -> list[tuple[Done, Any]]:
            results = []
            for decoder, data, done, taken in batch:
                result = self._feed(decoder, data, done)
                if result is not None:
                    results.append(result)
                if taken is not None:
                    results.append((taken, len(data)))
            return results

        self._in.submit(job)

    @staticmethod
    def _hand_back(results: list[tuple[Done, Any]]) -> None:
        for done, value in results:
            try:
                done(value)
            except Exception:  # noqa: BLE001 - one session's failure must not lose the others' results
                log.exception("a native session failed to take its Opus result")

    # On the decoding thread ------------------------------------------------------------------
    def _feed(self, decoder: OggOpusDecoder, data: bytes, done: Done) -> tuple[Done, Any] | None:
        """Feed one chunk; the result to hand back, if there is one yet.  Whatever goes wrong
        is this stream's alone: it ends as ``bad_audio`` (sphn raises its own errors once its
        decoding thread has stopped) and the other streams of the batch go on."""
        try:
            pcm: Any = decoder.feed(data)
        except Exception as exc:  # noqa: BLE001
            self._in_flight.pop(decoder, None)
            return done, _stream_error(exc)
        if decoder.waiting:
            since = self._in_flight[decoder][1] if decoder in self._in_flight else time.monotonic()
            self._in_flight[decoder] = (done, since if not len(pcm) else time.monotonic())
        return (done, pcm) if len(pcm) else None

    def _poll_in_flight(self) -> list[tuple[Done, Any]]:
        results: list[tuple[Done, Any]] = []
        now = time.monotonic()
        for decoder, (done, since) in list(self._in_flight.items()):
            try:
                pcm: Any = decoder.poll()
            except Exception as exc:  # noqa: BLE001 - as in _feed
                pcm = _stream_error(exc)
            if len(pcm) if isinstance(pcm, np.ndarray) else True:
                results.append((done, pcm))
                since = now
            if isinstance(pcm, AudioError) or not decoder.waiting or now - since > STALE_S:
                del self._in_flight[decoder]
            else:
                self._in_flight[decoder] = (done, since)
        return results


def _stream_error(exc: Exception) -> AudioError:
    """What ends a stream: its own ``AudioError``, or ``bad_audio`` for anything sphn raised."""
    if isinstance(exc, AudioError):
        return exc
    log.debug("decoding a stream failed: %r", exc)
    return AudioError("bad_audio", "input audio could not be decoded")


def _encoded(encoder: OggOpusEncoder, pcm: np.ndarray) -> list[bytes] | Exception:
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    try:
        return encoder.encode(pcm)
    except Exception as exc:  # noqa: BLE001 - one stream's failure is that stream's
        return exc
