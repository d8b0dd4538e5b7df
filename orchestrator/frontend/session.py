"""One open session on the event loop: its configuration, epochs, responses and queues.

A ``Session`` turns client events into engine commands and engine frames into server
events, on the ``SessionCore`` it shares with the native route (``session_core.py``: input
back-pressure, the output queue, epochs).  It never awaits: every handler runs to completion
on the loop, so the order of events is the order of the client's messages and of the ticks.
The websocket itself is the ``Connection``'s business; a session only fills its ``Outbox``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from engines.config import FRAME_MS
from engines.interface import shown

from ..engine_port import EnginePort, FrameResult
from ..metrics import Metrics
from ..protocol import events as ev
from ..protocol import json_codec
from ..protocol.audio import AudioError, InputStream, decode_base64, pcm16_base64, to_float32
from ..protocol.client_events import CLOSE_EVENTS, client_event_id, parse_append
from ..protocol.errors import ProtocolError
from ..protocol.session_config import SessionConfig, parse_session_update, session_payload
from ..settings import Settings
from .memory_bound import max_session_object_bytes
from .session_core import SessionCore

log = logging.getLogger(__name__)

MAX_CLIENT_REASON_CHARS = 200  # of a session.close reason, echoed in session.closed
_REFUSED_RESPONSE_OPTIONS = ("instructions", "voice", "temperature", "max_output_tokens",
                             "max_response_output_tokens", "max_tokens", "tools")


@dataclass
class _Response:
    id: str
    epoch: int
    pending: list[np.ndarray] = field(default_factory=list)  # frames not yet in a delta
    pending_text: str = ""
    deltas: int = 0
    audio_ms: int = 0
    transcript: str = ""
    timing: dict[str, Any] = field(default_factory=dict)  # of the latest frame
    pending_silence: int = 0  # of the pending frames, how many answer silence the server fed
    pending_answers: list[float] = field(default_factory=list)  # arrival times of the client frames they answer


class Session(SessionCore):
    protocol = "realtime"

    def __init__(
        self,
        session_id: str,
        config: SessionConfig,
        *,
        port: EnginePort,
        settings: Settings,
        metrics: Metrics,
        caps: dict[str, Any],
    ) -> None:
        super().__init__(session_id, port=port, settings=settings, metrics=metrics)
        self.config = config
        # The reason a client gave in session.close: echoed back in session.closed's "event"
        # only.  The server's own reason (close code, log, metrics) is "client_close": a
        # client must not write the server's record.
        self.client_reason: str | None = None
        self._caps = caps
        self._input: InputStream | None = None  # created by the first append; fixes the input rate
        self._response: _Response | None = None
        self._last_item_id: str | None = None
        self._seq = 0

    # Emitting ---------------------------------------------------------------------------------
    def emit(self, payload: dict[str, Any], *, tag: str | None = None, journal: bool = True,
             force: bool = False, answers: tuple[float, ...] = ()) -> None:
        """Queue one server event (stamped with ``event_id`` and ``server_event_seq``)."""
        if self.stop.done() and not force:
            return
        event = {"type": payload["type"], "event_id": ev.new_event_id()}
        if journal:
            self._seq += 1
            event["server_event_seq"] = self._seq
        event.update(payload)
        self._queue(json_codec.dumps(event), tag, force, answers)

    def emit_error(self, error: ProtocolError, client_event_id: str | None = None) -> None:
        self._metrics.inc("errors", error.code)
        self.emit({"type": "error", "error": error.payload(client_event_id)}, force=True)

    def public(self) -> dict[str, Any]:
        return ev.session_object(session_id=self.id, state=self.state, epoch=self.epoch, config=self.config,
                                 caps=self._caps, active_response_id=self._response.id if self._response else None)

    # Client events ----------------------------------------------------------------------------
    def handle(self, event: Mapping[str, Any]) -> str | None:
        """Run one client event.  Returns a close reason if the event ends the session."""
        kind = event["type"]
        eid = client_event_id(event)
        try:
            if kind == "input_audio_buffer.append":
                self._append(event)
            elif kind in CLOSE_EVENTS:
                reason = event.get("reason")
                if isinstance(reason, str) and reason:
                    self.client_reason = reason[:MAX_CLIENT_REASON_CHARS]
                return "client_close"
            elif kind == "session.update":
                self._update(event)
            elif kind in ("response.cancel", "output_audio_buffer.clear", "input.cancel"):
                self._cancel(event, clear=kind == "output_audio_buffer.clear")
            elif kind == "input_audio_buffer.clear":
                if self._input is not None:
                    self._input.clear()
                self._arrivals.clear()
                self._port.drop_pending(self.id)
                self.emit({"type": "input_audio_buffer.cleared"})
            elif kind in ("input_audio_buffer.commit", "input.commit"):
                self._commit()
            elif kind == "session.heartbeat":
                self.emit({"type": "session.heartbeat_ack", "session_id": self.id})
            elif kind == "session.event_ack":
                seq = event.get("server_event_seq")
                if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                    raise ProtocolError("invalid_event_ack", "server_event_seq must be an integer >= 0",
                                        param="server_event_seq")
            elif kind == "response.create":
                self._response_create(event)
            elif kind in ("playback.ack", "audio.playback_ack"):
                played = event.get("played_ms")
                if isinstance(played, bool) or not isinstance(played, (int, float)) or not 0 <= played < 1e15:
                    raise ProtocolError("bad_event", "playback.ack needs a number played_ms >= 0", param="played_ms")
                self.emit({"type": "playback.acknowledged", "played_ms": played})
            elif kind == "session.resume":
                raise ProtocolError("unsupported_session_resume", "session resume is not supported")
            elif kind in ("input.text.append", "input_text.append", "push_text"):
                raise ProtocolError("native_text_append_unsupported", "this model takes audio input only")
            elif kind in ("barge_in", "turn.signal", "signal_turn"):
                raise ProtocolError("unsupported_turn_signal", "turn taking is model-native (supports_barge_in=false)")
            elif kind == "conversation.item.create":
                raise ProtocolError("text_only_turn_unsupported", "conversation items cannot be added to a duplex session")
            elif kind in ("conversation.item.retrieve", "conversation.item.delete", "conversation.item.truncate"):
                if not isinstance(event.get("item_id"), str):
                    raise ProtocolError("missing_item_id", f"{kind} needs item_id", param="item_id")
                raise ProtocolError("item_not_found", f"item {shown(event['item_id'])} not found", param="item_id")
            else:
                raise ProtocolError("unknown_event", f"Unknown duplex event type: {kind[:100]}", param="type")
        except ProtocolError as exc:
            self.emit_error(exc, eid)
        except AudioError as exc:
            self.emit_error(ProtocolError(exc.code, str(exc), param="audio"), eid)
        return None

    def _update(self, event: Mapping[str, Any]) -> None:
        self.config = parse_session_update(session_payload(event), self.config, is_open=True,
                                           input_rate_locked=self._input is not None,
                                           max_instructions_chars=self._settings.max_instructions_chars,
                                           max_session_bytes=max_session_object_bytes(self._settings))
        self.emit({"type": "session.updated", "session": self.public()})

    def _append(self, event: Mapping[str, Any]) -> None:
        request = parse_append(event)
        codec = request.codec or self.config.input_codec
        rate = request.rate or self.config.input_rate
        if self._input is not None and rate != self._input.rate:
            raise ProtocolError("bad_event", f"sample_rate_hz changed within a session ({self._input.rate} -> {rate})",
                                param="sample_rate_hz")
        samples = to_float32(decode_base64(request.audio), codec)
        stream = self._input or InputStream(rate)
        if not self._input_fits(stream, len(samples)):
            raise self._backpressure()
        self._input = stream
        self._push_input(stream, samples)

    def _commit(self) -> None:
        """Zero-pad the partial frame so it reaches the model (generic path; no turn ends)."""
        if self._input is not None:
            frame = self._input.pad_to_frame()
            if frame is not None:
                self._arrivals.append(time.monotonic())
                self._port.push(self.id, self.epoch, frame[None, :])
        self.emit({"type": "input_audio_buffer.committed", "previous_item_id": self._last_item_id, "item_id": None})

    def _response_create(self, event: Mapping[str, Any]) -> None:
        options = event.get("response")
        refused = [k for k in _REFUSED_RESPONSE_OPTIONS if isinstance(options, Mapping) and k in options]
        if refused:
            raise ProtocolError("unsupported_native_response_options",
                                f"a model-native duplex session does not take per-response {', '.join(refused)}",
                                param="response")
        if self._response is not None:
            raise ProtocolError("response_already_active", f"response {self._response.id} is already in progress: "
                                "the model responds on its own")
        # Otherwise nothing to do: the next output frame opens a response by itself.

    def _cancel(self, event: Mapping[str, Any], *, clear: bool) -> None:
        response_id = event.get("response_id")
        active = self._response
        if response_id is not None and (active is None or response_id != active.id):
            raise ProtocolError("response_not_active", f"response {shown(response_id)} is not active", param="response_id")
        if clear:
            self.emit({"type": "output_audio_buffer.cleared", "response_id": active.id if active else None})
        if active is not None:
            self.outbox.drop(active.id)
            self._end_response("cancelled", "client_cancelled")
        self._new_epoch()

    # Model output -----------------------------------------------------------------------------
    def _on_frame(self, result: FrameResult, answers: tuple[float, ...]) -> None:
        response = self._response or self._open_response()
        response.pending.append(result.pcm16)
        response.pending_silence += int(result.silence_input)
        response.pending_answers.extend(answers)
        response.pending_text += result.text
        response.timing = {"tick": result.tick, "tick_ms": round(result.tick_ms, 3), "batch_size": result.batch_size,
                           "input_wait_ms": round(result.wait_ms, 3), "silence_input": result.silence_input}
        # The first delta of a response is one frame (fastest first audio), then frames_per_delta.
        frames_wanted = 1 if response.deltas == 0 else self._settings.frames_per_delta
        if len(response.pending) >= frames_wanted:
            self._flush(response)

    def _open_response(self) -> _Response:
        response = _Response(ev.new_response_id(), self.epoch)
        self._response = response
        for payload in ev.response_opening(self.id, self.epoch, response.id, self._last_item_id,
                                           list(self.config.output_modalities)):
            self.emit(payload)
        return response

    def _flush(self, response: _Response) -> None:
        n = len(response.pending)
        pcm = response.pending[0] if n == 1 else np.concatenate(response.pending)
        text = response.pending_text
        response.pending.clear()
        response.pending_text = ""
        silence_frames, response.pending_silence = response.pending_silence, 0
        answers = tuple(response.pending_answers)
        response.pending_answers.clear()
        response.deltas += 1
        response.audio_ms += n * FRAME_MS
        response.transcript += text
        metadata = {
            "session_id": self.id,
            "epoch": self.epoch,
            "model_speak": True,
            "end_of_turn": False,
            "audio_duration_ms": response.audio_ms,
            "audio_text_marks": [{"text_chars": len(response.transcript), "audio_end_ms": response.audio_ms}],
            "playback": {"generated_ms": response.audio_ms, "sent_ms": response.audio_ms, "played_ms": 0,
                         "committed_ms": 0},
            # silence_input_frames: how many of this delta's frames answer silence the
            # server fed while the client sent nothing (load drivers do not count those
            # as answers to the client's frames).
            "timing": {**response.timing, "silence_input_frames": silence_frames},
        }
        self.emit(ev.audio_delta(response.id, pcm16_base64(pcm), metadata), tag=response.id, answers=answers)
        self.emit(ev.transcript_delta(response.id, text), tag=response.id)

    def _end_response(self, status: str, reason: str | None) -> None:
        response = self._response
        if response is None:
            return
        self._response = None
        for payload in ev.response_terminal(session_id=self.id, epoch=response.epoch, response_id=response.id,
                                            previous_item_id=self._last_item_id, status=status, reason=reason,
                                            transcript=response.transcript, audio_duration_ms=response.audio_ms):
            self.emit(payload, force=True)
        self._last_item_id = ev.item_id_for(response.id)

    def _failed(self) -> None:
        self._end_response("failed", "engine_error")

    # Closing ----------------------------------------------------------------------------------
    def _closing(self) -> None:
        """End the open response, with what the model already said."""
        if self._response is not None:
            if self._response.pending:
                self._flush(self._response)
            self._end_response("completed", None)
