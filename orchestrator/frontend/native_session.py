"""One open ``/api/chat`` session on the event loop: client Ogg/Opus in, model frames out as
Ogg/Opus pages and text pieces (spec/native-protocol.md).

A ``SessionCore`` like a Realtime ``Session`` (``session_core.py``: input back-pressure, the
output queue, epochs; ``services.sessions``: the ticks' results, stalls and the drain reach it
the same way) with the native wire instead of JSON events.  Opus work goes to the worker's
``CodecThreads``; its results come back on the loop, in the order asked, so a stream's pages
leave in frame order.  Never awaits.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from engines.config import FRAME_RATE, SAMPLE_RATE

from ..engine_port import EnginePort, FrameResult
from ..metrics import Metrics
from ..protocol import native
from ..protocol.audio import AudioError, InputStream
from ..protocol.errors import ProtocolError, new_error_id, withheld
from ..protocol.held_bytes import ITEM_BYTES
from ..settings import Settings
from .codec_threads import CodecThreads
from .session_core import F32_FRAME_BYTES, SessionCore

log = logging.getLogger(__name__)

PROTOCOL = "native"
_REPORT_EVERY_S = 1.0  # repeated input errors (backpressure) are reported at most this often


class NativeSession(SessionCore):
    protocol = PROTOCOL

    def __init__(self, session_id: str, *, port: EnginePort, settings: Settings, metrics: Metrics,
                 codec: CodecThreads) -> None:
        super().__init__(session_id, port=port, settings=settings, metrics=metrics)
        self._codec = codec
        self._encoder = codec.new_encoder()
        # Client audio may run ahead of real time by as much as the Realtime route lets queue.
        self._decoder = codec.new_decoder(max_ahead_s=settings.max_pending_input_bytes / F32_FRAME_BYTES / FRAME_RATE)
        self._input = InputStream(SAMPLE_RATE)
        # Per frame at the encoder, in order: the arrivals its pages answer ("arrival" =
        # decoded, here) and what its PCM counts in the outbox until its pages are back.
        self._encoding: deque[tuple[tuple[float, ...], int]] = deque()
        # Client bytes handed to the decoding thread and not yet taken by the decoder: at most
        # one message past max_native_message_bytes (docs/ORCHESTRATOR.md, "Host memory").
        self._decoding = 0
        self._last_report = float("-inf")

    # Sending ----------------------------------------------------------------------------------
    def send_handshake(self) -> None:
        self._put(native.HANDSHAKE_MESSAGE)

    def emit_error(self, error: ProtocolError) -> None:
        """Kind 0x05: ``code: message`` (NVIDIA's client shows nothing of it; other clients may)."""
        self._metrics.inc("errors", error.code)
        self._queue(native.error_message(f"{error.code}: {error.message}"), force=True)

    def _put(self, message: bytes, answers: tuple[float, ...] = ()) -> None:
        if not self.stop.done():
            self._queue(message, answers=answers)

    # Client audio -----------------------------------------------------------------------------
    def feed(self, pages: bytes) -> None:
        """Ogg/Opus bytes of a ``0x01`` message, any chunking."""
        if self.stop.done():
            return
        if self._decoding and self._decoding + len(pages) > self._settings.max_native_message_bytes:
            # The decoding thread is that far behind this client: the bytes cannot wait
            # without bound, and skipping them would cut the stream mid-page.
            self.emit_error(ProtocolError("input_backpressure", f"more than {self._settings.max_native_message_bytes} "
                                          "bytes of audio are waiting to be decoded"))
            self.request_stop("input_backpressure")
            return
        self._decoding += len(pages)
        self._codec.decode(self._decoder, pages, self._on_pcm, self._taken)

    def _taken(self, n: int) -> None:
        self._decoding -= n

    def _on_pcm(self, pcm: np.ndarray | AudioError) -> None:
        if self.state != "open" or self.stop.done():
            return
        if isinstance(pcm, AudioError):
            # bad_audio: the Ogg stream cannot be resynchronised, the rest of the call would go
            # unheard; input_backpressure: skipping audio would cut the stream mid-page.
            log.info("session %s: %s", self.id, pcm)
            self.emit_error(ProtocolError(pcm.code, str(pcm)))
            self.request_stop(pcm.code)
            return
        if not self._input_fits(self._input, len(pcm)):
            # The client cannot be told in time to slow down (it streams pages): the audio is
            # dropped, and said so at most once a second.
            self._report(self._backpressure(dropped=True))
            return
        self._push_input(self._input, pcm)

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
    def _on_frame(self, result: FrameResult, answers: tuple[float, ...]) -> None:
        if result.text:  # "" for the padding tokens, which the reference does not send either
            self._put(native.text_message(result.text))
        cost = result.pcm16.nbytes + ITEM_BYTES  # held until its pages are back
        if not self.outbox.reserve(cost):
            self._overflow()
            return
        self._encoding.append((answers, cost))
        self._codec.encode(self._encoder, result.pcm16, self._on_pages)

    def _on_pages(self, pages: list[bytes] | Exception) -> None:
        answers, cost = self._encoding.popleft()
        self.outbox.release(cost)
        if isinstance(pages, Exception):
            error_id = new_error_id()
            log.error("session %s: Opus encoding failed [%s]: %s", self.id, error_id, pages)
            self.emit_error(ProtocolError("engine_error", withheld("encoding the model's audio failed", error_id)))
            self.request_stop("engine_error")
            return
        for i, page in enumerate(pages):  # one page per message, as NVIDIA's server sends them
            self._put(native.audio_message(page), answers if i == len(pages) - 1 else ())

    # Closing ----------------------------------------------------------------------------------
    def _closing(self) -> None:
        """Stop taking audio; the decoder's thread ends."""
        self._codec.close(self._decoder)
