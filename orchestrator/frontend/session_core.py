"""What a session is on either route: its place in the lockstep, its output queue, its epochs.

A Realtime ``Session`` (``session.py``, JSON events) and a native ``NativeSession``
(``native_session.py``, Ogg/Opus and kind bytes) are both a ``SessionCore``: the same
back-pressure on input (frames waiting for the model, bounded by ``max_pending_input_bytes``),
the same output queue (an ``Outbox`` bounded by ``max_output_buffer_bytes``: a client that
stops reading is closed, never waited for), the same epochs (a failed step or a cancel starts
a new one, and results of an old one are dropped) and the same frame size.  What differs is
only the wire: how client audio becomes PCM, and how a frame of model output and an error
become messages (``_on_frame``, ``emit_error``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import numpy as np

from engines.config import FRAME_SAMPLES

from ..engine_port import EnginePort, FrameFailure, FrameResult
from ..metrics import Metrics
from ..protocol.audio import InputStream
from ..protocol.errors import ProtocolError
from ..protocol.held_bytes import ITEM_BYTES, held_bytes
from ..settings import Settings

log = logging.getLogger(__name__)

F32_FRAME_BYTES = FRAME_SAMPLES * 4  # one frame of input as it waits for the model


# A message being sent exists three times until the transport has taken it: our text, the
# frame hypercorn's websocket layer built from it (wsproto's bytes), and the transport's copy
# of what the socket has not accepted yet.  (While the frame is built, wsproto holds two more
# copies for a moment; that is one message at a time per worker, as the event loop runs one
# send at a time: a per-worker term, docs/ORCHESTRATOR.md, "Host memory".)
IN_FLIGHT_COPIES = 3


class Outbox:
    """A session's unsent server events, bounded in bytes.

    Every message counts (``protocol.held_bytes``) from ``put`` until the transport has taken
    it: queued ones once (plus ``ITEM_BYTES``), the one being sent ``IN_FLIGHT_COPIES`` times.
    The tick never waits for a client: if this grows past ``limit`` the client is not reading,
    and the session is closed instead (``put`` returns False).  Errors and endings (``force``)
    may go past ``limit``, but only by ``limit`` again: a client that sends bad events and reads
    nothing cannot grow the queue without bound either.  ``reserve`` counts bytes that will
    become messages (PCM waiting for the Opus encoder) the same way.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0  # queued, reserved, and the one being sent (IN_FLIGHT_COPIES times)
        # (text, response id or None, arrival times of the client frames it answers, its cost)
        self._items: deque[tuple[str | bytes, str | None, tuple[float, ...], int]] = deque()
        self._sending = 0  # the cost of the message being sent (0: none)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, text: str | bytes, tag: str | None = None, force: bool = False,
            answers: tuple[float, ...] = ()) -> bool:
        cost = held_bytes(text) + ITEM_BYTES
        if not self.reserve(cost, force):
            return False
        self._items.append((text, tag, answers, cost))
        self._wake.set()
        return True

    def reserve(self, cost: int, force: bool = False) -> bool:
        """Count ``cost`` more bytes, or False (nothing counted) past the limit."""
        if self.bytes + cost > (2 * self.limit if force else self.limit):
            return False
        self.bytes += cost
        self._idle.clear()
        return True

    def release(self, cost: int) -> None:
        """Uncount what ``reserve`` counted."""
        self.bytes -= cost
        self._maybe_idle()

    async def get(self) -> tuple[str | bytes, tuple[float, ...]]:
        """The next event's text and the arrival times of the client frames it answers; it
        counts ``IN_FLIGHT_COPIES`` times until ``sent``."""
        while not self._items:
            self._wake.clear()
            await self._wake.wait()
        text, _, answers, cost = self._items.popleft()
        self._sending = cost
        self.bytes += (IN_FLIGHT_COPIES - 1) * cost
        return text, answers

    def sent(self) -> None:
        """The transport has taken the message ``get`` returned last."""
        self.bytes -= IN_FLIGHT_COPIES * self._sending
        self._sending = 0
        self._maybe_idle()

    def drop(self, tag: str) -> None:
        """Forget queued events of one response (an accepted cancel drops unsent deltas)."""
        self.bytes -= sum(item[3] for item in self._items if item[1] == tag)
        self._items = deque(item for item in self._items if item[1] != tag)
        self._maybe_idle()

    def clear(self) -> None:
        self.bytes -= sum(item[3] for item in self._items)
        self._items.clear()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self._items and self.bytes == 0:
            self._idle.set()

    async def drained(self) -> None:
        await self._idle.wait()


async def send_outbox(ws: Any, session: Any, metrics: Metrics) -> None:
    """Send a session's queued messages (either protocol's ``outbox``) in order until
    cancelled, timing the client frames each answers; a failed send means the transport is
    gone: the session is asked to stop (``transport_error``)."""
    outbox = session.outbox
    device = session.port.device or "default"
    try:
        while True:
            message, answers = await outbox.get()
            await ws.send(message)
            del message  # not held while the next one is awaited
            outbox.sent()
            if answers:  # audio: the client frames it answers have their output out
                now = time.monotonic()
                for arrival in answers:
                    metrics.observe_frame_latency(device, session.protocol, now - arrival)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the transport is gone
        log.info("session %s: send failed (%s)", session.id, exc)
        session.request_stop("transport_error")


class SessionCore:
    """One session's state shared by both routes.  Subclasses set ``protocol`` and write the
    wire: ``emit_error`` (always sent, even past the output limit) and ``_on_frame`` (one
    frame of model output with the arrival times of the client frames it answers); they may
    add ``_failed`` (a step failed) and ``_closing`` (the session stops producing)."""

    protocol = ""

    def __init__(self, session_id: str, *, port: EnginePort, settings: Settings, metrics: Metrics) -> None:
        self.id = session_id
        self.state = "open"  # "closing" once the session stops producing (begin_close)
        self.epoch = 0
        self.outbox = Outbox(settings.max_output_buffer_bytes)
        self.stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # result: close reason
        self._port = port
        self._settings = settings
        self._metrics = metrics
        self._max_pending_frames = max(1, settings.max_pending_input_bytes // F32_FRAME_BYTES)
        # Arrival (monotonic) of each client frame handed to the engine and not yet
        # answered, oldest first: the start of personaplex_frame_latency_seconds.
        self._arrivals: deque[float] = deque()

    @property
    def port(self) -> EnginePort:
        """The port of the engine this session lives on (for its whole life)."""
        return self._port

    def request_stop(self, reason: str) -> None:
        if not self.stop.done():
            self.stop.set_result(reason)

    def emit_error(self, error: ProtocolError) -> None:
        raise NotImplementedError

    # Output -----------------------------------------------------------------------------------
    def _queue(self, message: Any, tag: str | None = None, force: bool = False,
               answers: tuple[float, ...] = ()) -> None:
        """Queue one message; past the output limit the session is closed (``_overflow``)."""
        if not self.outbox.put(message, tag, force, answers):
            self._overflow()

    def _overflow(self) -> None:
        """The client stopped reading: close this session only, with a clear reason."""
        if self.stop.done():
            return
        limit = self.outbox.limit
        self.outbox.clear()
        self.emit_error(ProtocolError("output_backpressure", f"the client is not reading: more than {limit} bytes "
                                      "of server messages are waiting; closing the session"))
        self.request_stop("output_backpressure")

    # Input ------------------------------------------------------------------------------------
    def _input_fits(self, stream: InputStream, samples: int) -> bool:
        """Whether ``samples`` more of ``stream`` keep the frames waiting for the model within
        ``max_pending_input_bytes``."""
        return self._port.pending(self.id) + stream.frames_after(samples) <= self._max_pending_frames

    def _backpressure(self, dropped: bool = False) -> ProtocolError:
        """``dropped``: the audio was dropped (the native route), not refused."""
        return ProtocolError("input_backpressure", f"more than {self._settings.max_pending_input_bytes} bytes of "
                             "input are waiting for the model; "
                             + ("audio dropped (send in real time)" if dropped else "send in real time"), param="audio")

    def _push_input(self, stream: InputStream, samples: np.ndarray) -> None:
        """Hand the whole frames ``samples`` completes to the engine (the rest waits in
        ``stream``)."""
        frames = stream.push(samples)
        if len(frames):
            self._arrivals.extend([time.monotonic()] * len(frames))
            self._port.push(self.id, self.epoch, frames)

    def _new_epoch(self) -> None:
        """Start a new epoch: the engine drops the frames not yet stepped, and later
        results of the old epoch are dropped here."""
        self.epoch += 1
        self._arrivals.clear()
        self._port.restart(self.id, self.epoch)

    # Model output -----------------------------------------------------------------------------
    def on_result(self, result: FrameResult | FrameFailure) -> None:
        if self.state != "open" or result.epoch != self.epoch or self.stop.done():
            # Late output of a cancelled epoch, or of a session already told to stop (its
            # messages would be dropped).
            self._metrics.inc("frames_dropped")
            return
        if isinstance(result, FrameFailure):
            self._on_failure(result)
            return
        answers = (self._arrivals.popleft(),) if not result.silence_input and self._arrivals else ()
        self._on_frame(result, answers)

    def _on_frame(self, result: FrameResult, answers: tuple[float, ...]) -> None:
        raise NotImplementedError

    def _on_failure(self, failure: FrameFailure) -> None:
        self.emit_error(ProtocolError("engine_error", failure.message))
        self._failed()
        if failure.fatal:
            self.request_stop("engine_error")
            return
        # A failed step may leave the slot's context half-updated: a fresh epoch (the
        # engine has already queued its restart; this call then changes nothing).
        self._new_epoch()

    def _failed(self) -> None:
        """A step of this session failed (its error is already queued)."""

    # Closing ----------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """Stop producing; later frames of any epoch are dropped.  Once."""
        if self.state != "open":
            return
        self.state = "closing"
        self._closing()

    def _closing(self) -> None:
        """The session has just stopped producing."""
