"""A websocket fuzzer against a real server: random and malformed events, truncated and
invalid frames at the wire level, binary frames, oversize and huge frames, interleaved
cancels and closes, clients that vanish or stop reading, rapid connect/disconnect.

Afterwards the server must be exactly as good as new: every slot free, healthy, nothing in
its log, and a greedy session must produce byte for byte the audio and text it produced
before the fuzzing began.  Seeded (``PERSONAPLEX_TEST_FUZZ_SEED``), rounds per worker from
``PERSONAPLEX_TEST_FUZZ_ROUNDS``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import time
from typing import Any

import numpy as np
import pytest

from tests.orch_support import (
    Client,
    Server,
    f32_append,
    pcm16_b64,
    run,
    speech,
    speech_frames,
)

SEED = int(os.environ.get("PERSONAPLEX_TEST_FUZZ_SEED", "20261130"))
ROUNDS = int(os.environ.get("PERSONAPLEX_TEST_FUZZ_ROUNDS", "14"))
WORKERS = 3
MAX_EVENT_BYTES = 256 * 1024
EVENT_TYPES = ("input_audio_buffer.append", "session.update", "response.cancel", "output_audio_buffer.clear",
               "input.cancel", "input_audio_buffer.clear", "input_audio_buffer.commit", "session.heartbeat",
               "session.event_ack", "response.create", "playback.ack", "session.resume", "input_text.append",
               "barge_in", "conversation.item.create", "conversation.item.retrieve", "session.close", "close",
               "transcription_session.update", "")
# Codes a client can cause; anything else (engine_error, internal_error...) means we broke.
CLIENT_CODES = {"bad_event", "invalid_json", "event_too_large", "unknown_event", "bad_audio", "unsupported_audio_format",
                "unsupported_turn_detection", "invalid_voice", "persona_update_unsupported", "voice_update_unsupported",
                "model_update_unsupported", "sampling_update_unsupported", "invalid_duplex_runtime_config",
                "invalid_event_ack", "response_not_active", "response_already_active", "native_text_append_unsupported",
                "unsupported_turn_signal", "text_only_turn_unsupported", "missing_item_id", "item_not_found",
                "unsupported_session_resume", "input_backpressure", "output_backpressure", "config_timeout",
                "resource_exhausted", "unsupported_native_response_options", "event_rate_exceeded",
                "instructions_too_long"}
PERSONA = "You are a concise and helpful assistant."


@pytest.fixture(scope="module")
def fuzz_server():
    server = Server(max_sessions=4, silence_grace_s=0, first_message_timeout_s=1.0, max_event_bytes=MAX_EVENT_BYTES,
                    close_timeout_s=1.0, max_output_buffer_bytes=2 * 2**20)
    yield server
    server.stop()
    server.assert_clean_log()


async def greedy_reference(server: Server) -> tuple[bytes, str]:
    """One greedy session on a quiet server: its audio and transcript."""
    await asyncio.to_thread(server.wait_free_slots, 4, 30)
    client = await Client.connect(server.ws + "/v1/realtime")
    await client.open(instructions=PERSONA, voice="NATF2.pt", temperature=0)
    for frame in speech_frames(10, offset_s=2.0):
        await client.send(f32_append(frame))
    pcm = await client.wait_audio_frames(10)
    await client.send({"type": "session.close"})
    await client.wait_closed()
    text = "".join(e["delta"] for e in client.events if e["type"] == "response.output_audio_transcript.delta")
    return pcm.tobytes(), text


# Random messages ----------------------------------------------------------------------------------
def junk(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 24000, 16000, 2**63, -(2**70), rng.randrange(-10**6, 10**6)])
    if pick == 3:
        return rng.choice([0.5, -0.0, 1e300, -1e-300, 24000.0, rng.random()])
    if pick in (4, 5):
        return "".join(rng.choice("aZ09 _.-/\\\"'\u00e9\u4e2d\U0001f600\n") for _ in range(rng.randrange(12)))
    if pick in (6, 7):
        return {str(junk(rng, 9))[:8]: junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]


def audio_append(rng: random.Random) -> dict[str, Any]:
    n = rng.choice([0, 1, 1, 2, 3])
    samples = speech(n * 0.08 + 0.01, offset_s=rng.uniform(0, 30))[: n * 1920]
    if rng.random() < 0.7:
        return f32_append(samples)
    return {"type": "input_audio_buffer.append", "audio": pcm16_b64(samples), "format": "pcm16"}


def malformed_append(rng: random.Random) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "input_audio_buffer.append"}
    case = rng.randrange(7)
    if case == 0:
        event["audio"] = "%%%not-base64%%%"
    elif case == 1:
        event["audio"] = base64.b64encode(os.urandom(rng.choice([1, 3, 5, 7]))).decode()  # partial samples
    elif case == 2:
        bad = np.zeros(1920, dtype="<f4")
        bad[rng.randrange(1920)] = rng.choice([np.nan, np.inf, -np.inf])
        event["audio"] = base64.b64encode(bad.tobytes()).decode()
    elif case == 3:
        event.update(audio="AAAA", sample_rate_hz=rng.choice([7000, 16000, 24000.5, "x", None, 10**9]))
    elif case == 4:
        event.update(audio="AAAA", format=junk(rng))
    elif case == 5:
        event["audio"] = junk(rng)
    else:
        event["delta"] = None
    return event


def random_message(rng: random.Random) -> str | bytes:
    r = rng.random()
    if r < 0.28:
        return json.dumps(audio_append(rng))
    if r < 0.38:
        return json.dumps(malformed_append(rng))
    if r < 0.48:
        return json.dumps({"type": rng.choice(EVENT_TYPES), **{rng.choice(["audio", "session", "response_id", "item_id",
                                                                            "server_event_seq", "played_ms", "reason",
                                                                            "event_id", "response"]): junk(rng)
                                                               for _ in range(rng.randrange(3))}})
    if r < 0.55:
        text = json.dumps(audio_append(rng) if rng.random() < 0.5 else {"type": "session.update", "session": junk(rng)})
        return text[: rng.randrange(len(text))]  # truncated JSON
    if r < 0.60:
        return os.urandom(rng.randrange(1, 64))  # a binary frame
    if r < 0.63:
        return json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (MAX_EVENT_BYTES + rng.randrange(9))})
    if r < 0.71:
        return json.dumps({"type": rng.choice(["response.cancel", "output_audio_buffer.clear", "input.cancel",
                                               "input_audio_buffer.clear", "input_audio_buffer.commit"]),
                           **({"response_id": junk(rng)} if rng.random() < 0.3 else {})})
    if r < 0.78:
        session = rng.choice([{}, {"voice": "NATM1.pt"}, {"instructions": "Other."}, {"temperature": 0.5},
                              {"sample_rate_hz": 16000}, {"turn_detection": {"type": "semantic_vad"}},
                              {"extra_body": {"personaplex_persona": "x"}}, {"audio": junk(rng)}, junk(rng),
                              {"instructions": "x" * 7000}, {"metadata": json.loads("[" * 40 + "]" * 40)}])
        return json.dumps({"type": "session.update", "session": session})
    if r < 0.84:
        return rng.choice(["", "null", "[]", "42", '"text"', "{}", '{"type": 7}', '{"type":"x","n":NaN}',
                           '{"type":"x","n":1e999}', "[" * 5000 + "]" * 5000, "\u0000\u00ff{", "{" * 10])
    return json.dumps(rng.choice([{"type": "session.heartbeat"}, {"type": "session.event_ack", "server_event_seq": 1},
                                  {"type": "playback.ack", "played_ms": 80}, {"type": "response.create"},
                                  {"type": "response.create", "response": {"voice": "x"}}]))


# Scenarios ---------------------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.connections = 0
        self.sessions = 0
        self.events: list[dict[str, Any]] = []
        self.closes: list[int | None] = []


async def send(client: Client, message: str | bytes, tally: Tally) -> bool:
    try:
        await client.send(message)
    except Exception:  # noqa: BLE001 - the server may already have closed it: a fine outcome
        return False
    tally.sent += 1
    return True


async def chaos_session(server: Server, rng: random.Random, tally: Tally) -> None:
    client = await Client.connect(server.ws + rng.choice(["/v1/realtime", "/v1/duplex", "/v1/realtime?model=x"]))
    tally.connections += 1
    if rng.random() < 0.85:
        await send(client, json.dumps({"type": "session.update", "session": {
            "instructions": rng.choice(["", PERSONA, "Be brief."]), "voice": rng.choice(["NATF2.pt", "VARF0.pt"]),
            **({"temperature": 0} if rng.random() < 0.5 else {})}}), tally)
        try:
            opened = await client.next(lambda e: e["type"] in ("session.created", "error"), timeout=20)
            tally.sessions += opened["type"] == "session.created"
        except AssertionError:
            pass  # closed (capacity, a refused handshake): the next sends fail and end the round
    reading = rng.random() < 0.8
    for _ in range(rng.randrange(4, 40)):
        if not await send(client, random_message(rng), tally):
            break
        if reading and rng.random() < 0.2:
            await client.drain(rng.choice([0.0, 0.01, 0.05]))
    ending = rng.randrange(4)
    if ending == 0:
        await send(client, json.dumps({"type": "session.close"}), tally)
        await client.drain(1.0)
    elif ending == 1:
        await client.drain(0.3)
        await client.close()
    elif ending == 2:
        client.ws.transport.abort()  # vanish: no close frame
    else:
        await asyncio.sleep(0.3)  # read nothing more, then hang up without a close frame
        client.ws.transport.close()
    tally.events += client.events
    tally.closes.append(client.close_code)
    if client.close_code is None:
        # Whatever the ending, this client is gone now (a polite close can wait on a server
        # blocked writing to a client that read nothing; that is not the server's leak).
        client.ws.transport.abort()


async def rapid_connects(server: Server, rng: random.Random, tally: Tally) -> None:
    for _ in range(rng.randrange(3, 8)):
        client = await Client.connect(server.ws + "/v1/realtime")
        tally.connections += 1
        if rng.random() < 0.5:
            await send(client, json.dumps({"type": "session.update", "session": {}}), tally)
            await asyncio.sleep(rng.choice([0, 0.01, 0.05]))  # leave while the slot is being prepared
        client.ws.transport.abort()


async def raw_wire(server: Server, rng: random.Random, tally: Tally) -> None:
    """Below the websocket library: a truncated frame, invalid UTF-8, a bad opcode, garbage."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    tally.connections += 1
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    mask = os.urandom(4)
    payload = rng.choice([b'{"type": "session.update", "session": {}}', b"\xff\xfe\xfd", os.urandom(40)])
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    frame = rng.choice([
        bytes([0x81, 0x80 | 126, 0x03, 0xE8]) + mask + masked[:10],  # announces 1000 bytes, sends 10
        bytes([0x81, 0x80 | len(payload)]) + mask + masked,  # maybe invalid UTF-8 in a text frame
        bytes([0x83, 0x80 | len(payload)]) + mask + masked,  # reserved opcode
        bytes([0x01, 0x80 | len(payload)]) + mask + masked,  # a fragment that never ends
        os.urandom(rng.randrange(1, 30)),
    ])
    writer.write(frame)
    tally.sent += 1
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(4096), rng.choice([0.05, 0.5]))
    except (asyncio.TimeoutError, ConnectionError):
        pass
    writer.transport.abort()


async def huge_frame(server: Server, tally: Tally) -> None:
    """Past hypercorn's 16 MiB message limit: the connection is closed (1009), nothing else."""
    client = await Client.connect(server.ws + "/v1/realtime", max_size=None)
    tally.connections += 1
    await client.open()
    await send(client, json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (17 * 2**20)}), tally)
    # Sent uncompressed (the server declines permessage-deflate), the 17 MiB take a while to
    # arrive on a busy machine: the close comes once hypercorn has read past 16 MiB.
    deadline = time.monotonic() + 60
    while client.close_code is None and time.monotonic() < deadline:
        await client.drain(2.0)
    tally.events += client.events
    tally.closes.append(client.close_code)


async def attacker(server: Server, index: int, tally: Tally) -> None:
    rng = random.Random(SEED * 31 + index)
    if index == 0:
        await huge_frame(server, tally)
    for _ in range(ROUNDS):
        scenario = rng.random()
        if scenario < 0.65:
            await chaos_session(server, rng, tally)
        elif scenario < 0.85:
            await rapid_connects(server, rng, tally)
        else:
            await raw_wire(server, rng, tally)


def _unclosed_sessions(log: str) -> str:
    """The server's log lines about sessions that opened and never closed."""
    opened = re.findall(r"session (duplex-\w+) opened", log)
    closed = set(re.findall(r"session (duplex-\w+) closed", log))
    return "\n".join(line for sid in opened if sid not in closed for line in log.splitlines() if sid in line)


def test_fuzzed_server_is_as_good_as_new(fuzz_server: Server):
    server = fuzz_server
    tally = Tally()

    async def scenario():
        before = await greedy_reference(server)
        await asyncio.gather(*(attacker(server, i, tally) for i in range(WORKERS)))
        return before

    tasks_before = server.metric("personaplex_event_loop_tasks")
    before = run(scenario())
    codes: dict[str, int] = {}
    for event in tally.events:
        if event["type"] == "error":
            codes[event["error"]["code"]] = codes.get(event["error"]["code"], 0) + 1
    print(f"\nfuzz: seed={SEED} sent={tally.sent} connections={tally.connections} sessions={tally.sessions} "
          f"server_events={len(tally.events)} error_codes={dict(sorted(codes.items()))}")
    assert tally.sent > 300 and tally.connections > 60

    # Every reply was a well-formed event; every error one a client can cause.
    errors = [e["error"] for e in tally.events if e["type"] == "error"]
    assert errors and all(err["type"] in ("invalid_request_error", "rate_limit_error") for err in errors), errors[:5]
    unexpected = {err["code"] for err in errors} - CLIENT_CODES
    assert not unexpected, unexpected
    assert 1009 in tally.closes, "the huge frame must be refused by the transport"

    try:
        server.wait_free_slots(4, timeout=30)  # no leaked slot
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_unclosed_sessions(server.logs())}") from None
    assert server.get("/health") == (200, {"status": "healthy"})
    assert server.metric("personaplex_sessions_live") == 0
    assert server.metric('personaplex_tick_failures_total{scope="batch"}') == 0
    for _ in range(50):  # every connection's tasks end (closing ones may take a moment)
        if server.metric("personaplex_event_loop_tasks") <= tasks_before:
            break
        time.sleep(0.1)
    assert server.metric("personaplex_event_loop_tasks") <= tasks_before, "tasks leaked"

    after = run(greedy_reference(server))
    assert after[0] == before[0], "the same greedy session gives other audio after the fuzzing"
    assert after[1] == before[1]
