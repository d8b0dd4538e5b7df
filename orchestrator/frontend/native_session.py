"""One open ``/api/chat`` session on the event loop: client Ogg/Opus in, model frames out as
Ogg/Opus pages and text pieces (spec/native-protocol.md).

The same place in the server as a Realtime ``Session`` (``services.sessions``: the ticks'
results, stalls and the drain reach it the same way) with the native wire instead of JSON
events.  Opus work goes to the worker's ``CodecThread``; its results come back on the loop,
in the order asked, so a stream's pages leave in frame order.  Never awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import numpy as np

from engines.config import FRAME_RATE, FRAME_SAMPLES, SAMPLE_RATE

from ..lockstep.scheduler import FrameFailure, FrameResult, TickScheduler
from ..metrics import Metrics
from ..protocol import native
from ..protocol.audio import AudioError, InputStream
from ..protocol.errors import ProtocolError
from ..protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder
from ..settings import Settings
from .codec_thread import CodecThread
from .session import Outbox

log = logging.getLogger(__name__)

PROTOCOL = "native"
_F32_FRAME_BYTES = FRAME_SAMPLES * 4
_REPORT_EVERY_S = 1.0  # repeated input errors (backpressure) are reported at most this often


class NativeSession:
    def __init__(self, session_id: str, *, scheduler: TickScheduler, settings: Settings, metrics: Metrics,
                 codec: CodecThread) -> None:
        self.id = session_id
        self.epoch = 0
        self.outbox = Outbox(settings.max_output_buffer_bytes)
        self.stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # result: close reason
        self._open = True
        self._scheduler = scheduler
        self._settings = settings
        self._metrics = metrics
        self._codec = codec
        self._encoder = OggOpusEncoder()
        # Client audio may run ahead of real time by as much as the Realtime route lets queue.
        self._decoder = OggOpusDecoder(max_ahead_s=settings.max_pending_input_bytes / _F32_FRAME_BYTES / FRAME_RATE)
        self._input = InputStream(SAMPLE_RATE)
        self._max_pending_frames = max(1, settings.max_pending_input_bytes // _F32_FRAME_BYTES)
        # Arrival (monotonic) of each client frame handed to the scheduler and not yet
        # answered (personaplex_frame_latency_seconds; "arrival" = decoded, here).
        self._arrivals: deque[float] = deque()
        # Per frame at the encoder, in order: the arrivals its pages answer.
        self._encoding: deque[tuple[float, ...]] = deque()
        self._last_report = float("-inf")

    @property
    def scheduler(self) -> TickScheduler:
        return self._scheduler

    # Sending ----------------------------------------------------------------------------------
    def send_handshake(self) -> None:
        self._put(native.HANDSHAKE_MESSAGE)

    def emit_error(self, error: ProtocolError) -> None:
        """Kind 0x05: ``code: message`` (NVIDIA's client shows nothing of it; other clients may)."""
        self._metrics.inc("errors", error.code)
        if not self.outbox.put(native.error_message(f"{error.code}: {error.message}"), force=True):
            self._overflow()

    def request_stop(self, reason: str) -> None:
        if not self.stop.done():
            self.stop.set_result(reason)

    def _put(self, message: bytes, answers: tuple[float, ...] = ()) -> None:
        if self.stop.done():
            return
        if not self.outbox.put(message, answers=answers):
            self._overflow()

    def _overflow(self) -> None:
        """The client stopped reading: close this session only."""
        if self.stop.done():
            return
        self.outbox.clear()
        self.emit_error(ProtocolError("output_backpressure", f"the client is not reading: more than "
                                      f"{self.outbox.limit} bytes are waiting; closing the session"))
        self.request_stop("output_backpressure")

    # Client audio -----------------------------------------------------------------------------
    def feed(self, pages: bytes) -> None:
        """Ogg/Opus bytes of a ``0x01`` message, any chunking."""
        self._codec.decode(self._decoder, pages, self._on_pcm)

    def _on_pcm(self, pcm: np.ndarray | AudioError) -> None:
        if not self._open or self.stop.done():
            return
        if isinstance(pcm, AudioError):
            # bad_audio: the Ogg stream cannot be resynchronised, the rest of the call would go
            # unheard; input_backpressure: skipping audio would cut the stream mid-page.
            log.info("session %s: %s", self.id, pcm)
            self.emit_error(ProtocolError(pcm.code, str(pcm)))
            self.request_stop(pcm.code)
            return
        if self._scheduler.pending(self.id) + self._input.frames_after(len(pcm)) > self._max_pending_frames:
            self._report(ProtocolError("input_backpressure", f"more than {self._settings.max_pending_input_bytes} "
                                       "bytes of input are waiting for the model; audio dropped (send in real time)"))
            return
        frames = self._input.push(pcm)
        if len(frames):
            self._arrivals.extend([time.monotonic()] * len(frames))
            self._scheduler.push(self.id, self.epoch, frames)

    def _report(self, error: ProtocolError) -> None:
        """An error the client may cause many times a second: counted each time, sent at most
        once a second."""
        now = time.monotonic()
        if now - self._last_report < _REPORT_EVERY_S:
            self._metrics.inc("errors", error.code)
            return
        self._last_report = now
        self.emit_error(error)

    # Model output -----------------------------------------------------------------------------
    def on_result(self, result: FrameResult | FrameFailure) -> None:
        if not self._open or result.epoch != self.epoch or self.stop.done():
            self._metrics.inc("frames_dropped")
            return
        if isinstance(result, FrameFailure):
            self._on_failure(result)
            return
        if result.text:  # "" for the padding tokens, which the reference does not send either
            self._put(native.text_message(result.text))
        answers = (self._arrivals.popleft(),) if not result.silence_input and self._arrivals else ()
        self._encoding.append(answers)
        self._codec.encode(self._encoder, result.pcm16, self._on_pages)

    def _on_pages(self, pages: list[bytes] | Exception) -> None:
        answers = self._encoding.popleft()
        if isinstance(pages, Exception):
            log.error("session %s: Opus encoding failed: %s", self.id, pages)
            self.emit_error(ProtocolError("engine_error", "encoding the model's audio failed"))
            self.request_stop("engine_error")
            return
        for i, page in enumerate(pages):  # one page per message, as NVIDIA's server sends them
            self._put(native.audio_message(page), answers if i == len(pages) - 1 else ())

    def _on_failure(self, failure: FrameFailure) -> None:
        self.emit_error(ProtocolError("engine_error", failure.message))
        if failure.fatal:
            self.request_stop("engine_error")
            return
        # A failed step may leave the slot's context half-updated: the scheduler restarts
        # it; frames of the old epoch are dropped (as on the Realtime route).
        self.epoch += 1
        self._arrivals.clear()
        self._scheduler.restart(self.id, self.epoch)

    # Closing ----------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """Stop taking audio and producing output; the decoder's thread ends."""
        if not self._open:
            return
        self._open = False
        self._codec.close(self._decoder)
