"""Hostile input, second round (issue 18): messages that must never take capacity, freeze the
event loop or write the server's record.  A real hypercorn with one front-end worker (so the
attack and the witness share one event loop) and the tiny model.  Where an attack could stall
the loop, a *witness* session streams real speech at real time through it: its audio must
keep coming."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest
from websockets.exceptions import InvalidStatus

from engines.interface import MAX_TEMPERATURE
from orchestrator.protocol.client_events import MAX_EVENT_ID_CHARS, MAX_EVENT_VALUES
from orchestrator.protocol.errors import MAX_MESSAGE_CHARS, ProtocolError
from orchestrator.protocol.session_config import SessionConfig, parse_session_update
from tests.native_support import NativeClient, chat_url
from tests.orch_support import (Client, Server, StreamingWitness, f32_append, run, send_deflated_frame, speech_frames,
                                 works)

SESSIONS = 3


def witness(server: Server) -> StreamingWitness:
    """A witness of an attack: its audio keeps coming, every frame it sends is answered, and
    the worker's event loop is never held by the attack (``orch_support.LOOP_BLOCK_LIMIT_S``,
    measured by the server without the host's waits; the attacks of issue 18 held it for
    2.3-4 s)."""
    return StreamingWitness(server)


@pytest.fixture(scope="module")
def server():
    server = Server(max_sessions=SESSIONS, silence_grace_s=0, workers=1)
    yield server
    server.stop()
    server.assert_clean_log()


async def refused_open(server: Server, session: dict) -> dict:
    """A first session.update the server refuses: the error, after which the socket closes."""
    client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
    await client.send({"type": "session.update", "session": session})
    error = await client.next("error", timeout=20)
    assert await client.wait_closed() == (1008, error["error"]["code"])
    return error["error"]


def test_numbers_the_engine_cannot_hold_are_refused_and_take_no_slot(server: Server):
    """Cause 1: a temperature of 1e39 overflowed the engine's float32 after the slot was taken,
    and the slot was lost.  Now it is refused before anything is allocated, on both routes, as
    often as sent; every slot still opens afterwards."""
    server.wait_free_slots(SESSIONS)

    async def scenario():
        for value in (1e39, MAX_TEMPERATURE * 2, 1e308):
            for _ in range(SESSIONS):
                error = await refused_open(server, {"temperature": value})
                assert (error["code"], error["param"]) == ("bad_event", "temperature"), error
        for query in ({"text_temperature": "1e39"}, {"audio_temperature": "1e39"}, {"text_topk": str(10**30)},
                      {"audio_topk": "9" * 5000}):
            for _ in range(SESSIONS):
                client = await NativeClient.connect(chat_url(server.ws, text_prompt="", **query))
                assert await client.wait_closed() == (1008, "bad_query")
                assert client.errors[0].startswith("bad_query: "), client.errors
        clients = [await Client.connect(server.ws + "/v1/realtime?duplex=1") for _ in range(SESSIONS)]
        await asyncio.gather(*(client.open() for client in clients))  # every slot opens
        for client in clients:
            await client.send({"type": "session.close"})
            await client.wait_closed()

    run(scenario())
    server.wait_free_slots(SESSIONS)
    assert server.metric('personaplex_errors_total{code="engine_error"}') == 0


def test_one_event_of_millions_of_values_is_refused_before_it_is_parsed(server: Server):
    """Cause 2: 15 MB of ``[],[],...`` took over a second to parse on the event loop every
    session of the worker shares.  It is refused by counting, unparsed; the sender's session
    and the witness go on."""
    server.wait_free_slots(SESSIONS)
    pad = ",".join(["[]"] * 5_000_000)
    heavy = '{"type":"session.heartbeat","pad":[' + pad + "]}"
    many_numbers = '{"type":"session.heartbeat","pad":[' + ",".join(["1"] * MAX_EVENT_VALUES) + "]}"
    fine = '{"type":"session.heartbeat","pad":[' + ",".join(["1"] * (MAX_EVENT_VALUES - 10)) + "]}"

    async def scenario():
        async with witness(server):
            # Two sockets whose first message is the heavy one (refused; as with an oversize
            # event the socket may still send its session.update) ...
            for _ in range(2):
                first = await Client.connect(server.ws + "/v1/realtime?duplex=1")
                await first.send(heavy)
                assert (await first.next("error", timeout=20))["error"]["code"] == "event_too_complex"
                await first.ws.close()
            # ... and a session that sends it as often as the per-socket byte rate lets it.
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await client.open()
            for message in (heavy, many_numbers, heavy):
                await client.send(message)
                error = await client.next("error", timeout=20)
                assert error["error"]["code"] == "event_too_complex", error
                await asyncio.sleep(2.5)  # the byte rate's 2 s burst refills
            await client.send(fine)  # just under the limit: parsed and answered
            await client.next("session.heartbeat_ack", timeout=20)
            for frame in speech_frames(3):
                await client.send(f32_append(frame))
            await client.wait_audio_frames(3)
            await client.send({"type": "session.close"})
            await client.wait_closed()

    run(scenario())


def test_compression_is_declined_and_a_compressed_frame_is_never_inflated(server: Server):
    """Cause 3: permessage-deflate was accepted and the limits applied after inflating (1.7 MiB
    became 1.7 GiB).  It is declined: a client that offers it talks uncompressed, and a frame
    marked compressed ends its connection at once (a protocol error) without being inflated."""
    server.wait_free_slots(SESSIONS)

    async def scenario():
        async with witness(server):
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1", compression="deflate")
            assert client.ws.response.headers.get("Sec-WebSocket-Extensions") is None
            await works(client)
            bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
            payload = bomb.compress(b'{"type":"x","pad":"' + b"A" * (15 << 20) + b'"}') + bomb.flush(zlib.Z_SYNC_FLUSH)
            assert len(payload) < 64 * 1024
            for _ in range(3):  # each closed (with or without 1002), uninflated: the witness saw no blocked loop
                code = await asyncio.get_running_loop().run_in_executor(None, send_deflated_frame, server, payload)
                assert code in (None, 1002)

    run(scenario())


def test_a_client_close_reason_does_not_write_the_server_record(server: Server):
    """Cause 4: session.close's reason became the server's close reason, log line and metrics
    label.  Now the server's reason is ``client_close`` whatever the client says; the client's
    words come back (cut) only in session.closed's ``event``."""
    server.wait_free_slots(SESSIONS)
    before = server.metric('personaplex_sessions_closed_total{protocol="realtime",reason="client_close"}')
    forged = "2026-12-03 07:00:00,000 ERROR orchestrator: forged by a client"
    reasons = ["engine_error", "shutdown\n" + forged, "x" * (1 << 20)]

    async def scenario():
        for reason in reasons:
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            await client.open()
            await client.send({"type": "session.close", "reason": reason})
            closed = await client.next("session.closed")
            assert closed["reason"] == "client_close"
            assert closed["event"]["reason"] == reason[:200]
            assert await client.wait_closed() == (1000, "client_close")

    run(scenario())
    assert server.metric('personaplex_sessions_closed_total{protocol="realtime",reason="client_close"}') == before + 3
    status, metrics = server.get("/metrics")
    assert status == 200 and "forged" not in metrics and "xxxx" not in metrics and len(metrics) < 200_000
    assert 'reason="engine_error"' not in metrics and 'reason="shutdown"' not in metrics
    assert forged not in server.logs().splitlines()


def test_lone_surrogates_in_a_persona_are_a_typed_error(server: Server):
    """Cause 5: a persona with lone surrogates reached the tokenizer, which raised: the client
    got a server error.  The JSON parser refuses them (invalid_json), and the session layer
    refuses them too when handed such a string some other way (bad_event)."""
    server.wait_free_slots(SESSIONS)
    persona = '"instructions": "\\ud800 hello \\udfff"'

    async def scenario():
        client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
        await client.send('{"type": "session.update", "session": {' + persona + "}}")
        error = await client.next("error")
        assert error["error"]["code"] == "invalid_json" and error["error"]["type"] == "invalid_request_error"
        assert await client.wait_closed() == (1008, "invalid_json")

    run(scenario())
    server.wait_free_slots(SESSIONS)
    with pytest.raises(ProtocolError) as refused:
        parse_session_update({"instructions": "\ud800 hello \udfff"}, SessionConfig(model="m"), is_open=False,
                             input_rate_locked=False)
    assert (refused.value.code, refused.value.param) == ("bad_event", "instructions")


def test_a_rebound_host_name_gets_no_websocket_on_a_keyless_loopback_server(server: Server):
    """DNS rebinding: a page on another host name that resolves to 127.0.0.1 sends an Origin
    equal to its Host; on a server that takes no keys because it listens on loopback, only a
    loopback Host serves a browser."""
    port = int(server.http.rsplit(":", 1)[1])

    async def connect(name: str) -> Client:
        """Connect to the server as a browser would to ``name`` resolved to 127.0.0.1."""
        return await Client.connect(f"ws://{name}:{port}/v1/realtime?duplex=1", host="127.0.0.1", port=port,
                                    additional_headers={"Origin": f"http://{name}:{port}"})

    async def scenario():
        with pytest.raises(InvalidStatus) as refused:
            await connect("rebind.example")
        assert refused.value.response.status_code == 403
        for name in ("127.0.0.1", "localhost"):
            await works(await connect(name))

    run(scenario())


def test_error_replies_and_logs_quote_client_values_briefly(server: Server):
    """A 800 kB voice name gave a 2.4 MB error reply: the values quoted are cut, the event_id
    echoed too."""
    server.wait_free_slots(SESSIONS)

    async def scenario():
        error = await refused_open(server, {"voice": "N" * 800_000 + ".pt"})
        assert error["code"] == "invalid_voice" and len(error["message"]) <= MAX_MESSAGE_CHARS + 3
        client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
        await client.open()
        await client.send({"type": "response.cancel", "response_id": "r" * 500_000, "event_id": "e" * 100_000})
        error = (await client.next("error"))["error"]
        assert error["code"] == "response_not_active" and len(error["message"]) < 300
        assert error["event_id"] == "e" * MAX_EVENT_ID_CHARS
        await client.send({"type": "session.close"})
        await client.wait_closed()

    run(scenario())
    assert max(len(line) for line in server.logs().splitlines()) < 5000



JOIN_TIMEOUT_S = 120.0  # the join's own wait: only a join that never opens fails it, not a slow host


def test_a_very_long_persona_joins_without_pausing_a_live_session():
    """A persona's prefill used to run in one go on the engine thread, pausing every live
    session for the whole pass.  It now runs in pieces between ticks: with the persona limit
    raised so that the tiny model's prefill is long too (200,000 characters, ~80,000 prompt
    positions; in one piece such a pass takes over a minute here: 73 s for 50,000 positions,
    measured), it is prepared in over a hundred pieces, the witness streams on with every frame
    answered and no piece held the ticks past ``orch_support.ENGINE_PIECE_LIMIT_S`` of the
    engine's own time (the witness's check), and the joiner opens (1.2-1.8 s on the idle dev
    VM)."""
    server = Server(max_sessions=2, silence_grace_s=0, workers=1, max_instructions_chars=200_000)

    def long_pieces(bound: float) -> float:
        return server.observations_above("personaplex_engine_job_own_seconds", bound, 'kind="open"')

    try:
        async def scenario():
            async with StreamingWitness(server) as streaming:
                joiner = await Client.connect(server.ws + "/v1/realtime?duplex=1")
                started = time.monotonic()
                await joiner.open(open_timeout_s=JOIN_TIMEOUT_S,
                                  instructions="You are a patient and thorough teacher. " * 5000)
                opened_s = time.monotonic() - started
                await joiner.send({"type": "session.close"})
                await joiner.wait_closed()
            pieces = server.metric('personaplex_engine_job_own_seconds_count{kind="open"}')
            print(f"joined in {opened_s:.2f} s over {pieces:.0f} pieces (own time past 10/20/40/80 ms: "
                  f"{', '.join(f'{long_pieces(b):.0f}' for b in (0.01, 0.02, 0.04, 0.08))}); the witness's longest "
                  f"gap {streaming.longest_gap_s(started):.3f} s (wall clock)")
            assert pieces > 100  # the prompt was prepared in pieces

        run(scenario())
    finally:
        server.stop()
    server.assert_clean_log()
