"""The messages between front-end workers and engine processes (orchestrator/ipc/wire.py),
and how a worker reads an engine process's admission (EngineAdmission, placement)."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest

from engines.interface import EngineInfo, SamplingParams, SessionSpec
from orchestrator.engine_port import FrameFailure, FrameResult
from orchestrator.frontend.engine_link import EngineLink
from orchestrator.frontend.engine_pool import DeviceEngine, EnginePool
from orchestrator.ipc import wire
from orchestrator.metrics import Metrics


def test_push_carries_every_sessions_frames_as_raw_buffers():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 1920)).astype(np.float32)
    b = rng.standard_normal((1, 1920)).astype(np.float32)
    parts = wire.push_message([("s-a", 0, a), ("s-b", 3, b)])
    assert parts[0] == wire.PUSH and len(parts) == 4  # kind, header, one buffer per session
    assert all(isinstance(p, np.ndarray) for p in parts[2:])  # no base64, no JSON for audio
    received = [parts[0], parts[1], *(p.tobytes() for p in parts[2:])]  # as bytes off the socket
    (key_a, epoch_a, got_a), (key_b, epoch_b, got_b) = wire.read_push(received)
    assert (key_a, epoch_a, key_b, epoch_b) == ("s-a", 0, "s-b", 3)
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


def test_frames_and_failures_round_trip_as_the_port_types():
    pcm16 = (np.arange(2 * 1920) % 3000 - 1500).astype(np.int16).reshape(2, 1920)
    sent = [FrameResult("s-a", 0, pcm16[0], " hi", 17, False, 41, 36.25, 82, 1.5),
            FrameResult("s-b", 2, pcm16[1], "", 3, True, 41, 36.25, 82, 0.25)]
    parts = wire.frames_message(sent)
    got = wire.read_frames([parts[0], parts[1], parts[2].tobytes()])
    assert [dataclasses.replace(r, pcm16=None) for r in got] == [dataclasses.replace(r, pcm16=None) for r in sent]
    for a, b in zip(got, sent):
        np.testing.assert_array_equal(a.pcm16, b.pcm16)
    failures = [FrameFailure("s-a", 3, "the model failed [err_1]", fatal=True), FrameFailure("s-b", 0, "x")]
    parts = wire.failures_message(failures)
    assert parts[0] == wire.FAILURES and wire.read_failures(parts) == failures


def test_results_of_another_version_are_refused():
    """A worker and an engine process of different versions refuse each other's results
    instead of reading the fields in the wrong places."""
    parts = wire.failures_message([FrameFailure("s", 0, "x")])
    old = orjson.loads(parts[1])
    old["v"] = wire.RESULTS_VERSION + 1
    with pytest.raises(wire.WireError, match="not version"):
        wire.read_failures([parts[0], orjson.dumps(old)])


@pytest.mark.parametrize("parts", [
    [wire.PUSH, wire.header([["s", 0, 2]]), np.zeros(1920, np.float32).tobytes()],  # 1 frame for 2
    [wire.PUSH, wire.header([["s", 0, 1], ["t", 0, 1]]), np.zeros(1920, np.float32).tobytes()],  # a buffer short
    [wire.PUSH, b"{not json", b""],
])
def test_a_push_that_does_not_add_up_is_refused(parts):
    with pytest.raises(wire.WireError):
        wire.read_push(parts)


def test_frames_whose_audio_and_header_disagree_are_refused():
    parts = wire.frames_message([FrameResult("s", 0, np.zeros(1920, np.int16), "", 0, False, 1, 1.0, 1, 0.0)])
    with pytest.raises(wire.WireError):
        wire.read_frames([parts[0], parts[1], b"\0" * 100])


def test_session_spec_and_engine_info_round_trip():
    spec = SessionSpec(voice="NATM1.pt", persona="You are terse.", seed=7,
                       sampling=SamplingParams(greedy=True, temp_text=0.5, topk_audio=10))
    assert wire.spec_from_wire(wire.read_header(wire.header(wire.spec_to_wire(spec)))) == spec
    info = EngineInfo(model="m", backend="torch", device="cuda:0", max_slots=128, is_demo=False)
    assert wire.info_from_wire(wire.read_header(wire.header(wire.info_to_wire(info)))) == info
    with pytest.raises(wire.WireError):
        wire.spec_from_wire({"voice": "x"})  # no persona


def test_a_worker_places_on_a_full_looking_engine_process_and_lets_it_decide():
    """The counts of an engine process's admission come with its heartbeat, so a slot freed
    a moment ago may still look held: placement at an open asks the engine anyway (it admits
    or refuses itself), while /ready and the HTTP gate go by the counts."""
    link = EngineLink(0, "cuda:0", "ipc:///nonexistent")
    link.max_sessions, link.held = 4, 4
    link.ready.set()
    link._last_status = float("inf")  # answers: alive
    engine = DeviceEngine(0, "cuda:0", link, watchdog_deadline_s=1.0, metrics=Metrics(),
                          on_stall=lambda *args: None)
    assert (engine.max_sessions, engine.admission.free, engine.state) == (4, 0, "ready")
    pool = EnginePool([engine])
    assert pool.choose() is None  # by the counts: full
    assert pool.choose(at_open=True) is engine  # at an open: ask the engine
    link.held = 3
    assert pool.choose() is engine and pool.free == 1
