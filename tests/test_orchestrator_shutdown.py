"""SIGTERM to a real ``hypercorn orchestrator:app``: the server drains.

What hypercorn does on SIGTERM: its parent process sets a shutdown event, the worker closes
its listening sockets, waits ``--graceful-timeout`` (2 s here) for open connections, cancels
them, and only then runs Quart's ``after_serving`` hooks.  The app notices the closed
listeners (``orchestrator/listeners.py``) and drains inside that grace period: live sessions
end with ``session.closed`` reason ``shutdown`` and close code 1001, a socket still in its
handshake is refused with ``server_shutting_down``, and nothing new can connect.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import websockets

from tests.orch_support import Client, Server, f32_append, run, speech_frames


@pytest.fixture
def doomed_server():
    server = Server(max_sessions=2, silence_grace_s=0)
    yield server
    server.stop()


def test_sigterm_drains_live_sessions_and_refuses_new_ones(doomed_server: Server):
    server = doomed_server

    async def scenario():
        talking = await Client.connect(server.ws + "/v1/realtime")
        await talking.open()
        idle = await Client.connect(server.ws + "/v1/duplex")
        await idle.open()
        waiting = await Client.connect(server.ws + "/v1/realtime")  # handshake only: sent nothing yet
        for frame in speech_frames(4):
            await talking.send(f32_append(frame))
        await talking.wait_audio_frames(4)

        sent_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for client in (talking, idle):
            closed = await client.next("session.closed", timeout=10)
            assert closed["reason"] == "shutdown"
            assert await client.wait_closed() == (1001, "shutdown")
        done = [e for e in talking.events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "completed", "the open response is ended"
        types = [e["type"] for e in talking.events]
        assert types.index("response.done") < types.index("session.closed") == len(types) - 1
        refused = await waiting.next("error", timeout=10)
        assert refused["error"]["code"] == "server_shutting_down" and refused["error"]["retryable"] is True
        assert (await waiting.wait_closed())[0] == 1001
        drained_in = time.monotonic() - sent_at
        assert drained_in < 2.0, f"the drain must fit in hypercorn's graceful timeout (took {drained_in:.2f} s)"
        # The worker's listener is gone: nothing new is served (hypercorn's parent still holds
        # the socket until the worker exits, so the TCP connect itself may succeed).
        with pytest.raises((OSError, websockets.InvalidHandshake)):
            await asyncio.wait_for(Client.connect(server.ws + "/v1/realtime"), 5)

    run(scenario())
    assert server.proc.wait(30) == 0
    log = server.logs()
    assert "draining (the server stopped listening)" in log
    assert log.count("closed (shutdown)") == 2
    server.assert_clean_log()
