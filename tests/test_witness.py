"""The streaming witness (``orch_support.StreamingWitness``) fails on each failure it is
there to see: run against the scripted server (tests/e2e/online_serving/scripted_server.py),
which misbehaves as asked, with the server's loop-block count in the test's hands."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.e2e.online_serving.scripted_server import ScriptedServer
from tests.orch_support import StreamingWitness, run


class ScriptedTarget:
    """What the witness needs of a server: its websocket base and the count of event-loop
    blocks past a bound (here set by the test)."""

    def __init__(self, scripted: ScriptedServer) -> None:
        self.ws = f"ws://127.0.0.1:{scripted.port}"
        self.blocks = 0.0

    def observations_above(self, histogram: str, bound: float, labels: str = "") -> float:
        assert histogram == "personaplex_event_loop_blocked_seconds"
        return self.blocks


def witness_of(attack, *, catch_up_s: float = 2.0, **behaviour) -> StreamingWitness:
    """Stream a witness through ``attack(witness, target)`` against a scripted server that
    behaves as ``behaviour`` says; returns the witness (its checks passed)."""
    with ScriptedServer(**behaviour) as scripted:
        target = ScriptedTarget(scripted)

        async def scenario() -> StreamingWitness:
            async with StreamingWitness(target, catch_up_s=catch_up_s) as witness:
                await attack(witness, target)
            return witness

        return run(scenario())


async def quiet(witness: StreamingWitness, target: ScriptedTarget) -> None:
    await asyncio.sleep(1.0)


def test_a_witness_whose_every_frame_is_answered_passes():
    witness = witness_of(quiet)
    assert witness.frames_answered == witness.frames_sent >= 25
    assert witness.longest_gap_s() < 1.0


def test_a_witness_whose_audio_stops_fails():
    """Output stops after the 15th frame while the socket stays open; between the deltas that
    did come there was no pause at all."""
    with pytest.raises(AssertionError, match=r"the witness sent \d+ frames and got 15 back"):
        witness_of(quiet, drop_frames=frozenset(range(15, 10_000)))


def test_a_witness_whose_session_the_server_ends_fails():
    async def close_it(witness: StreamingWitness, target: ScriptedTarget) -> None:
        await witness.client.send({"type": "session.close"})  # the server answers, then closes
        await asyncio.sleep(1.0)

    with pytest.raises(AssertionError, match=re.escape("the witness's reader ended early")):
        witness_of(close_it)


def test_a_witness_whose_reader_dies_fails():
    """The server sends a frame the witness cannot read: its reader raises, and says so."""
    with pytest.raises(AssertionError, match=r"reader ended early: JSONDecodeError"):
        witness_of(quiet, binary_at_frame=20)


def test_a_witness_fails_when_the_server_counted_a_blocked_loop():
    async def block(witness: StreamingWitness, target: ScriptedTarget) -> None:
        target.blocks += 1
        await asyncio.sleep(0.5)

    with pytest.raises(AssertionError, match=r"event loop was held past 0\.25 s 1 time"):
        witness_of(block)
