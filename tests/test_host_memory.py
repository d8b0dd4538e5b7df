"""Host memory is bounded (issue 34, item 5): what one client can make a front-end worker
hold stays within the bound ``orchestrator/frontend/memory_bound.py`` computes from the
settings (docs/ORCHESTRATOR.md, "Host memory"), and the client's socket is torn down.

A real ``hypercorn orchestrator:app`` (the tiny model, one worker) with small limits, so that
the bound is small beside what an unbounded server would hold: each scenario makes the client
offer ~100 MiB.  The worker's peak RSS is read exactly (``VmHWM``, reset through
``/proc/PID/clear_refs`` before the scenario), so nothing depends on when it is sampled; the
timeouts are bounds on a hang, not speeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest
import websockets

from orchestrator.frontend.inbound import InboundOverflow, InboundQueue
from orchestrator.frontend.memory_bound import connection_bound, handling_bytes, max_session_object_bytes, worker_bound
from orchestrator.frontend.session_core import IN_FLIGHT_COPIES, Outbox
from orchestrator.protocol.errors import ProtocolError
from orchestrator.protocol.held_bytes import ITEM_BYTES
from orchestrator.protocol.session_config import SessionConfig, parse_session_update
from orchestrator.settings import Settings

from .orch_support import Server, run

MiB = 2**20
SETTINGS = {
    "max_sessions": 2, "silence_grace_s": 0, "max_event_bytes": MiB, "max_output_buffer_bytes": 4 * MiB,
    "max_pending_input_bytes": MiB, "close_timeout_s": 2.0, "first_message_timeout_s": 60,
    # Rate limits off: the scenarios send faster than them; the bound must hold without them.
    "max_events_per_s": 0, "max_input_bytes_per_s": 0,
}
BOUND = connection_bound(Settings.from_mapping(SETTINGS))  # one connection, as written (~20 MiB here)
# Besides one connection's bound: the one event the worker handles at a time, and what the
# allocator keeps of memory freed in between (these scenarios grew the worker by 1-8 MiB).
SLACK = handling_bytes(Settings.from_mapping(SETTINGS)) + 16 * MiB
OFFERED = 100 * MiB  # what each client sends at most: several times BOUND + SLACK


@pytest.fixture(scope="module")
def server():
    server = Server(**SETTINGS)
    yield server
    server.stop()
    server.assert_clean_log()


def test_the_written_bound_is_the_computed_one():
    """docs/ORCHESTRATOR.md, "Host memory", states the defaults' bound per connection and per
    worker in bytes: the numbers memory_bound.py computes."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "ORCHESTRATOR.md").read_text()
    section = text.split("## Host memory", 1)[1].split("\n## ", 1)[0]
    assert f"{connection_bound(Settings()):,} bytes" in section
    assert f"{worker_bound(Settings()):,} bytes" in section


def test_the_outbox_counts_a_message_until_the_transport_has_taken_it():
    """Queued once, in flight IN_FLIGHT_COPIES times, text beyond ASCII at 4 bytes a
    character; past the limit a put is refused, so the session is closed."""

    async def scenario() -> None:
        outbox = Outbox(limit=100_000)
        assert outbox.put("a" * 10_000) and outbox.bytes == 10_000 + ITEM_BYTES
        assert outbox.put("\u00e9" * 10_000) and outbox.bytes == 10_000 + 40_000 + 2 * ITEM_BYTES
        await outbox.get()
        assert outbox.bytes == IN_FLIGHT_COPIES * (10_000 + ITEM_BYTES) + 40_000 + ITEM_BYTES
        assert not outbox.put("b" * 30_000)  # 3 x 10 KB in flight + 40 KB queued + 30 KB > 100 KB
        outbox.sent()
        assert outbox.bytes == 40_000 + ITEM_BYTES and outbox.put("b" * 30_000)

    asyncio.run(scenario())


def test_the_inbound_queue_never_waits_and_ends_the_connection_past_its_limit():
    """One message always fits an empty queue; a message that does not fit drops the queue and
    what comes later, and the reader is told (InboundOverflow) instead of Quart's receiving
    task waiting (which would pile the messages up in hypercorn's queue instead)."""

    async def scenario() -> None:
        queue = InboundQueue(limit=1000)
        await queue.put("x" * 5000)  # alone: fits
        assert await queue.get() == "x" * 5000
        await queue.put("y" * 500)
        await asyncio.wait_for(queue.put("z" * 600), 1)  # does not fit: never waits
        await queue.put("w")
        assert queue.bytes == 0
        with pytest.raises(InboundOverflow):
            await queue.get()

    asyncio.run(scenario())


def test_the_session_fields_a_client_may_leave_are_bounded():
    """What a session keeps of its client's fields (and echoes in every session.updated) is
    bounded across updates, values counted as the objects they become: session_too_large."""
    config = SessionConfig(model="m")

    def update(session: dict, current: SessionConfig) -> SessionConfig:
        return parse_session_update(session, current, is_open=True, input_rate_locked=False,
                                    max_session_bytes=100_000)

    config = update({"metadata": {"a": "x" * 60_000}}, config)
    with pytest.raises(ProtocolError) as refused:  # a second field: 120 KB in all
        update({"tools": ["y" * 60_000]}, config)
    assert refused.value.code == "session_too_large"
    with pytest.raises(ProtocolError):  # 2,000 values of a few bytes each hold ~250 KB
        update({"include": [0] * 2000}, SessionConfig(model="m"))
    assert update({"metadata": {"a": "x"}}, config).echoed["metadata"] == {"a": "x"}  # replaced, not added


def test_a_worker_refuses_websockets_past_its_connection_limit():
    """Past max_connections_per_worker (every connection of the worker counts) a websocket gets
    HTTP 503 connection_limit_exceeded with Retry-After; once one closes, the next gets in."""
    limited = Server(max_sessions=2, max_connections_per_worker=2, first_message_timeout_s=60)

    async def scenario() -> None:
        url = limited.ws + "/v1/realtime?duplex=1"
        held = [await websockets.connect(url, proxy=None) for _ in range(2)]
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(url, proxy=None)
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert json.loads(response.body)["error"]["code"] == "connection_limit_exceeded"
        await held.pop().close()
        deadline = time.monotonic() + 30
        while True:  # the closed one's transport ends a moment after its close
            try:
                held.append(await websockets.connect(url, proxy=None))
                break
            except websockets.InvalidStatus:
                assert time.monotonic() < deadline, "a closed connection still counts"
                await asyncio.sleep(0.1)
        for ws in held:
            await ws.close()

    try:
        run(scenario())
        assert limited.metric('personaplex_connections_refused_total{reason="worker_full"}') >= 1
    finally:
        limited.stop()
    limited.assert_clean_log()


def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> int:
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5); returns that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_bytes(pid, "VmRSS")


def holds_peer(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket whose peer is the local port ``port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                return True
    return False


async def stalled_client(server: Server) -> tuple[websockets.ClientConnection, int]:
    """A websocket client that reads nothing: a small receive buffer, and the library's queue
    of one message, so the kernel cannot absorb megabytes for it; no keepalive (its pongs
    would go unread too).  Returns it and its local port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    ws = await websockets.connect(server.ws + "/v1/realtime?duplex=1", sock=sock, max_queue=1, compression=None,
                                  ping_interval=None, max_size=None, proxy=None)
    return ws, sock.getsockname()[1]


async def quiet(server: Server, series: str, seconds: float) -> bool:
    """Whether ``series`` has moved at least once before and then not for ``seconds``."""
    first = await asyncio.to_thread(server.metric, series)
    await asyncio.sleep(seconds)
    return first > 0 and await asyncio.to_thread(server.metric, series) == first


async def wait_torn_down(pid: int, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while holds_peer(pid, port):
        assert time.monotonic() < deadline, "the worker still holds the client's socket"
        await asyncio.sleep(0.2)


async def torn_down_within_bound(pid: int, port: int, before: int) -> None:
    """The client's socket is gone from the worker, whose peak RSS grew by at most one
    connection's bound plus the slack."""
    await wait_torn_down(pid, port)
    grown = status_bytes(pid, "VmHWM") - before
    assert grown <= BOUND + SLACK, f"the worker grew by {grown / MiB:.1f} MiB: more than the bound " \
                                   f"{BOUND / MiB:.1f} MiB + {SLACK / MiB:.1f} MiB"


def test_client_that_never_reads_large_echoes_is_closed_within_the_bound(server: Server):
    """A client that never reads and sends session.update events whose metadata the server
    echoes in session.updated is closed for output_backpressure, its socket is torn down, and
    the worker's peak RSS grows by no more than the bound of one connection (plus SLACK)."""
    pid = server.worker_pids()[0]
    # Metadata just within what a session may hold, so that each echo is as large as allowed.
    metadata = {"note": "m" * (max_session_object_bytes(Settings.from_mapping(SETTINGS)) - 4096)}
    update = json.dumps({"type": "session.update", "session": {"metadata": metadata}})
    closed = 'personaplex_sessions_closed_total{protocol="realtime",reason="output_backpressure"}'

    async def warm_up() -> None:
        """The same events from a client that reads: what the worker allocates once (code
        paths, pools) is not counted against the bound."""
        async with websockets.connect(server.ws + "/v1/realtime?duplex=1", max_size=None, proxy=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {}}))
            for _ in range(3):
                await ws.send(update)
            updated = 0
            while updated < 4:
                updated += json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.updated"

    async def scenario() -> None:
        await warm_up()
        await asyncio.to_thread(server.wait_free_slots, 2, 30)
        before = reset_peak(pid)
        closed_before = server.metric(closed)
        ws, port = await stalled_client(server)
        await ws.send(json.dumps({"type": "session.update", "session": {}}))
        offered = 0
        while server.metric(closed) == closed_before and offered < OFFERED:
            try:
                await asyncio.wait_for(ws.send(update), 30)
            except (websockets.ConnectionClosed, asyncio.TimeoutError):
                break  # torn down already, or the server stopped reading: either way, done sending
            offered += len(update)
        assert await asyncio.to_thread(server.metric, closed) == closed_before + 1, \
            f"not closed for output_backpressure after {offered / MiB:.0f} MiB of echoed events"
        await torn_down_within_bound(pid, port, before)
        ws.transport.abort()

    run(scenario())


def test_client_that_floods_while_its_handler_is_busy_is_closed_within_the_bound(server: Server):
    """A client that reads nothing and keeps sending while its handler is blocked writing to
    it (the handshake answers each binary message with an error, until the socket is full)
    is closed for input_backpressure once more than the inbound queue holds is waiting; its
    socket is torn down, and the worker's peak RSS grows by no more than the bound."""
    pid = server.worker_pids()[0]
    refused = 'personaplex_errors_total{code="input_backpressure"}'
    answered = 'personaplex_errors_total{code="bad_event"}'

    async def scenario() -> None:
        await asyncio.to_thread(server.wait_free_slots, 2, 30)
        before = reset_peak(pid)
        refused_before = server.metric(refused)
        ws, port = await stalled_client(server)
        # Each binary message is answered with an error the client does not read: once the
        # socket's buffers are full the handler waits on its send (close_timeout_s at a time,
        # then one more message, one more error).  Sent until the answers stop for a second.
        stalled = False
        for _ in range(100):
            for _ in range(2000):
                await ws.send(b"x")
            if await quiet(server, answered, 1.0):
                stalled = True
                break
        assert stalled, "the handler never had to wait on its sends"
        blob, offered = b"y" * (256 * 1024), 0
        while offered < OFFERED:
            try:
                await asyncio.wait_for(ws.send(blob), 30)
            except (websockets.ConnectionClosed, asyncio.TimeoutError):
                break
            offered += len(blob)
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(server.metric, refused) == refused_before:
            assert time.monotonic() < deadline, f"not closed for input_backpressure after {offered / MiB:.0f} MiB"
            await asyncio.sleep(0.2)
        await torn_down_within_bound(pid, port, before)
        ws.transport.abort()

    run(scenario())
