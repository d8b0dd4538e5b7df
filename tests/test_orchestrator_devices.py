"""One engine per device (``PERSONAPLEX_DEVICES``): placement on the engine with the most free
slots, per-device capacity in ``/ready`` and ``/metrics``, the balancer's
``/ready?require_free_slot=1``, ``PERSONAPLEX_REFUSE_WHEN_FULL=http``, and random weights
(``PERSONAPLEX_CHECKPOINT=random:...``).

The servers run two CPU engines (``cpu,cpu``): the same code as one engine per GPU, with
real sessions and real speech.  What needs a GPU (``cuda:N`` resolution, the 7B random
engine) is checked here up to the point where a GPU would be touched."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import websockets

from orchestrator.frontend.engine_pool import DeviceEngine, EnginePool
from orchestrator.engine_port import EngineCall
from orchestrator.metrics import Metrics
from orchestrator.settings import Settings, SettingsError, device_labels
from tests.orch_support import Client, Server, f32_append, run, speech_frames

PERSONA = "You are a concise and helpful assistant."


@pytest.fixture(scope="module")
def two_cpu_server():
    """Two CPU engines of two sessions each; no silence feeding (outputs follow inputs only)."""
    server = Server(devices="cpu,cpu", max_sessions=2, silence_grace_s=0)
    yield server
    server.stop()
    server.assert_clean_log()


def live_per_device(server: Server) -> list[int]:
    return [device["live_sessions"] for device in server.get("/ready")[1]["devices"]]


def wait_live(server: Server, expected: list[int], timeout: float = 10.0) -> None:
    """Closing is asynchronous (the engine releases the slot, then admission follows)."""
    for _ in range(int(timeout / 0.05)):
        if live_per_device(server) == expected:
            return
        time.sleep(0.05)
    assert live_per_device(server) == expected


async def open_client(server: Server, **session) -> tuple[Client, str]:
    client = await Client.connect(server.ws + "/v1/realtime")
    opened = await client.open(instructions=PERSONA, temperature=0, **session)
    return client, opened["id"]


def placed_on(server: Server, session_id: str, timeout: float = 10.0) -> str:
    """The device a session was placed on, from the server's log line (which may reach the
    test's log reader a little after the client got session.created)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in server.logs().splitlines():
            if f"session {session_id} opened on " in line:
                return line.split(" opened on ")[1].split()[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no placement logged for {session_id}")
        time.sleep(0.02)


# Placement, capacity, refusal --------------------------------------------------------------------

def test_sessions_spread_over_devices_and_the_fifth_is_refused(two_cpu_server: Server):
    server = two_cpu_server
    server.wait_free_slots(4)
    status, body = server.get("/ready")
    assert status == 200 and (body["max_sessions"], body["free_slots"], body["live_sessions"]) == (4, 4, 0)
    assert [(d["device"], d["ready"], d["max_sessions"]) for d in body["devices"]] == [
        ("cpu#0", True, 2), ("cpu#1", True, 2)]
    refused_before = server.metric("personaplex_sessions_refused_total")

    async def scenario():
        clients, placements = [], []
        # Most free slots first, ties to the lowest index: 0, 1, 0, 1.
        for expected in ([1, 0], [1, 1], [2, 1], [2, 2]):
            assert server.get("/ready?require_free_slot=1")[0] == 200
            client, session_id = await open_client(server)
            clients.append(client)
            placements.append(placed_on(server, session_id))
            assert live_per_device(server) == expected
        assert placements == ["cpu#0", "cpu#1", "cpu#0", "cpu#1"]
        assert server.metric('personaplex_device_sessions_live{device="cpu#0"}') == 2
        assert server.metric('personaplex_device_slots_free{device="cpu#1"}') == 0
        assert server.metric("personaplex_sessions_live") == 4 and server.metric("personaplex_max_sessions") == 4

        # Full everywhere: the balancer check says so; plain /ready still says "up".
        status, body = server.get("/ready?require_free_slot=1")
        assert status == 503 and body["reason"] == "full" and body["free_slots"] == 0
        assert server.get("/ready")[0] == 200
        fifth = await Client.connect(server.ws + "/v1/realtime")
        await fifth.send({"type": "session.update", "session": {}})
        error = await fifth.next("error")
        assert error["error"]["code"] == "resource_exhausted" and error["error"]["type"] == "rate_limit_error"
        assert error["error"]["message"] == "duplex_session_capacity_exhausted: limit=4"
        assert (await fifth.wait_closed())[0] == 1013

        # Closing a session of cpu#1 frees a slot there, and the next session goes there.
        await clients[1].send({"type": "session.close"})
        await clients[1].wait_closed()
        wait_live(server, [2, 1])
        assert server.get("/ready?require_free_slot=1")[0] == 200
        client, session_id = await open_client(server)
        assert placed_on(server, session_id) == "cpu#1" and live_per_device(server) == [2, 2]
        for c in clients + [client]:
            await c.close()

    run(scenario())
    assert server.metric("personaplex_sessions_refused_total") == refused_before + 1
    wait_live(server, [0, 0])


def test_opens_at_once_go_to_another_device_when_the_first_turns_them_down(two_cpu_server: Server):
    """Four opens sent together: the worker hears of an admitted open only when its prefill is
    done, so all four are first placed on cpu#0 (the most free slots, lowest index); its
    engine admits two and turns two down, and those are placed again, on cpu#1.  None is
    refused while a device has room."""
    server = two_cpu_server
    server.wait_free_slots(4)
    refused_before = server.metric("personaplex_sessions_refused_total")

    async def scenario():
        clients = [await Client.connect(server.ws + "/v1/realtime") for _ in range(4)]
        await asyncio.gather(*(c.send({"type": "session.update", "session": {"instructions": PERSONA}})
                               for c in clients))
        firsts = await asyncio.gather(*(c.next(lambda e: e["type"] in ("session.created", "error"))
                                        for c in clients))
        assert [e["type"] for e in firsts] == ["session.created"] * 4, firsts
        assert sorted(placed_on(server, e["session"]["id"]) for e in firsts) == ["cpu#0", "cpu#0", "cpu#1", "cpu#1"]
        assert live_per_device(server) == [2, 2]
        for client in clients:
            await client.close()

    run(scenario())
    assert server.metric("personaplex_sessions_refused_total") == refused_before
    wait_live(server, [0, 0])


def test_audio_flows_on_both_devices(two_cpu_server: Server):
    """The same greedy session on each engine, fed the same speech, answers the same audio:
    each engine steps its own sessions, and every frame reaches the session it belongs to."""
    server = two_cpu_server
    server.wait_free_slots(4)
    ticks_before = [server.metric(f'personaplex_device_tick_duration_seconds_count{{device="cpu#{i}"}}')
                    for i in (0, 1)]
    frames = speech_frames(10)

    async def scenario():
        (a, id_a), (b, id_b) = await open_client(server), await open_client(server)
        assert (placed_on(server, id_a), placed_on(server, id_b)) == ("cpu#0", "cpu#1")
        for frame in frames:
            await a.send(f32_append(frame))
            await b.send(f32_append(frame))
        pcm_a, pcm_b = await a.wait_audio_frames(10), await b.wait_audio_frames(10)
        assert len(pcm_a) == len(pcm_b) == 10 * 1920
        assert np.abs(pcm_a.astype(np.float32)).mean() > 0
        np.testing.assert_array_equal(pcm_a, pcm_b)
        assert all(e["metadata"]["session_id"] == id_a for e in a.audio())
        assert all(e["metadata"]["session_id"] == id_b for e in b.audio())
        await a.close()
        await b.close()

    run(scenario())
    for i in (0, 1):
        ticks = server.metric(f'personaplex_device_tick_duration_seconds_count{{device="cpu#{i}"}}')
        assert ticks >= ticks_before[i] + 10
    wait_live(server, [0, 0])


@pytest.fixture(scope="module")
def http_refusing_server():
    """REFUSE_WHEN_FULL=http on two CPU engines of one slot each.  Its engines have random
    weights at the tiny model's shapes (``random:tiny``): the random-checkpoint path of
    ``random:personaplex-7b``, end to end, at a size a CPU runs."""
    server = Server(devices="cpu,cpu", max_sessions=1, silence_grace_s=0, refuse_when_full="http",
                    checkpoint="random:tiny")
    yield server
    server.stop()
    server.assert_clean_log()


def test_refuse_when_full_http_answers_503_before_the_websocket(http_refusing_server: Server):
    server = http_refusing_server
    server.wait_free_slots(2)
    status, models = server.get("/v1/models")
    assert status == 200 and models["data"][0]["root"] == "random-tiny" and models["data"][0]["demo"] is True
    assert models["data"][0]["devices"] == ["cpu#0", "cpu#1"] and models["data"][0]["max_sessions"] == 2
    assert "RANDOM WEIGHTS" in server.logs()
    frames = speech_frames(3)

    async def scenario():
        (a, _), (b, _) = await open_client(server, voice="VARF0.pt"), await open_client(server)
        for client in (a, b):  # random weights serve like any others
            for frame in frames:
                await client.send(f32_append(frame))
            await client.wait_audio_frames(3)
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(server.ws + "/v1/realtime", proxy=None)
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert json.loads(response.body) == {"error": {
            "type": "rate_limit_error", "code": "resource_exhausted",
            "message": "duplex_session_capacity_exhausted: limit=2"}}
        await a.close()
        server.wait_free_slots(1)
        (c, _) = await open_client(server)  # a free slot again: the handshake is accepted
        await b.close()
        await c.close()

    run(scenario())
    assert server.metric("personaplex_sessions_refused_total") == 1


# Settings -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices, message", [
    ("0,0", "lists cuda:0 twice"),
    ("cuda:1,1", "lists cuda:1 twice"),
    ("gpu0", "'gpu0' is not a device"),
    ("cuda", "'cuda' is not a device"),
    ("all,0", "'all' cannot be combined"),
    ("-1", "'-1' is not a device"),
])
def test_devices_setting_is_validated(devices: str, message: str):
    with pytest.raises(SettingsError, match=message) as refused:
        Settings.from_env({"PERSONAPLEX_DEVICES": devices})
    assert "PERSONAPLEX_DEVICES" in str(refused.value)


def test_devices_resolution(monkeypatch: pytest.MonkeyPatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert Settings().resolved_devices() == ["cpu"]  # unset: the one engine of PERSONAPLEX_DEVICE
    with pytest.raises(SettingsError, match="PERSONAPLEX_DEVICE=cuda:3 but CUDA is not available here"):
        Settings(device="cuda:3").resolved_devices()  # asked for, absent: refused at start (issue 16)
    assert Settings.from_env({"PERSONAPLEX_DEVICES": "cpu, cpu"}).resolved_devices() == ["cpu", "cpu"]
    with pytest.raises(SettingsError, match="set PERSONAPLEX_DEVICE or PERSONAPLEX_DEVICES"):
        Settings(device="cpu", devices=("cpu",))
    with pytest.raises(SettingsError, match=r"names cuda:0 but 0 CUDA device\(s\) are visible"):
        Settings(devices=("0",)).resolved_devices()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SettingsError, match=r"names cuda:2 but 2 CUDA device\(s\) are visible"):
        Settings(devices=("0", "2")).resolved_devices()
    assert Settings(devices=("1", "cuda:0")).resolved_devices() == ["cuda:1", "cuda:0"]
    assert Settings(device="cuda:1").resolved_devices() == ["cuda:1"]
    with pytest.raises(SettingsError, match=r"PERSONAPLEX_DEVICE=cuda:3 but 2 CUDA device\(s\) are visible"):
        Settings(device="cuda:3").resolved_devices()
    assert Settings(devices=("all",)).resolved_devices() == ["cuda:0", "cuda:1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SettingsError, match="all but no CUDA device is visible"):
        Settings(devices=("all",)).resolved_devices()


def test_refuse_when_full_and_random_checkpoint_settings():
    with pytest.raises(SettingsError, match="PERSONAPLEX_REFUSE_WHEN_FULL must be one of event, http"):
        Settings(refuse_when_full="503")
    assert Settings(checkpoint="random:personaplex-7b").checkpoint == "random:personaplex-7b"
    with pytest.raises(SettingsError, match="unknown random model 'llama'; available: random:personaplex-7b"):
        Settings(checkpoint="random:llama")
    with pytest.raises(SettingsError, match="needs PERSONAPLEX_BACKEND=torch"):
        Settings(checkpoint="random:personaplex-7b", backend="trtllm")
    with pytest.raises(SettingsError, match="is neither a directory nor a Hugging Face repo id"):
        Settings(checkpoint="personaplex-7b")
    assert Settings(checkpoint="nvidia/personaplex-7b-v1@main").checkpoint == "nvidia/personaplex-7b-v1@main"
    with pytest.raises(SettingsError, match="is not a directory .a build directory"):
        Settings(checkpoint="nvidia/personaplex-7b-v1", backend="trtllm")


def test_admission_on_a_gpu_is_the_engines_memory_plan():
    """On a GPU the torch backend's admission is left to the engine's memory plan (None:
    "auto"); a number is taken as it is (the engine checks it fits); CPU admits 8 unless a
    memory limit asks for a plan there too."""
    assert Settings(checkpoint="random:personaplex-7b").resolved_max_sessions("cuda:0") is None
    assert Settings.from_env({"PERSONAPLEX_MAX_SESSIONS": "auto"}).max_sessions is None
    assert Settings(checkpoint="random:personaplex-7b", max_sessions=3).resolved_max_sessions("cuda:0") == 3
    assert Settings().resolved_max_sessions("cpu") == 8
    assert Settings(memory_limit_gb=1.0).resolved_max_sessions("cpu") is None
    with pytest.raises(SettingsError, match="PERSONAPLEX_MAX_SESSIONS must be int"):
        Settings.from_env({"PERSONAPLEX_MAX_SESSIONS": "most"})
    memory = Settings(concurrent_joins=2, prefill_cache_gb=0.5).memory_settings()
    assert (memory.concurrent_joins, memory.prefill_cache_bytes) == (2, 1 << 29)
    assert memory.sessions_setting == "PERSONAPLEX_MAX_SESSIONS"


def test_random_checkpoint_builds_through_the_benchmark_engine(monkeypatch: pytest.MonkeyPatch):
    """create_engine("random:personaplex-7b") is engines.checkpoints.random_model.build_random_engine at the 7B
    shapes with the tiny checkpoint's tokenizer and voice names (recorded, not built: 7B on CPU
    is too slow; random:tiny builds for real in the server test above)."""
    from engines.checkpoints import random_model
    from engines.config import LMConfig, MimiConfig
    from engines.runtime.factory import create_engine
    from engines.checkpoints.tiny import TINY_VOICES

    calls = []
    monkeypatch.setattr(random_model, "build_random_engine", lambda *args, **kwargs: calls.append((args, kwargs)) or "built")
    assert create_engine("random:personaplex-7b", max_slots=3, device="cpu", kv_cache="auto", compile="auto") == "built"
    (args, kwargs), = calls
    assert args[:2] == (3, "cpu") and args[2].name == "tokenizer_spm_32k_3.model"
    assert kwargs["lm_cfg"] == LMConfig() and kwargs["mimi_cfg"] == MimiConfig()
    assert kwargs["voice_names"] == tuple(TINY_VOICES) and kwargs["model_name"] == "random-personaplex-7b"
    assert kwargs["compile"] is False  # auto: off on CPU, as for real checkpoints


def test_random_voices_have_the_model_width():
    from engines.runtime.factory import create_engine

    engine = create_engine("random:tiny", max_slots=1, device="cpu")
    assert engine.voices() == ["NATF2.pt", "NATM1.pt", "VARF0.pt"]
    prompt = engine.voice_store.load("NATM1.pt")
    assert prompt.embeddings.shape == (59, engine.cfg.dim) and prompt.cache.shape == (17, 4)
    assert not prompt.embeddings.equal(engine.voice_store.load("NATF2.pt").embeddings)


# Placement and metrics units ---------------------------------------------------------------------

class FakePort:
    """An ``EnginePort`` whose state is set by hand (what a DeviceEngine reads of it); its
    commands are not used here."""

    def __init__(self, state: str, device: str, capacity: int = 2, held: int = 0) -> None:
        self.device = device
        self.ready = threading.Event()
        if state != "loading":
            self.ready.set()
        self.load_error = RuntimeError("out of memory") if state == "failed" else None
        self.alive = state != "failed"
        self.is_ready = state == "ready"
        self.busy = None
        self.failed_ticks_in_row = 0
        self.info = None
        self.voices = ()
        self.memory_plan = None
        self.engine_pid = 4242
        self.max_sessions = capacity
        self.held = held  # admitted by the engine, every worker's
        self.sessions_by_worker = {}
        self.first_status = asyncio.Event()

    def loading_status(self):
        return None

    async def refresh(self): ...

    def start(self, deliver): ...

    def request_stop(self): ...

    def stop(self, timeout=0.0): ...

    def open(self, key, spec): raise AssertionError("not used")

    def close(self, key): raise AssertionError("not used")

    def restart(self, key, epoch): ...

    def push(self, key, epoch, frames): ...

    def drop_pending(self, key): ...

    def pending(self, key):
        return 0


def test_the_link_and_the_test_fake_are_engine_ports():
    """Every member of ``EnginePort`` is there on the engine process's link and this file's
    fake (the Protocol is for type checkers; this checks it where the tests run)."""
    from orchestrator.engine_port import EnginePort
    from orchestrator.frontend.engine_link import EngineLink

    members = set(EnginePort.__annotations__) | {name for name in vars(EnginePort) if not name.startswith("_")}
    link = EngineLink(0, "cuda:0", "ipc:///nonexistent")
    for port in (link, FakePort("ready", "cpu")):
        assert {m for m in members if not hasattr(port, m)} == set(), type(port).__name__


def make_pool(states: list[str], free: list[int], capacity: int = 2) -> EnginePool:
    engines = []
    for index, state in enumerate(states):
        port = FakePort(state, f"cuda:{index}", capacity, held=capacity - free[index])
        engine = DeviceEngine(index, port.device, port, watchdog_deadline_s=1.0, metrics=Metrics(),
                              on_stall=lambda *args: None)
        if state == "stalled":  # a tick running for 5 s, past the 1 s deadline
            port.busy = EngineCall("tick", time.monotonic() - 5.0, 1)
            engine.watchdog.check()
        engines.append(engine)
    return EnginePool(engines)


def test_placement_prefers_serving_engines_with_most_free_slots():
    pool = make_pool(["loading", "ready", "ready", "stalled", "failed"], free=[2, 1, 2, 2, 2])
    assert [e.state for e in pool.engines] == ["loading", "ready", "ready", "stalled", "failed"]
    assert pool.choose().label == "cuda:2"
    pool.engines[2].port.held = 1  # now 1 free on both ready ones: the lower index
    assert pool.choose().label == "cuda:1"
    pool.engines[1].port.held = pool.engines[2].port.held = 2  # the ready ones are full: the loading one
    assert pool.choose().label == "cuda:0"
    pool.engines[0].port.held = 2
    assert pool.choose() is None and pool.unavailable() is None
    assert pool.choose(at_open=True).label == "cuda:1"  # at an open: the serving ones are asked anyway
    assert pool.choose(at_open=True, exclude=pool.engines[1:3]).label == "cuda:0"  # they refused: the loading one
    assert pool.choose(at_open=True, exclude=pool.engines[:3]) is None  # never a stalled or failed one


def test_no_serving_engine_is_reported_per_device():
    stalled = make_pool(["stalled", "failed"], free=[2, 2]).unavailable()
    assert stalled.code == "engine_stalled" and stalled.message.startswith("cuda:0: engine stalled")
    failed = make_pool(["failed", "failed"], free=[2, 2]).unavailable()
    assert failed.code == "engine_unavailable"
    assert failed.message == ("cuda:0: the model failed to load: out of memory; "
                              "cuda:1: the model failed to load: out of memory")
    single = make_pool(["failed"], free=[2]).unavailable()
    assert single.message == "the model failed to load: out of memory"  # one engine: as before


def test_device_labels_are_unique():
    assert device_labels(["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert device_labels(["cpu", "cuda:0", "cpu"]) == ["cpu#0", "cuda:0", "cpu#2"]


def test_per_device_metrics_exposition():
    metrics = Metrics()
    metrics.devices = lambda: [{"device": "cuda:0", "ready": True, "state": "ready", "live_sessions": 3,
                                "free_slots": 1, "max_sessions": 4},
                               {"device": "cuda:1", "ready": False, "state": "stalled", "live_sessions": 0,
                                "free_slots": 4, "max_sessions": 4}]
    for device in ("cuda:0", "cuda:1"):
        metrics.declare_device(device)  # what each DeviceEngine does when it is built
    metrics.observe_tick(0.015, 3, 0, device="cuda:0", live=4)
    metrics.observe_tick(0.05, 1, 0, device="cuda:0", live=4)
    text = metrics.render()
    assert 'personaplex_device_sessions_live{device="cuda:0"} 3.0' in text
    assert 'personaplex_device_engine_stalled{device="cuda:1"} 1.0' in text
    assert 'personaplex_device_ready{device="cuda:1"} 0.0' in text
    assert 'personaplex_device_tick_duration_seconds_bucket{device="cuda:0",le="0.02"} 1.0' in text
    assert 'personaplex_device_tick_duration_seconds_count{device="cuda:0"} 2.0' in text
    assert 'personaplex_device_tick_duration_seconds_count{device="cuda:1"} 0.0' in text  # listed before its first tick
    assert 'personaplex_device_batch_size_sum{device="cuda:0"} 4.0' in text
    assert 'personaplex_device_batch_fill{device="cuda:0"} 0.25' in text  # the latest tick: 1 of 4 live
    assert "personaplex_tick_duration_seconds_count 2.0" in text  # the unlabelled totals stay
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families))
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_one_failed_engine_leaves_the_server_healthy_and_serving():
    """The engine of cpu#0 fails to load, cpu#1 serves.  /health stays 200 with the failed
    device in its detail, /ready is 200, a session opens on cpu#1, and the full refusal counts
    the whole capacity."""
    server = Server(devices="cpu,cpu", max_sessions=1, silence_grace_s=0, fault_injection="device=cpu#0,mode=fail_load")
    try:
        status, health = server.get("/health")
        assert status == 200 and health["status"] == "healthy"
        assert health["devices"][0]["device"] == "cpu#0" and health["devices"][0]["status"] == "unhealthy"
        assert health["devices"][0]["reason"].startswith("the model failed to load")
        assert health["devices"][1] == {"device": "cpu#1", "status": "healthy"}
        status, ready = server.get("/ready?require_free_slot=1")
        assert status == 200 and [d["state"] for d in ready["devices"]] == ["failed", "ready"]

        async def scenario():
            client, session_id = await open_client(server)
            assert placed_on(server, session_id) == "cpu#1"
            status, body = server.get("/ready?require_free_slot=1")
            assert (status, body["reason"]) == (503, "full")
            refused = await Client.connect(server.ws + "/v1/realtime")
            await refused.send({"type": "session.update", "session": {}})
            error = (await refused.next("error"))["error"]
            assert (error["code"], error["message"]) == ("resource_exhausted",
                                                         "duplex_session_capacity_exhausted: limit=2")
            await client.close()

        run(scenario())
    finally:
        server.stop()


def test_no_session_starts_while_another_engine_is_still_loading():
    """cpu#0 loads at once, cpu#1 takes 10 s longer.  /ready stays 503 "loading", and a session
    asked for meanwhile opens on cpu#0 only once cpu#1 is done (an engine still compiling
    would take the CPU from the other's ticks)."""
    server = Server(devices="cpu,cpu", max_sessions=1, silence_grace_s=0, wait_ready=False,
                    fault_injection="device=cpu#1,mode=slow_load,seconds=10")
    try:
        deadline = time.monotonic() + 120
        while True:
            status, ready = server.get("/ready")
            if [d["state"] for d in ready["devices"]] == ["ready", "loading"]:
                break
            assert time.monotonic() < deadline and status == 503, ready
            time.sleep(0.05)
        assert (status, ready["reason"]) == (503, "loading")

        async def scenario():
            client = await Client.connect(server.ws + "/v1/realtime")
            session_id = (await client.open(open_timeout_s=60, instructions=PERSONA, temperature=0))["id"]
            # Opened only now: cpu#1 has finished loading by the time the client hears of it.
            states = [d["state"] for d in server.get("/ready")[1]["devices"]]
            assert states == ["ready", "ready"], states
            assert placed_on(server, session_id) == "cpu#0"
            await client.close()

        run(scenario())
        assert server.get("/ready")[0] == 200
    finally:
        server.stop()
