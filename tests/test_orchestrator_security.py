"""Access control on a real server bound to 0.0.0.0 (so API keys are required by default):
the three ways to present a key, Origin checks, per-address and per-key limits (addresses
told apart through a trusted proxy's X-Forwarded-For), the per-socket event rate, and the
refusal to start a public server without keys.  The pure pieces are tested on their own
with a fake clock."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys

import pytest
import websockets

from orchestrator.frontend.access import AccessPolicy
from orchestrator.frontend.limits import ClientLimits, EventRate
from orchestrator.frontend.listeners import ListenerWatch, bind_host, find_listeners, is_loopback
from orchestrator.settings import Settings, SettingsError
from tests.native_support import NativeClient, chat_url, ogg_pages
from tests.orch_support import REPO, Client, Server, f32_append, run, speech_frames, works

KEYS = ("key-a", "key-b", "key-c")
_ADDRESSES = (f"198.51.100.{i}" for i in itertools.count(1))


@pytest.fixture(scope="module")
def public_server():
    """0.0.0.0 with keys; 127.0.0.1 is a trusted proxy, so each test can be its own client
    address; at most 2 sockets per address, 5 opens a minute per address, 1 per key."""
    server = Server(host="0.0.0.0", max_sessions=3, silence_grace_s=0, api_keys=",".join(KEYS),
                    allowed_origins="https://app.example", trusted_proxies="127.0.0.1/32",
                    max_sessions_per_key=1, max_sessions_per_ip=2, opens_per_minute_per_ip=5,
                    max_events_per_s=40, first_message_timeout_s=3)
    yield server
    server.stop()
    server.assert_clean_log()


async def connect(server: Server, key: str | None = "key-a", address: str | None = None, **kwargs) -> Client:
    """A websocket from ``address`` (a fresh one by default) presenting ``key`` as a bearer token."""
    headers = {"X-Forwarded-For": address or next(_ADDRESSES)}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return await Client.connect(server.ws + "/v1/realtime" + kwargs.pop("query", ""), additional_headers=headers,
                                **kwargs)


def refused_status(server: Server, **kwargs) -> int:
    async def attempt():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await connect(server, **kwargs)
        return refused.value.response.status_code

    return run(attempt())


def test_public_bind_requires_a_key_presented_any_of_three_ways(public_server: Server):
    before = public_server.metric('personaplex_connections_refused_total{reason="auth"}')
    assert refused_status(public_server, key=None) == 401
    assert refused_status(public_server, key="not-a-key") == 401
    assert refused_status(public_server, key=None, query="?api_key=nope") == 401
    assert public_server.metric('personaplex_connections_refused_total{reason="auth"}') == before + 3

    async def scenario():
        await works(await connect(public_server, key="key-a"))
        public_server.wait_free_slots(3)
        await works(await connect(public_server, key=None, query="?api_key=key-b"))
        public_server.wait_free_slots(3)
        # A browser: the key in a subprotocol, and "realtime" is the one accepted.
        client = await connect(public_server, key=None, subprotocols=["realtime", "openai-insecure-api-key.key-c"])
        assert client.ws.subprotocol == "realtime"
        await works(client)
        public_server.wait_free_slots(3)
        client = await connect(public_server, key=None, subprotocols=["openai-insecure-api-key.key-c"])
        assert client.ws.subprotocol == "openai-insecure-api-key.key-c"
        await works(client)

    run(scenario())
    assert public_server.get("/health") == (200, {"status": "healthy"})


def test_browser_origins(public_server: Server):
    assert refused_status(public_server, origin="https://evil.example") == 403
    assert refused_status(public_server, origin="null") == 403

    async def scenario():
        for origin in ("https://app.example", f"http://127.0.0.1:{public_server.port}"):  # allowed, same origin
            client = await connect(public_server, origin=origin)
            await works(client)
            public_server.wait_free_slots(3)

    run(scenario())
    assert public_server.metric('personaplex_connections_refused_total{reason="origin"}') == 2


def test_limits_per_key_and_per_address(public_server: Server):
    public_server.wait_free_slots(3)

    async def scenario():
        first = await connect(public_server, key="key-a")
        await first.open()
        second = await connect(public_server, key="key-a")  # same key, other address
        error = await second.next("error")
        assert error["error"]["code"] == "session_limit_exceeded"
        assert error["error"]["type"] == "rate_limit_error" and error["error"]["retryable"] is True
        assert await second.wait_closed() == (1013, "session_limit_exceeded")
        # Another key is unaffected; a third socket from one address is not.
        address = next(_ADDRESSES)
        idle = await connect(public_server, key="key-b", address=address)  # a handshake counts too
        other = await connect(public_server, key="key-c", address=address)
        await other.open()
        third = await connect(public_server, key="key-b", address=address)
        assert (await third.next("error"))["error"]["code"] == "session_limit_exceeded"
        await idle.close()
        await other.close()
        await first.close()
        public_server.wait_free_slots(3)
        await works(await connect(public_server, key="key-a"))  # the key is free again

    run(scenario())


def test_open_rate_per_address(public_server: Server):
    public_server.wait_free_slots(3)
    address = next(_ADDRESSES)

    async def scenario():
        for _ in range(5):  # the bucket holds one minute: 5 opens
            client = await connect(public_server, key="key-b", address=address)
            await client.close()
        refused = await connect(public_server, key="key-b", address=address)
        error = await refused.next("error")
        assert error["error"]["code"] == "open_rate_limited" and 0 < error["error"]["retry_after_s"] <= 12
        assert (await refused.wait_closed())[0] == 1013
        await works(await connect(public_server, key="key-b"))  # another address is not limited

    run(scenario())


def test_event_rate_limit_drops_a_flood_and_the_session_goes_on(public_server: Server):
    public_server.wait_free_slots(3)
    before = public_server.metric("personaplex_events_dropped_total")

    async def scenario():
        client = await connect(public_server, key="key-c")
        await client.open()
        for _ in range(300):  # 40/s allowed, bursts of 80
            await client.send({"type": "session.heartbeat"})
        error = await client.next("error")
        assert error["error"]["code"] == "event_rate_exceeded" and error["error"]["type"] == "rate_limit_error"
        events = await client.drain(1.5)
        errors = [e for e in client.events if e["type"] == "error"]
        assert len(errors) <= 2, "a flood must get a trickle of errors, not one per event"
        acks = [e for e in client.events if e["type"] == "session.heartbeat_ack"]
        assert 70 <= len(acks) < 200, len(acks)
        assert not [e for e in events if e["type"] == "session.closed"]
        for frame in speech_frames(3):
            await client.send(f32_append(frame))
        await client.wait_audio_frames(3)
        await client.close()

    run(scenario())
    assert public_server.metric("personaplex_events_dropped_total") >= before + 100


def test_the_native_route_has_the_same_gate_and_limits(public_server: Server):
    """``/api/chat`` sits behind the Realtime route's gate.  NVIDIA's page can only put a key
    in its URL (``?api_key=``); served from elsewhere (its ``?worker_addr=``) its origin must
    be allowed; the per-key limit counts the sessions of both protocols."""
    public_server.wait_free_slots(3)

    def chat(key: str | None) -> str:
        return chat_url(public_server.ws, text_prompt="", voice_prompt="NATF2.pt",
                        **({"api_key": key} if key else {}))

    async def status(url: str, **kwargs) -> int:
        with pytest.raises(websockets.InvalidStatus) as refused:
            await NativeClient.connect(url, additional_headers={"X-Forwarded-For": next(_ADDRESSES)}, **kwargs)
        return refused.value.response.status_code

    async def scenario():
        assert await status(chat(None)) == 401
        assert await status(chat("not-a-key")) == 401
        assert await status(chat("key-a"), origin="https://evil.example") == 403
        page = await NativeClient.connect(chat("key-a"), origin="https://app.example",
                                          additional_headers={"X-Forwarded-For": next(_ADDRESSES)})
        await page.handshake()
        realtime = await connect(public_server, key="key-a")  # the same key on the other route
        assert (await realtime.next("error"))["error"]["code"] == "session_limit_exceeded"
        second = await NativeClient.connect(chat("key-a"), additional_headers={"X-Forwarded-For": next(_ADDRESSES)})
        assert await second.wait_closed() == (1013, "session_limit_exceeded")
        assert second.errors[0].startswith("session_limit_exceeded: ")
        await page.send_pages(ogg_pages(speech_frames(4)))
        await page.wait_for(lambda: page.audio_frames() >= 4)
        await page.close()

    run(scenario())


def test_public_server_without_keys_refuses_to_start():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PERSONAPLEX_WARMUP_FRAMES": "0"}
    proc = subprocess.run([sys.executable, "-m", "hypercorn", "orchestrator:app", "--bind", "0.0.0.0:0"],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    # It exits instead of serving (hypercorn 0.18's parent may still report 0: its worker's
    # exit code can be read before the worker is reaped).
    output = proc.stdout + proc.stderr
    assert "API keys are required" in output and "Running on" not in output


# Pure pieces ----------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_client_limits_concurrency_rate_and_forgetting():
    clock = FakeClock()
    limits = ClientLimits("address", max_concurrent=2, per_minute=3, clock=clock)
    assert limits.acquire("a") is None and limits.acquire("a") is None
    assert limits.acquire("a").code == "session_limit_exceeded"
    limits.release("a")
    assert limits.acquire("a") is None  # the third open of the minute
    limits.release("a")
    refusal = limits.acquire("a")  # a fourth: the bucket is empty (a refused one took nothing)
    assert refusal.code == "open_rate_limited" and refusal.retry_after_s == pytest.approx(20.0)
    clock.now += 20.0
    assert limits.acquire("a") is None
    assert limits.held("a") == 2 and limits.acquire("b") is None
    for _ in range(2):
        limits.release("a")
    limits.release("b")
    clock.now += 60.0
    limits.release("b")  # an extra release is harmless
    assert limits.acquire("c") is None and limits.held("c") == 1
    limits.release("c")
    concurrent_only = ClientLimits("key", 1, 0, clock=clock)
    assert concurrent_only.acquire("k") is None and concurrent_only.acquire("k").code == "session_limit_exceeded"
    concurrent_only.release("k")
    assert len(concurrent_only) == 0, "a client holding nothing, with nothing to refill, is forgotten at once"
    off = ClientLimits("key", 0, 0, clock=clock)
    assert not off.enabled and all(off.acquire("k") is None for _ in range(1000))


def test_client_limits_table_stays_bounded_under_an_address_flood():
    clock = FakeClock()
    limits = ClientLimits("address", max_concurrent=0, per_minute=60, clock=clock)
    for i in range(20000):
        assert limits.acquire(f"10.0.{i // 256}.{i % 256}") is None
        limits.release(f"10.0.{i // 256}.{i % 256}")
        clock.now += 1.0
    assert len(limits) < 5000


def test_event_rate_allows_bursts_then_reports_once_a_second():
    clock = FakeClock()
    rate = EventRate(10, clock=clock)
    assert sum(rate.allow() for _ in range(100)) == 20
    assert rate.should_report() and not rate.should_report()
    assert rate.take_dropped() == 80 and rate.take_dropped() == 0
    clock.now += 1.0
    assert rate.should_report() and sum(rate.allow() for _ in range(100)) == 10
    assert all(EventRate(0, clock=clock).allow() for _ in range(1000))
    data = EventRate(0, byte_rate=100, min_byte_burst=500, clock=clock)  # 2 s of bytes < one big event
    assert data.allow(450) and not data.allow(100) and data.allow(50)
    clock.now += 1.0
    assert data.allow(100) and not data.allow(1)


def _policy(**settings) -> AccessPolicy:
    return AccessPolicy(Settings(**settings), [])


def test_access_policy_keys_origins_and_proxies():
    with pytest.raises(SettingsError, match="API keys are required"):
        _policy(bind=("0.0.0.0:8000",))
    with pytest.raises(SettingsError, match="no API keys"):
        _policy(bind=("127.0.0.1:8000",), auth="required")
    with pytest.raises(SettingsError, match="API keys are required"):
        _policy()  # nothing known about the address: treated as public
    assert not _policy(bind=("0.0.0.0:8000",), auth="off").require_key
    assert not _policy(bind=("127.0.0.1:8000", "unix:/tmp/x.sock")).require_key
    # Keyless because loopback: browsers only under a loopback Host (DNS rebinding).
    local = _policy(bind=("127.0.0.1:8000",))
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost"):
        assert local.origin_allowed({"Origin": f"http://{host}", "Host": host}), host
    assert not local.origin_allowed({"Origin": "http://rebind.example:8000", "Host": "rebind.example:8000"})
    assert local.origin_allowed({"Host": "rebind.example:8000"})  # not a browser: nothing to rebind
    listed = _policy(bind=("127.0.0.1:8000",), allowed_origins=("http://app.example",))
    assert listed.origin_allowed({"Origin": "http://app.example", "Host": "app.example"})
    assert not _policy(bind=("127.0.0.1:8000",), auth="off").loopback_hosts_only
    policy = _policy(bind=("[::]:8000",), api_keys=("k1",), allowed_origins=("https://a.example/",),
                     trusted_proxies=("10.0.0.0/8",))
    assert policy.require_key and policy.public
    assert policy.authenticate({"Authorization": "Bearer k1"}, {}, []).key_id
    assert policy.authenticate({"Authorization": "bearer k2"}, {}, []) is None
    assert policy.authenticate({}, {"api_key": "k1"}, []) is not None
    caller = policy.authenticate({}, {}, ["openai-beta.realtime-v1", "openai-insecure-api-key.k1"])
    assert caller.subprotocol == "openai-beta.realtime-v1"
    assert policy.origin_allowed({}) and policy.origin_allowed({"Origin": "https://A.example"})
    assert policy.origin_allowed({"Origin": "http://h:1", "Host": "h:1"})
    assert not policy.origin_allowed({"Origin": "http://h:1", "Host": "h:2"})
    proxied = {"Origin": "https://public.example", "Host": "backend:8000", "X-Forwarded-Host": "public.example"}
    assert policy.origin_allowed(proxied, "10.0.0.5") and not policy.origin_allowed(proxied, "192.0.2.7")
    headers = {"X-Forwarded-For": "203.0.113.9, 10.1.1.1"}
    assert policy.client_address({"client": ("10.2.2.2", 5)}, headers) == "203.0.113.9"
    assert policy.client_address({"client": ("192.0.2.1", 5)}, headers) == "192.0.2.1"  # untrusted peer
    assert policy.client_address({"client": ("10.2.2.2", 5)}, {}) == "10.2.2.2"
    # A proxy that appends a second header line: the client's own (spoofable) line comes
    # first, the proxy's view of the client last; every line counts.
    from werkzeug.datastructures import Headers

    two_lines = Headers([("X-Forwarded-For", "198.51.100.7"), ("X-Forwarded-For", "203.0.113.9")])
    assert policy.client_address({"client": ("10.2.2.2", 5)}, two_lines) == "203.0.113.9"


def test_listeners_are_found_and_their_closing_is_seen():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.com")
    assert bind_host("[::1]:80") == "::1" and bind_host("0.0.0.0:80") == "0.0.0.0"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not yet listening: how hypercorn's look at start-up
    mine = [item for item in find_listeners() if item.fd == sock.fileno()]
    assert len(mine) == 1 and mine[0].local and mine[0].port == sock.getsockname()[1]
    sock.listen()
    peer = socket.create_connection(sock.getsockname())
    assert peer.fileno() not in {item.fd for item in find_listeners()}, "a connected socket is no listener"
    watch = ListenerWatch(mine)
    assert not watch.closed()
    sock.close()
    assert watch.closed()
    peer.close()
