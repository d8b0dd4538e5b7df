"""Many replicas behind a load balancer: ``deploy/haproxy.cfg`` run as is in front of two real
``hypercorn orchestrator:app`` replicas on loopback (docs/DEPLOYMENT.md).

The replicas run with ``PERSONAPLEX_REFUSE_WHEN_FULL=http`` (a full replica answers the
websocket upgrade with HTTP 503) and HAProxy checks ``/ready?require_free_slot=1`` (a full
replica is marked DOWN for new sessions only).  Shown here: sessions spread by least
connections with audio flowing through the proxy; a caller is refused (HTTP 503,
``resource_exhausted``) only when every replica is full; a full replica's 503 is retried on
another; unequal capacities fill completely; a freed slot takes new sessions again; live
sessions keep streaming while their replica is marked full.

Needs the ``haproxy`` binary (Debian: ``apt-get install haproxy``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import csv
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.orch_support import FRAME, REPO, Client, Server, delta_pcm, f32_append, free_port, run, speech_frames

HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
pytestmark = pytest.mark.skipif(HAPROXY is None,
                                reason="haproxy is not installed (apt-get install haproxy; .ci/run does it as root)")

CONFIG = REPO / "deploy" / "haproxy.cfg"
NAMES = ("replica1", "replica2")  # the server lines of deploy/haproxy.cfg
BACKEND = "personaplex"


class Balancer:
    """``haproxy -f deploy/haproxy.cfg`` with the replicas' addresses in its environment; its
    runtime API (the admin socket) reports what HAProxy thinks of each replica."""

    def __init__(self, workdir: Path, replicas: dict[str, Server]) -> None:
        self.admin_socket = workdir / "admin.sock"
        port = free_port()
        env = {**os.environ, "PP_LISTEN": f"127.0.0.1:{port}", "PP_STATS": f"127.0.0.1:{free_port()}",
               "PP_ADMIN_SOCKET": str(self.admin_socket)}
        env.update({f"PP_{name.upper()}": f"127.0.0.1:{server.port}" for name, server in replicas.items()})
        self.log: deque[str] = deque(maxlen=2000)
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1"
        deadline = time.monotonic() + 15
        while True:  # up, and every replica checked once (HAProxy starts them UP, unchecked)
            if self.proc.poll() is not None:
                raise RuntimeError("haproxy exited:\n" + self.logs())
            with contextlib.suppress(OSError):
                if all(row["check_status"] not in ("", "INI") for row in self.servers().values()):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("haproxy did not check the replicas:\n" + self.logs())
            time.sleep(0.05)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())

    def logs(self) -> str:
        return "\n".join(self.log)

    def command(self, line: str) -> str:
        """One runtime API command (the socket answers and closes)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.admin_socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, dict[str, str]]:
        """``show stat`` rows of the replicas: status (UP / DOWN / ...), scur (current
        connections), wretr (retries), wredis (redispatches), hrsp_5xx, check_status, ..."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(text.splitlines())
        return {row["svname"]: {k: (v or "").lstrip("* ") for k, v in row.items()}
                for row in rows if row["pxname"] == BACKEND and row["svname"] in NAMES}

    def wait_status(self, timeout: float = 10.0, **expected: str) -> None:
        """Wait until HAProxy's health state of each named replica is as given."""
        deadline = time.monotonic() + timeout
        while True:
            state = {name: row["status"] for name, row in self.servers().items()}
            if all(state[name] == status for name, status in expected.items()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"haproxy states {state}, expected {expected}:\n" + self.logs()[-3000:])
            time.sleep(0.05)

    def counter(self, name: str, field: str) -> int:
        return int(self.servers()[name][field] or 0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # HAProxy's hard stop: it exits at once
            self.proc.wait(10)


@dataclass
class Deployment:
    replicas: dict[str, Server]
    balancer: Balancer

    def live(self) -> dict[str, int]:
        """Live sessions per replica, as each replica counts them."""
        return {name: server.get("/ready")[1]["live_sessions"] for name, server in self.replicas.items()}

    def settle(self) -> None:
        """Every slot free (a closed session's cleanup is asynchronous) and every replica UP."""
        for server in self.replicas.values():
            server.wait_free_slots(server.get("/ready")[1]["max_sessions"])
        self.balancer.wait_status(**{name: "UP" for name in self.replicas})

    async def open(self) -> tuple[Client, str]:
        """A session through the balancer; returns it and the replica it landed on."""
        before = self.live()
        client = await Client.connect(self.balancer.url)
        await client.open()
        after = self.live()
        grown = [name for name in after if after[name] == before[name] + 1]
        assert len(grown) == 1 and sum(after.values()) == sum(before.values()) + 1, (before, after)
        return client, grown[0]

    async def refused(self) -> tuple[int, dict[str, str], Any]:
        """A caller that must be refused at the upgrade: (status, headers, JSON body)."""
        with pytest.raises(websockets.InvalidStatus) as refusal:
            await Client.connect(self.balancer.url)
        response = refusal.value.response
        return response.status_code, dict(response.headers), json.loads(response.body.decode())


@contextlib.contextmanager
def deployment(workdir: Path, *capacities: int) -> Iterator[Deployment]:
    """Replicas with these session capacities (started in parallel) behind HAProxy."""
    settings = {"silence_grace_s": 0, "refuse_when_full": "http", "trusted_proxies": "127.0.0.1"}
    with concurrent.futures.ThreadPoolExecutor(len(capacities)) as pool:
        starting = [pool.submit(Server, max_sessions=n, **settings) for n in capacities]
    replicas: dict[str, Server] = {}
    try:
        for name, future in zip(NAMES, starting):
            replicas[name] = future.result()  # re-raises a start failure (the others stop below)
        balancer = Balancer(workdir, replicas)
        try:
            yield Deployment(replicas, balancer)
        finally:
            balancer.stop()
    finally:
        for future in starting:
            if future.exception() is None:
                future.result().stop()
    for server in replicas.values():
        server.assert_clean_log()


@pytest.fixture(scope="module")
def deployed(request, tmp_path_factory) -> Iterator[Deployment]:
    """Replicas of the capacities given by the test's mark.  One deployment at a time: pytest
    ends a module fixture's instance before it makes one with other capacities."""
    with deployment(tmp_path_factory.mktemp("balancer"), *request.param) as dep:
        yield dep


EVEN = pytest.mark.parametrize("deployed", [(2, 2)], indirect=True, ids=["2+2"])
UNEVEN = pytest.mark.parametrize("deployed", [(1, 3)], indirect=True, ids=["1+3"])


async def stream(clients: list[Client], frames: int, offset_s: float = 1.0) -> None:
    """Real speech in on every session at once, the same number of audio frames out of each
    (silence feeding is off, so output frames are exactly input frames)."""
    pcm = speech_frames(frames, offset_s)
    have = [sum(len(delta_pcm(e)) for e in c.audio()) // FRAME for c in clients]

    async def one(client: Client, already: int) -> None:
        for frame in pcm:
            await client.send(f32_append(frame))
        await client.wait_audio_frames(already + frames)

    await asyncio.gather(*(one(c, n) for c, n in zip(clients, have)))


def assert_capacity_refusal(status: int, headers: dict[str, str], body: Any) -> None:
    assert status == 503, (status, body)
    assert headers.get("retry-after") == "1", headers
    assert body["error"]["code"] == "resource_exhausted", body


@EVEN
def test_sessions_spread_by_least_connections_and_the_fifth_is_refused_when_all_are_full(deployed: Deployment):
    deployed.settle()

    async def scenario():
        clients = []
        for _ in range(4):
            clients.append((await deployed.open())[0])  # every one of the first four gets a session
            counts = deployed.live()
            assert max(counts.values()) - min(counts.values()) <= 1, f"not spread: {counts}"
        assert deployed.live() == {"replica1": 2, "replica2": 2}
        assert {name: int(row["scur"]) for name, row in deployed.balancer.servers().items()} == \
            {"replica1": 2, "replica2": 2}, "HAProxy's view of the live websockets"
        await stream(clients, 3)  # audio through the proxy, every session

        # Full: the health check takes both out, and the balancer itself refuses.
        deployed.balancer.wait_status(replica1="DOWN", replica2="DOWN")
        status, headers, body = await deployed.refused()
        assert_capacity_refusal(status, headers, body)
        assert body["error"]["message"] == "no replica is ready with a free session slot", \
            "HAProxy's own 503 (its http-error answer)"
        assert deployed.live() == {"replica1": 2, "replica2": 2}

    run(scenario())


@EVEN
def test_live_sessions_keep_streaming_while_their_replica_is_marked_full(deployed: Deployment):
    deployed.settle()

    async def scenario():
        clients = [(await deployed.open())[0] for _ in range(4)]
        await stream(clients, 2)
        deployed.balancer.wait_status(replica1="DOWN", replica2="DOWN")
        down_since = time.monotonic()
        # 0.8 s of real-time speech on every session (health checks every 0.5 s, all DOWN),
        # read while it is sent.
        pcm = speech_frames(10, offset_s=2.0)

        async def talk(client: Client) -> None:
            for frame in pcm:
                await client.send(f32_append(frame))
                await asyncio.sleep(0.08)

        await asyncio.gather(*(talk(c) for c in clients), *(c.wait_audio_frames(2 + len(pcm)) for c in clients))
        assert time.monotonic() - down_since > 0.75
        deployed.balancer.wait_status(timeout=0, replica1="DOWN", replica2="DOWN")
        for client in clients:
            late = [t for e, t in zip(client.events, client.times)
                    if e["type"] == "response.output_audio.delta" and t > down_since]
            assert len(late) >= len(pcm), "audio stopped while the replica was marked full"
            assert client.close_code is None
            assert not [e for e in client.events if e["type"] in ("error", "session.closed")]
        assert deployed.live() == {"replica1": 2, "replica2": 2}

    run(scenario())


@EVEN
def test_a_freed_slot_takes_new_sessions_again(deployed: Deployment):
    deployed.settle()

    async def scenario():
        opened = [await deployed.open() for _ in range(4)]
        deployed.balancer.wait_status(replica1="DOWN", replica2="DOWN")
        for target in NAMES:
            leaving = next(client for client, name in opened if name == target)
            opened = [(c, n) for c, n in opened if c is not leaving]
            await leaving.send({"type": "session.close"})
            await leaving.wait_closed()
            deployed.replicas[target].wait_free_slots(1)
            other = next(n for n in NAMES if n != target)
            deployed.balancer.wait_status(**{target: "UP", other: "DOWN"})
            client, name = await deployed.open()
            assert name == target, "the new session must land on the replica with the free slot"
            opened.append((client, name))
            await stream([client], 2)
            deployed.balancer.wait_status(replica1="DOWN", replica2="DOWN")
        assert deployed.live() == {"replica1": 2, "replica2": 2}
        assert_capacity_refusal(*await deployed.refused())

    run(scenario())


@EVEN
def test_a_full_replicas_503_is_retried_on_another(deployed: Deployment):
    """The gap between a replica filling up and its next health check: HAProxy still thinks it
    has room, sends the upgrade there, gets 503 and retries on the other replica."""
    deployed.settle()
    balancer = deployed.balancer
    replica1 = deployed.replicas["replica1"]

    async def scenario():
        # Replica 2 carries one session through the balancer (replica 1 is in maintenance
        # meanwhile), replica 1 none: least connections now prefers replica 1.
        balancer.command(f"disable server {BACKEND}/replica1")
        first, name = await deployed.open()
        assert name == "replica2"
        balancer.command(f"enable server {BACKEND}/replica1")
        balancer.wait_status(replica1="UP")
        # Fill replica 1 behind HAProxy's back, its health checks off: HAProxy still thinks it
        # has room.
        balancer.command(f"disable health {BACKEND}/replica1")
        for _ in range(2):
            await (await Client.connect(replica1.ws + "/v1/realtime")).open()
        assert balancer.servers()["replica1"]["status"] == "no check"
        refusals = replica1.metric("personaplex_sessions_refused_total")
        retries = balancer.counter("replica1", "wretr")
        second, name = await deployed.open()
        assert name == "replica2"
        assert replica1.metric("personaplex_sessions_refused_total") == refusals + 1, "replica 1 never saw the upgrade"
        assert balancer.counter("replica1", "wretr") == retries + 1, "HAProxy counted no retry"
        await stream([first, second], 2)

    try:
        run(scenario())
    finally:
        balancer.command(f"enable health {BACKEND}/replica1")


@UNEVEN
def test_unequal_capacities_fill_completely(deployed: Deployment):
    """Replica 1 holds one session, replica 2 three: four sessions all succeed (replica 1 once
    full is skipped, by its health check or by the retry of its 503), the fifth is refused."""
    deployed.settle()

    async def scenario():
        clients = [(await deployed.open())[0] for _ in range(4)]
        assert deployed.live() == {"replica1": 1, "replica2": 3}
        # At once, before the health checks may have caught up: retries end in a 503 too.
        assert_capacity_refusal(*await deployed.refused())
        await stream(clients, 2)
        deployed.balancer.wait_status(replica1="DOWN", replica2="DOWN")
        assert_capacity_refusal(*await deployed.refused())
        assert deployed.live() == {"replica1": 1, "replica2": 3}

    run(scenario())
