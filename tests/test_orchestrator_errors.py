"""One test per error code a client can trigger, each followed by proof that the session
(or, after a handshake failure, the server) still works."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.orch_support import Client, Server, f32_append, speech_frames, run



async def prove_session_works(client: Client, n: int = 3) -> None:
    """The session still turns n input frames into n output frames."""
    have = len(client.audio())
    for frame in speech_frames(n):
        await client.send(f32_append(frame))
    await client.next(lambda e: e["type"] == "response.output_audio.delta" and len(client.audio()) >= have + n)


async def prove_server_works(server: Server) -> None:
    server.wait_free_slots(1)
    client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
    await client.open()
    await prove_session_works(client)
    await client.send({"type": "session.close"})
    await client.wait_closed()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


NAN_FRAME = np.zeros(1920, dtype="<f4")
NAN_FRAME[100] = np.nan

# (name, events to send after a good first append, expected code, expected param or None)
IN_SESSION = [
    ("bad_json", ['{"type": "input_audio_buffer.append", '], "invalid_json", None),
    ("non_object_json", ["[1, 2, 3]"], "bad_event", None),
    ("missing_type", [{"audio": "AAAA"}], "bad_event", "type"),
    ("binary_frame", [b"\x00\x01"], "bad_event", None),
    ("unknown_event", [{"type": "conversation.teleport", "event_id": "evt_x"}], "unknown_event", "type"),
    ("bad_base64", [{"type": "input_audio_buffer.append", "audio": "not base64!!"}], "bad_audio", None),
    ("non_finite_pcm", [{"type": "input_audio_buffer.append", "audio": b64(NAN_FRAME.tobytes())}], "bad_event", "audio"),
    ("partial_f32_sample", [{"type": "input_audio_buffer.append", "audio": b64(b"\x00" * 6)}], "bad_event", "audio"),
    ("wrong_rate", [f32_append(np.zeros(1920), sample_rate_hz=7000)], "bad_event", "sample_rate_hz"),
    ("changed_rate", [f32_append(np.zeros(1920), sample_rate_hz=16000)], "bad_event", "sample_rate_hz"),
    ("unsupported_format", [f32_append(np.zeros(1920), format="opus")], "unsupported_audio_format", "format"),
    ("persona_update", [{"type": "session.update", "session": {"instructions": "You are a pirate."}}],
     "persona_update_unsupported", "instructions"),
    ("voice_update", [{"type": "session.update", "session": {"voice": "NATM1.pt"}}], "voice_update_unsupported", "voice"),
    ("server_owned_extra_body", [{"type": "session.update", "session": {"extra_body": {"personaplex_model_path": "/x"}}}],
     "invalid_duplex_runtime_config", "extra_body"),
    ("rate_change_by_update", [{"type": "session.update", "session": {"sample_rate_hz": 16000}}], "bad_event",
     "sample_rate_hz"),
    ("invalid_event_ack", [{"type": "session.event_ack", "server_event_seq": -1}], "invalid_event_ack", "server_event_seq"),
    ("cancel_unknown_response", [{"type": "response.cancel", "response_id": "resp_nope"}], "response_not_active",
     "response_id"),
    ("text_append", [{"type": "input_text.append", "text": "hi"}], "native_text_append_unsupported", None),
]


@pytest.mark.parametrize("name,messages,code,param", IN_SESSION, ids=[case[0] for case in IN_SESSION])
def test_error_leaves_session_intact(orch_server: Server, name, messages, code, param):
    before = orch_server.metric(f'personaplex_errors_total{{code="{code}"}}')

    async def scenario():
        orch_server.wait_free_slots(1)
        client = await Client.connect(orch_server.ws + "/v1/realtime?duplex=1")
        session = await client.open(instructions="You are a concise and helpful assistant.")
        await prove_session_works(client)  # audio received: the input rate is now locked
        for message in messages:
            await client.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
        error = await client.next("error")
        assert error["error"]["code"] == code, error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["event_id"].startswith("event_")
        if param is not None:
            assert error["error"].get("param") == param
        if isinstance(messages[0], dict) and "event_id" in messages[0]:
            assert error["error"]["event_id"] == messages[0]["event_id"]
        await prove_session_works(client)
        # Same session, same response: the error changed nothing.
        assert {d["metadata"]["session_id"] for d in client.audio()} == {session["id"]}
        assert len({d["response_id"] for d in client.audio()}) == 1
        await client.send({"type": "session.close"})
        assert (await client.wait_closed())[0] == 1000

    run(scenario())
    assert orch_server.metric(f'personaplex_errors_total{{code="{code}"}}') == before + 1


def test_oversize_event(orch_server: Server):
    """Past max_event_bytes (15 MiB) the event is refused and the session goes on."""

    async def scenario():
        orch_server.wait_free_slots(1)
        client = await Client.connect(orch_server.ws + "/v1/realtime?duplex=1")
        await client.open()
        await client.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (15 * 2**20)}))
        error = await client.next("error", timeout=60)
        assert error["error"]["code"] == "event_too_large"
        await prove_session_works(client)
        await client.close()

    run(scenario())


# (name, url suffix, first message or None for "send nothing", expected code)
HANDSHAKE = [
    ("unknown_voice", "", {"type": "session.update", "session": {"voice": "NOBODY.pt"}}, "invalid_voice"),
    ("voice_path", "", {"type": "session.update", "session": {"voice": "../../etc/passwd.pt"}}, "invalid_voice"),
    ("server_owned_extra_body", "", {"type": "session.update", "session": {
        "extra_body": {"auto_response": True, "personaplex_prefill_slots": 3}}}, "invalid_duplex_runtime_config"),
    ("semantic_vad", "", {"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}},
     "unsupported_turn_detection"),
    ("wrong_session_rate", "", {"type": "session.update", "session": {"sample_rate_hz": 5}}, "bad_event"),
    ("unsupported_output", "", {"type": "session.update", "session": {"output_audio_format": "opus"}},
     "unsupported_audio_format"),
    ("output_rate_beside_a_legacy_format", "", {"type": "session.update", "session": {
        "output_audio_format": "pcm16", "audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}},
     "unsupported_audio_format"),
    ("idle_timeout_beyond_an_hour", "", {"type": "session.update", "session": {"idle_timeout_s": 1e9}}, "bad_event"),
    ("temperature_beyond_float32", "", {"type": "session.update", "session": {"temperature": 1e39}}, "bad_event"),
    ("first_message_timeout", "", None, "config_timeout"),
    ("first_message_bad_json", "", "{oops", "invalid_json"),
    ("first_message_not_object", "", '"session.update"', "bad_event"),
    ("resume", "", {"type": "session.resume", "session_id": "duplex-0"}, "unsupported_session_resume"),
    ("turn_based_api", "?duplex=0", None, "unsupported"),
]


@pytest.mark.parametrize("name,suffix,first,code", HANDSHAKE, ids=[case[0] for case in HANDSHAKE])
def test_handshake_failure_closes_socket_and_server_goes_on(orch_server: Server, name, suffix, first, code):
    async def scenario():
        orch_server.wait_free_slots(2)
        client = await Client.connect(orch_server.ws + "/v1/realtime" + suffix)
        if first is not None:
            await client.send(first if isinstance(first, str) else json.dumps(first))
        error = await client.next("error", timeout=10)
        assert error["error"]["code"] == code, error
        close_code, reason = await client.wait_closed()
        assert close_code == 1008 and reason == code
        assert not [e for e in client.events if e["type"] == "session.created"]
        orch_server.wait_free_slots(2)  # a failed open holds no slot
        await prove_server_works(orch_server)

    run(scenario())
