"""Messages between a front-end worker and an engine process: their kinds and codecs.

A message is ``[kind, header, *buffers]``: ``kind`` one of the byte strings below, ``header``
compact JSON, ``buffers`` raw little-endian numpy data (float32 input frames, int16 output
frames).  Audio never goes through JSON: a worker's input frames of one event-loop pass go in
one ``PUSH`` (one buffer per session), and a tick's output for one worker in one ``FRAMES``
(one ``[n, 1920]`` int16 buffer, row ``i`` for lane ``i`` of the header).

Worker -> engine: ``HELLO`` (heartbeat, every ``HEARTBEAT_S``), ``OPEN``, ``CLOSE``,
``RESTART``, ``DROP``, ``PUSH``, ``STATUS_NOW``.  Engine -> worker: ``STATUS`` (heartbeat and state),
``OPENED``, ``CLOSED``, ``FRAMES``, ``FAILURES``.  Every function here is pure: the sockets
live in ``engine_host/engine_process.py`` and ``orchestrator/frontend/engine_link.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import orjson

from engines.config import FRAME_SAMPLES
from engines.interface import EngineInfo, SamplingParams, SessionSpec

from ..engine_port import FrameFailure, FrameResult

HELLO = b"hello"
OPEN = b"open"
CLOSE = b"close"
RESTART = b"restart"
DROP = b"drop"
PUSH = b"push"
STATUS_NOW = b"status?"  # answer with a STATUS now (a worker answering /ready, /health, /metrics)
STATUS = b"status"
OPENED = b"opened"
CLOSED = b"closed"
FRAMES = b"frames"
FAILURES = b"failures"

HEARTBEAT_S = 0.1  # both directions
# A peer silent this long is gone (a worker: its sessions are closed; an engine: its
# sessions are told and ended).  Long enough for a GC pause, short against a call's patience.
PEER_TIMEOUT_S = 2.0


class WireError(ValueError):
    """A message that does not decode (a bug or a foreign peer: logged and dropped)."""


def header(value: Any) -> bytes:
    return orjson.dumps(value)


def read_header(frame: Any) -> Any:
    try:
        return orjson.loads(bytes(frame.buffer) if hasattr(frame, "buffer") else frame)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"bad message header: {exc}") from None


def buffer_of(frame: Any) -> memoryview | bytes:
    """The bytes of a received frame without copying (a ``zmq.Frame`` or plain bytes)."""
    return frame.buffer if hasattr(frame, "buffer") else frame


# Sessions ------------------------------------------------------------------------------------
def spec_to_wire(spec: SessionSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_wire(value: dict[str, Any]) -> SessionSpec:
    try:
        sampling = SamplingParams(**value.get("sampling", {}))
        return SessionSpec(voice=value["voice"], persona=value["persona"], sampling=sampling, seed=value.get("seed"))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad session spec: {exc}") from None


def info_to_wire(info: EngineInfo | None) -> dict[str, Any] | None:
    return None if info is None else dataclasses.asdict(info)


def info_from_wire(value: dict[str, Any] | None) -> EngineInfo | None:
    return None if value is None else EngineInfo(**value)


# Audio ---------------------------------------------------------------------------------------
def push_message(items: Sequence[tuple[str, int, np.ndarray]]) -> list[Any]:
    """One ``PUSH`` for several sessions' input: ``items`` of (key, epoch, float32 [n, 1920])."""
    meta = [[key, epoch, len(frames)] for key, epoch, frames in items]
    buffers = [np.ascontiguousarray(frames, dtype="<f4") for _, _, frames in items]
    return [PUSH, header(meta), *buffers]


def read_push(parts: Sequence[Any]) -> list[tuple[str, int, np.ndarray]]:
    """The (key, epoch, frames) of a ``PUSH``; frames are read-only views of the message."""
    meta = read_header(parts[1])
    if not isinstance(meta, list) or len(meta) != len(parts) - 2:
        raise WireError("PUSH: header and buffers disagree")
    out = []
    for (key, epoch, n), frame in zip(meta, parts[2:]):
        data = np.frombuffer(buffer_of(frame), dtype="<f4")
        if data.size != n * FRAME_SAMPLES:
            raise WireError(f"PUSH: {data.size} samples for {n} frames")
        out.append((str(key), int(epoch), data.reshape(n, FRAME_SAMPLES)))
    return out


# The version of the FRAMES and FAILURES headers: a worker and an engine process of different
# versions refuse each other's messages instead of misreading them.
RESULTS_VERSION = 1


def frames_message(results: Sequence[FrameResult]) -> list[Any]:
    """One tick's ``FrameResult``s for one worker: a header of named columns (one entry per
    lane) and the lanes' audio as one int16 [n, 1920] buffer, row i for lane i."""
    first = results[0]
    meta = {"v": RESULTS_VERSION, "tick": first.tick, "tick_ms": round(first.tick_ms, 3), "batch": first.batch_size,
            "keys": [r.key for r in results], "epochs": [r.epoch for r in results],
            "texts": [r.text for r in results], "text_ids": [r.text_id for r in results],
            "silence": [r.silence_input for r in results], "wait_ms": [round(r.wait_ms, 3) for r in results]}
    pcm16 = np.stack([r.pcm16 for r in results])
    return [FRAMES, header(meta), np.ascontiguousarray(pcm16, dtype="<i2")]


def read_frames(parts: Sequence[Any]) -> list[FrameResult]:
    meta = read_header(parts[1])
    if not isinstance(meta, dict) or meta.get("v") != RESULTS_VERSION:
        raise WireError(f"FRAMES: not version {RESULTS_VERSION}")
    keys = meta["keys"]
    columns = [meta[name] for name in ("epochs", "texts", "text_ids", "silence", "wait_ms")]
    pcm = np.frombuffer(buffer_of(parts[2]), dtype="<i2")
    if not isinstance(keys, list) or pcm.size != len(keys) * FRAME_SAMPLES or any(len(c) != len(keys) for c in columns):
        raise WireError("FRAMES: header and audio disagree")
    pcm = pcm.reshape(len(keys), FRAME_SAMPLES)
    tick, tick_ms, batch = int(meta["tick"]), float(meta["tick_ms"]), int(meta["batch"])
    return [FrameResult(str(key), int(epoch), pcm[row], str(text), int(text_id), bool(silent), tick, tick_ms, batch,
                        float(wait_ms))
            for row, (key, epoch, text, text_id, silent, wait_ms) in enumerate(zip(keys, *columns))]


def failures_message(failures: Sequence[FrameFailure]) -> list[Any]:
    """``FrameFailure``s for one worker, as named columns."""
    meta = {"v": RESULTS_VERSION, "keys": [f.key for f in failures], "epochs": [f.epoch for f in failures],
            "messages": [f.message for f in failures], "fatal": [f.fatal for f in failures]}
    return [FAILURES, header(meta)]


def read_failures(parts: Sequence[Any]) -> list[FrameFailure]:
    meta = read_header(parts[1])
    if not isinstance(meta, dict) or meta.get("v") != RESULTS_VERSION:
        raise WireError(f"FAILURES: not version {RESULTS_VERSION}")
    columns = [meta[name] for name in ("keys", "epochs", "messages", "fatal")]
    if len({len(c) for c in columns}) != 1:
        raise WireError("FAILURES: columns of different lengths")
    return [FrameFailure(str(key), int(epoch), str(message), bool(fatal)) for key, epoch, message, fatal in zip(*columns)]
