"""Server -> client event payloads (the reference's names and fields).

Builders return plain dicts without ``event_id``; ``Session.emit`` stamps ids and sequence
numbers when it queues them.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from engines.config import SAMPLE_RATE

from .session_config import SessionConfig

CHUNK_PERIOD_MS = 80


# Event ids need only be unique: a random prefix per process and a counter (a uuid4 per event
# is a system call and formatting on every one of ~4,800 events a second at 128 sessions).
_EVENT_PREFIX = "event_" + uuid.uuid4().hex[:16]
_event_numbers = itertools.count()


def new_event_id() -> str:
    return f"{_EVENT_PREFIX}{next(_event_numbers):016x}"


def new_session_id() -> str:
    return "duplex-" + uuid.uuid4().hex


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def capabilities(max_sessions: int) -> dict[str, Any]:
    """The reference's PersonaPlex capability payload (identical for every session)."""
    multi = max_sessions > 1
    return {
        "implementation_level": "model_native_duplex",
        "chunk_period_ms": CHUNK_PERIOD_MS,
        "supports_session_adapter": True,
        "supports_model_native_turn_policy": True,
        "supports_external_turn_signal": False,
        "supports_client_commit": False,
        "supports_barge_in": False,
        "supports_playback_ack": True,
        "supports_input_append": True,
        "supports_replace_latest_chunk": False,
        "supports_reencode_context": False,
        "supports_rollback_to_checkpoint": False,
        "supports_turn_commit_only": False,
        "supports_kv_lease": False,
        "supports_core_kv_lease": False,
        "supports_model_internal_state": True,
        "supports_stage_resumption": True,
        "supports_scheduler_native_append": False,
        "supports_core_resumable_request": True,
        "supports_overlapped_commit": False,
        "required_input_modalities": ["audio"],
        "optional_input_modalities": ["video"],
        "supports_stage_connector_handoff": True,
        "supports_independent_io_streams": True,
        "supports_realtime_endpoint": True,
        "supports_multi_session": multi,
        "supports_multi_session_same_replica": multi,
        # Ours, not the reference's: the server's admission, so that a client (the load
        # driver's lifecycle check) knows how many sessions it may open at once.
        "max_sessions": max_sessions,
        "supports_session_lease": True,
        "supports_session_resume": False,
        "session_admission_mode": "engine_managed",
        "supports_audio_truncate": False,
        "supports_image_input": False,
        "supports_text_only_turn": False,
        "requires_model_runner_kv": True,
        "requires_native_stage_role": True,
        "adapter_patterns": ["scheduler_data_plane"],
        "input_modes": ["append_audio_chunk"],
        "signal_sources": ["model_native", "client_event"],
        "stage_handoff_transport": "scheduler_data_plane",
        "target_barge_in_latency_ms": None,
    }


def session_object(
    *,
    session_id: str,
    state: str,
    epoch: int,
    config: SessionConfig,
    caps: dict[str, Any],
    active_response_id: str | None,
) -> dict[str, Any]:
    audio = config.audio
    if audio is None:
        audio = {
            "input": {"format": {"type": _wire_codec(config.input_codec), "rate": config.input_rate},
                      "sample_rate_hz": config.input_rate},
            "output": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}, "voice": config.voice},
        }
    obj: dict[str, Any] = {
        "id": session_id,
        "object": "realtime.session",
        "type": "realtime",
        "state": state,
        "turn_state": "assistant_generating" if active_response_id else "idle",
        "epoch": epoch,
        "turn_id": 0,
        "active_request_id": None,
        "active_response_id": active_response_id,
        "active_response_turn_id": 0 if active_response_id else None,
        "model": config.model,
        "modalities": list(config.modalities),
        "output_modalities": list(config.output_modalities),
        "instructions": config.instructions,
        "voice": config.voice,
        "response_format": "pcm",
        "temperature": config.temperature,
        "max_tokens": None,
        "speed": 1.0,
        "idle_timeout_s": config.idle_timeout_s,
        "overlap_policy": "listen_only",
        "overlap_short_ack_ms": 700,
        "overlap_barge_in_ms": 1200,
        "overlap_silence_rms": 0.003,
        "playback_commit_policy": "commit_all_on_done",
        "playback": {"generated_ms": 0, "sent_ms": 0, "played_ms": 0, "committed_ms": 0},
        "capabilities": caps,
        "input_audio_format": config.input_codec,
        "output_audio_format": config.output_codec,
        "sample_rate_hz": config.input_rate,
        "turn_detection": config.turn_detection,
        "audio": audio,
    }
    for key, value in config.echoed.items():
        obj.setdefault(key, value)
    return obj


def _wire_codec(codec: str) -> str:
    return {"pcm16": "audio/pcm", "pcm_f32le": "audio/pcm_f32le",
            "g711_ulaw": "audio/g711_ulaw", "g711_alaw": "audio/g711_alaw"}[codec]


# Response lifecycle ---------------------------------------------------------------------------

def item_id_for(response_id: str) -> str:
    return "item_" + response_id


def _item(response_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id_for(response_id), "object": "realtime.item", "type": "message", "role": "assistant",
            "status": status, "content": content}


def response_opening(session_id: str, epoch: int, response_id: str, previous_item_id: str | None,
                     modalities: list[str]) -> list[dict[str, Any]]:
    """response.created, item added/created, output item added, content part added, speak."""
    item = _item(response_id, "in_progress", [])
    item_id = item["id"]
    ref = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}
    return [
        {"type": "response.created", "response_id": response_id, "response": {
            "id": response_id, "object": "realtime.response", "status": "in_progress", "status_details": None,
            "output": [], "modalities": modalities,
            "metadata": {"duplex_event": {"type": "response.created", "session_id": session_id,
                                          "response_id": response_id, "epoch": epoch, "modalities": modalities}}}},
        {"type": "conversation.item.added", "previous_item_id": previous_item_id, "item": item},
        {"type": "conversation.item.created", "previous_item_id": previous_item_id, "item": item},
        {"type": "response.output_item.added", "response_id": response_id, "output_index": 0, "item": item},
        {"type": "response.content_part.added", **ref, "part": {"type": "audio", "transcript": ""}},
        {"type": "response.speak", **ref, "metadata": {"session_id": session_id, "epoch": epoch, "model_speak": True}},
    ]


def response_terminal(
    *,
    session_id: str,
    epoch: int,
    response_id: str,
    previous_item_id: str | None,
    status: str,
    reason: str | None,
    transcript: str,
    audio_duration_ms: int,
) -> list[dict[str, Any]]:
    """The terminal sequence of a response (reference 4.4, without the optional clear event)."""
    item_status = "completed" if status == "completed" else "incomplete"
    item = _item(response_id, item_status, [{"type": "output_audio", "transcript": transcript,
                                             "audio_duration_ms": audio_duration_ms}])
    ref = {"response_id": response_id, "item_id": item["id"], "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [{"type": "response.output_audio.done", **ref}]
    if transcript:
        events.append({"type": "response.output_audio_transcript.done", **ref, "transcript": transcript})
    details = None if status == "completed" else {"type": status, "reason": reason}
    events += [
        {"type": "response.content_part.done", **ref, "part": {"type": "audio", "transcript": transcript}},
        {"type": "response.output_item.done", "response_id": response_id, "output_index": 0, "item": item},
        {"type": "conversation.item.done", "previous_item_id": previous_item_id, "item": item},
        {"type": "response.done", "response_id": response_id, "response": {
            "id": response_id, "object": "realtime.response", "status": status, "status_details": details,
            "output": [item], "metadata": {"session_id": session_id, "epoch": epoch}}},
        {"type": "rate_limits.updated", "rate_limits": []},
    ]
    return events


def audio_delta(response_id: str, delta_b64: str, metadata: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.output_audio.delta", "response_id": response_id, "item_id": item_id_for(response_id),
            "output_index": 0, "content_index": 0, "delta": delta_b64, "format": "pcm16",
            "sample_rate_hz": SAMPLE_RATE, "metadata": metadata}


def transcript_delta(response_id: str, text: str) -> dict[str, Any]:
    return {"type": "response.output_audio_transcript.delta", "response_id": response_id,
            "item_id": item_id_for(response_id), "output_index": 0, "content_index": 0, "delta": text}
