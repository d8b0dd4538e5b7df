"""Faults injected into the engine of a real server (``PERSONAPLEX_FAULT_INJECTION``): a step
that fails for one session, one that fails before anything advanced, one that cannot say
which session failed, a step that hangs past the watchdog deadline, and a context restart
that fails.  Each time only the sessions concerned are failed, and the server goes on.  What
the clients are told (both routes) names an error id and nothing of the fault itself: the
detail is in the server's log under that id."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from orchestrator.fault_injection import FaultPlan, FaultPlanError
from tests.orch_support import Client, Server, f32_append, run, speech_frames

PLANS = ("persona=FAULT-SLOT,mode=slot,after=6; persona=FAULT-EARLY,mode=slot_early,after=6; "
         "persona=FAULT-BATCH,mode=batch,after=6; persona=FAULT-HANG,mode=hang,after=4,seconds=5; "
         "persona=FAULT-RESTART,mode=restart,after=4")
BYSTANDER = "You are a concise and helpful assistant."


@pytest.fixture(scope="module")
def faulty_server():
    """Four sessions, greedy-friendly (no silence feeding), a 2 s watchdog, and a long batch
    window so that sessions streaming together share their ticks.  The watchdog has to tell
    the injected 5 s hang from an honest step or prefill on a busy 2-core machine: at 1 s,
    an overloaded run saw a slot fault reported as a stall."""
    server = Server(max_sessions=4, silence_grace_s=0, batch_window_ms=500, watchdog_deadline_s=2.0,
                    fault_injection=PLANS)
    yield server
    server.stop()
    _assert_only_injected_failures(server.logs())


def _assert_only_injected_failures(log: str) -> None:
    """Every error the server logged comes from an injected fault or its consequences."""
    expected = ("engine.step failed", "restart_slot(", "watchdog:", "injected")
    errors = [line for line in log.splitlines() if " ERROR " in line]
    if " opened on " in log:  # some fault test ran (none would have, were they all skipped)
        assert errors, "the faults left no trace in the log"
    unexplained = [line for line in errors if not any(word in line for word in expected)]
    assert not unexplained, unexplained
    raised = re.findall(r"^(\w[\w.]*(?:Error|Fault|Exception)): (.*)$", log, re.MULTILINE)
    assert all("injected" in message for _, message in raised), raised


ERROR_ID = re.compile(r"\(error id (err_[0-9a-f]{12}); the details are in the server's log\)")
# What an exception, a library or the allocator would put in a message; none of it may reach a
# client.  (The injected faults' own texts say "injected", name slots and CUDA errors.)
INTERNALS = re.compile(r"injected|slot|CUDA|cuda|Error|Exception|Traceback|\.py\b|MiB|GiB|0x[0-9a-f]")


def assert_withheld(server: Server, message: str) -> str:
    """A client's error message that names an error id the server's log has, and no internals."""
    match = ERROR_ID.search(message)
    assert match, message
    assert not INTERNALS.search(ERROR_ID.sub("", message)), message
    deadline = time.monotonic() + 10
    while match.group(1) not in server.logs():
        assert time.monotonic() < deadline, f"{match.group(1)} is not in the server's log"
        time.sleep(0.05)
    return match.group(1)


async def open_session(server: Server, persona: str) -> Client:
    client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
    await client.open(instructions=persona, temperature=0)
    return client


async def stream(clients: list[Client], frames) -> None:
    """Send the frames to every client, interleaved (so their sessions share ticks)."""
    for frame in frames:
        for client in clients:
            await client.send(f32_append(frame))


async def victim_and_bystander(server: Server, persona: str, frames: int) -> tuple[Client, Client]:
    """A session whose persona picks a fault plan and an ordinary one, streaming together."""
    server.wait_free_slots(4)
    victim = await open_session(server, persona)
    bystander = await open_session(server, BYSTANDER)
    await stream([victim, bystander], speech_frames(frames))
    return victim, bystander


@pytest.mark.parametrize("mode", ["slot", "slot_early"])
def test_slot_fault_fails_only_its_session(faulty_server: Server, mode):
    before = faulty_server.metric('personaplex_tick_failures_total{scope="slots"}')

    async def scenario():
        persona = f"FAULT-{'SLOT' if mode == 'slot' else 'EARLY'} persona"
        victim, bystander = await victim_and_bystander(faulty_server, persona, 12)
        error = await victim.next("error")
        assert error["error"]["code"] == "engine_error" and error["error"]["type"] == "server_error"
        assert_withheld(faulty_server, error["error"]["message"])
        done = await victim.next("response.done")
        assert done["response"]["status"] == "failed"
        assert done["response"]["status_details"] == {"type": "failed", "reason": "engine_error"}
        failed_id = done["response"]["id"]
        # The bystander lost nothing: every frame, one response, no error.
        await bystander.wait_audio_frames(12)
        assert not [e for e in bystander.events if e["type"] == "error"]
        assert len({d["response_id"] for d in bystander.audio()}) == 1
        # The victim goes on in a fresh context (epoch 1, a new response).
        await stream([victim], speech_frames(3, offset_s=3.0))
        created = await victim.next("response.created")
        assert created["response"]["id"] != failed_id
        assert created["response"]["metadata"]["duplex_event"]["epoch"] == 1
        await victim.wait_audio_frames(3, response_id=created["response"]["id"])
        for client in (victim, bystander):
            await client.send({"type": "session.close"})
            assert (await client.wait_closed())[0] == 1000

    run(scenario())
    assert faulty_server.metric('personaplex_tick_failures_total{scope="slots"}') == before + 1
    faulty_server.wait_free_slots(4)


def test_unidentified_fault_fails_the_whole_tick_and_the_server_goes_on(faulty_server: Server):
    async def scenario():
        victim, bystander = await victim_and_bystander(faulty_server, "FAULT-BATCH persona", 10)
        for client in (victim, bystander):
            error = await client.next("error")
            assert error["error"]["code"] == "engine_error"
            assert "which session caused it is unknown" in error["error"]["message"]
            assert_withheld(faulty_server, error["error"]["message"])
            assert (await client.next("response.done"))["response"]["status"] == "failed"
        # Both restarted; both serve again.
        await stream([victim, bystander], speech_frames(3, offset_s=4.0))
        for client in (victim, bystander):
            created = await client.next("response.created")
            await client.wait_audio_frames(3, response_id=created["response"]["id"])
            await client.close()

    run(scenario())
    assert faulty_server.metric('personaplex_tick_failures_total{scope="batch"}') >= 1
    assert faulty_server.get("/health") == (200, {"status": "healthy"})
    faulty_server.wait_free_slots(4)


def test_stuck_tick_is_seen_by_the_watchdog(faulty_server: Server):
    faulty_server.wait_free_slots(4)
    stalls = faulty_server.metric("personaplex_tick_stalls_total")

    async def scenario():
        victim = await open_session(faulty_server, "FAULT-HANG persona")
        await stream([victim], speech_frames(8))  # its 4th step sleeps 5 s
        error = await victim.next("error", timeout=30)
        assert error["error"]["code"] == "engine_stalled" and error["error"]["retryable"] is True
        status, body = await asyncio.to_thread(faulty_server.get, "/health")
        assert status == 503 and "engine stalled" in body["reason"], body
        assert (await asyncio.to_thread(faulty_server.get, "/ready"))[0] == 503
        # An open during the stall is refused, not left waiting behind the stuck engine.
        late = await Client.connect(faulty_server.ws + "/v1/realtime")
        await late.send({"type": "session.update", "session": {}})
        refused = await late.next("error")
        assert refused["error"]["code"] == "engine_stalled"
        assert (await late.wait_closed())[0] == 1013
        # The hang ends: every frame arrives after all, and the server is healthy again.
        await victim.wait_audio_frames(8, timeout=60)
        assert [e["error"]["code"] for e in victim.events if e["type"] == "error"] == ["engine_stalled"]
        for _ in range(50):
            if (await asyncio.to_thread(faulty_server.get, "/health"))[0] == 200:
                break
            await asyncio.sleep(0.1)
        assert faulty_server.get("/health") == (200, {"status": "healthy"})
        await victim.close()

    run(scenario())
    assert faulty_server.metric("personaplex_tick_stalls_total") == stalls + 1
    assert faulty_server.metric("personaplex_engine_stalled") == 0
    faulty_server.wait_free_slots(4)


def test_failed_restart_closes_only_that_session(faulty_server: Server):
    async def scenario():
        victim, bystander = await victim_and_bystander(faulty_server, "FAULT-RESTART persona", 8)
        closed = await victim.next("session.closed")
        assert closed["reason"] == "engine_error"
        errors = [e["error"] for e in victim.events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["engine_error", "engine_error"], errors  # the step, then the restart
        ids = {assert_withheld(faulty_server, e["message"]) for e in errors}
        assert len(ids) == 2  # one failure, one id
        assert await victim.wait_closed() == (1011, "engine_error")
        await bystander.wait_audio_frames(8)
        assert not [e for e in bystander.events if e["type"] == "error"]
        await bystander.close()

    run(scenario())
    faulty_server.wait_free_slots(4)  # the failed session's slot was released all the same


def test_the_native_route_tells_a_failed_frame_without_internals(faulty_server: Server):
    """The same slot fault on /api/chat: the 0x05 message is ``engine_error: ...`` with an
    error id and nothing of the fault; the session goes on in a fresh context."""
    from tests.native_support import NativeClient, chat_url, ogg_per_frame

    faulty_server.wait_free_slots(4)

    async def scenario():
        client = await NativeClient.connect(chat_url(faulty_server.ws, text_prompt="FAULT-SLOT persona",
                                                     voice_prompt="NATF2.pt", text_temperature="0",
                                                     audio_temperature="0"))
        await client.handshake()
        for ogg in ogg_per_frame(speech_frames(12)):
            await client.ws.send(b"\x01" + ogg)
        await client.wait_for(lambda: client.errors, timeout=60)
        code, _, message = client.errors[0].partition(": ")
        assert code == "engine_error", client.errors
        assert_withheld(faulty_server, message)
        await client.close()

    run(scenario())
    faulty_server.wait_free_slots(4)


def test_fault_plans_are_checked():
    plans = FaultPlan.parse_all(PLANS)
    assert [p.mode for p in plans] == ["slot", "slot_early", "batch", "hang", "restart"]
    assert plans[3].seconds == 5.0 and plans[0].after == 6 and plans[0].times == 1
    for bad in ("", "mode=slot", "persona=x,mode=explode", "persona=x,mode=slot,after=0", "persona=x,mode=slot,when=1",
                "persona=x,mode=slot,after=soon", "persona", "device=cpu#0,mode=slot", "persona=x,mode=fail_load",
                "device=cpu#0,persona=x,mode=slow_load", "persona=x,device=cpu#0,mode=slot"):
        with pytest.raises(FaultPlanError):
            FaultPlan.parse_all(bad)


def test_a_slot_the_engine_lost_is_not_counted_free():
    """An engine that lost a slot (an open failed after taking it, injected): /ready and
    admission count the engine's own slots, so the lost one is never offered; the others
    serve."""
    server = Server(max_sessions=2, silence_grace_s=0,
                    fault_injection="persona=FAULT-LEAK,mode=leak_open,after=1")
    try:
        async def scenario():
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await client.send({"type": "session.update", "session": {"instructions": "FAULT-LEAK"}})
            error = await client.next("error")
            assert error["error"]["code"] == "engine_error"
            assert_withheld(server, error["error"]["message"])
            await client.wait_closed()
            _, ready = server.get("/ready")
            assert ready["free_slots"] == 1 and ready["live_sessions"] == 1, ready
            serving = await open_session(server, BYSTANDER)
            refused = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await refused.send({"type": "session.update", "session": {"instructions": BYSTANDER}})
            assert (await refused.next("error"))["error"]["code"] == "resource_exhausted"
            await stream([serving], speech_frames(2))
            await serving.wait_audio_frames(2)
            await serving.send({"type": "session.close"})
            await serving.wait_closed()
            _, ready = server.get("/ready")
            assert ready["free_slots"] == 1, ready

        run(scenario())
    finally:
        server.stop()
    assert "Traceback" not in server.logs()


def test_an_open_out_of_memory_is_a_retryable_refusal_and_the_others_stream_on():
    """The allocator fails a join (injected: torch's OutOfMemoryError, with the allocator's
    words and the GPU's memory figures): the joining client gets resource_exhausted,
    retryable, none of those words; the slot is free again; a session already streaming
    loses nothing; /metrics counts the failure."""
    server = Server(max_sessions=2, silence_grace_s=0,
                    fault_injection="persona=FAULT-OOM,mode=oom_open")
    series = 'personaplex_open_failures_total{reason="out_of_memory"}'
    try:
        async def scenario():
            bystander = await open_session(server, BYSTANDER)
            await stream([bystander], speech_frames(4))
            joiner = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await joiner.send({"type": "session.update", "session": {"instructions": "FAULT-OOM"}})
            error = (await joiner.next("error"))["error"]
            assert error["code"] == "resource_exhausted" and error["retryable"] is True, error
            # Its own reason and id (no engine could take it: the last one's refusal, not "full"),
            # none of the allocator's words.
            assert not INTERNALS.search(error["message"]) and "out of memory" not in error["message"], error
            assert "try again" in error["message"] and re.search(r"error id err_[0-9a-f]+", error["message"]), error
            await joiner.wait_closed()
            await stream([bystander], speech_frames(4, offset_s=1.0))
            await bystander.wait_audio_frames(8)
            assert not [e for e in bystander.events if e["type"] == "error"]
            assert len({d["response_id"] for d in bystander.audio()}) == 1
            _, ready = server.get("/ready")
            assert ready["free_slots"] == 1 and ready["live_sessions"] == 1, ready
            await bystander.close()

        run(scenario())
        deadline = time.monotonic() + 10
        while server.metric(series) < 1:  # the engine process's counter reaches the scrape with its next write
            assert time.monotonic() < deadline, server.metric(series)
            time.sleep(0.05)
        assert server.metric(series) == 1
        assert "out of memory [err_" in server.logs()
    finally:
        server.stop()
