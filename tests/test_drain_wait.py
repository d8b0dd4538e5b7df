"""``python -m orchestrator.drain_wait`` (the pre-stop hook of deploy/kubernetes/): waits while
a session is live, ends once it has closed, ends at its deadline otherwise, and reads the count
from a 503 answer too (a full server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.orch_support import REPO, Client, Server, run


def _drain_wait(url: str, deadline_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.drain_wait", "--url", url, "--deadline-s",
                             str(deadline_s), "--poll-s", "0.1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_it_waits_for_the_live_session_and_not_past_its_deadline():
    server = Server(max_sessions=1, silence_grace_s=0)
    url = server.http + "/ready?require_free_slot=1"  # full while the session lives: 503, same body
    try:
        async def scenario() -> None:
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await client.open()
            assert server.get("/ready?require_free_slot=1")[0] == 503
            short = _drain_wait(url, 0.5)
            assert short.wait(30) == 0 and "1 session(s) still live at the deadline" in short.stdout.read()
            waiting = _drain_wait(url, 120)
            try:
                time.sleep(1.5)
                assert waiting.poll() is None  # the session is live: still waiting
                await client.send({"type": "session.close"})
                await client.wait_closed()
                assert waiting.wait(30) == 0 and "no live sessions" in waiting.stdout.read()
            finally:
                waiting.kill()

        run(scenario())
    finally:
        server.stop()
    gone = _drain_wait(server.http + "/ready", 60)  # a server that has stopped: nothing to wait for
    assert gone.wait(30) == 0 and "the server does not answer" in gone.stdout.read()


def test_one_unanswered_look_does_not_end_the_wait(monkeypatch):
    """A slow or refused answer between two that count live sessions is not a server gone:
    only MISSES_GONE in a row are."""
    from orchestrator import drain_wait

    answers = iter([None, 5, None, None, 4, 0])
    monkeypatch.setattr(drain_wait, "live_sessions", lambda url: next(answers))
    assert drain_wait.wait("http://unused/ready", 60, 0) == 0
    answers = iter([2, None, None, None, 1])
    assert drain_wait.wait("http://unused/ready", 60, 0) is None  # three in a row: gone
