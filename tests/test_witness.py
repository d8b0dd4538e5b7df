"""The streaming witness (``orch_support.StreamingWitness``) fails on each failure it is
there to see: run against the scripted server (tests/e2e/online_serving/scripted_server.py),
which misbehaves as asked, with the server's loop-block count in the test's hands."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.e2e.online_serving.scripted_server import ScriptedServer
from tests.orch_support import WITNESS_CATCH_UP_S, StreamingWitness, run


class ScriptedTarget:
    """What the witness needs of a server: its websocket base and its metrics (here all zero
    but what the test sets)."""

    def __init__(self, scripted: ScriptedServer) -> None:
        self.ws = f"ws://127.0.0.1:{scripted.port}"
        self.values: dict[str, float] = {}

    def metrics(self, *series: str) -> list[float]:
        return [self.values.get(name, 0.0) for name in series]


def witness_of(attack, *, catch_up_s: float = WITNESS_CATCH_UP_S, **behaviour) -> StreamingWitness:
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


def test_a_witness_whose_audio_stops_fails():
    """Output stops after the 15th frame while the socket stays open; between the deltas that
    did come there was no pause at all.  (The frames that never come are waited for 2 s here,
    not a minute: a slow host cannot bring them.)"""
    with pytest.raises(AssertionError, match=r"the witness sent \d+ frames and got 15 back"):
        witness_of(quiet, catch_up_s=2.0, drop_frames=frozenset(range(15, 10_000)))


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


@pytest.mark.parametrize("series, cost", [
    ("personaplex_event_loop_blocked_seconds_count", "event-loop blocks past 0.25 s"),
    ('personaplex_engine_job_own_seconds_count{kind="open"}', "engine open pieces past 0.16 s"),
    ("personaplex_tick_stalls_total", "engine calls past the watchdog deadline"),
], ids=["loop", "piece", "stall"])
def test_a_witness_fails_when_the_server_counted_a_cost(series, cost):
    """An observation past a bound raises a histogram's count and not its bucket's (the
    counter: just the count)."""
    async def block(witness: StreamingWitness, target: ScriptedTarget) -> None:
        target.values[series] = 1.0
        await asyncio.sleep(0.5)

    with pytest.raises(AssertionError, match=re.escape(f"the server counted {{'{cost}': 1.0}}")):
        witness_of(block)
