"""The reference's acceptance list, against a real ``hypercorn orchestrator:app`` running the
embedded tiny checkpoint on CPU, driven by a real websocket client with real speech."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from tests.orch_support import FRAME, Client, Server, delta_pcm, f32_append, speech_frames, run

PERSONA_A = "You are a concise and helpful assistant."
PERSONA_B = "You are a calm and precise assistant."
PERSONA_C = "You are a cheerful travel assistant."
CAPABILITY_CHECKS = {"implementation_level": "model_native_duplex", "chunk_period_ms": 80,
                     "supports_multi_session": True, "supports_multi_session_same_replica": True,
                     "supports_barge_in": False, "supports_client_commit": False, "supports_session_resume": False}




async def stream_paced(client: Client, frames: np.ndarray, period: float = 0.08) -> None:
    """One frame per 80 ms on a fixed grid (no catch-up burst), like the reference driver."""
    start = time.monotonic()
    for i, frame in enumerate(frames):
        delay = start + i * period - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await client.send(f32_append(frame, format="pcm_f32le", sample_rate_hz=24000, duration_ms=80,
                                     audio_end_ms=(i + 1) * 80))


def check_stream(client: Client, n_frames: int) -> np.ndarray:
    """The reference driver's per-session acceptance checks; returns the output PCM."""
    deltas = client.audio()
    assert len(deltas) >= 2
    assert {d["response_id"] for d in deltas} == {deltas[0]["response_id"]}, "exactly one response per stream"
    total = 0
    for d in deltas:
        assert d["sample_rate_hz"] == 24000 and d["format"] == "pcm16" and d["response_id"]
        pcm = delta_pcm(d)
        assert len(pcm) % FRAME == 0, "deltas carry whole 80 ms frames"
        total += len(pcm)
        assert "vllm_omni" not in d["metadata"]
    assert 0 <= n_frames - total // FRAME <= 4, f"frame deficit {n_frames - total // FRAME}"
    # Each audio delta is followed by exactly one transcript delta of the same response.
    types = [e["type"] for e in client.events]
    for i, t in enumerate(types):
        if t == "response.output_audio.delta":
            nxt = client.events[i + 1] if i + 1 < len(types) else None
            assert nxt is not None and nxt["type"] == "response.output_audio_transcript.delta"
            assert isinstance(nxt["delta"], str) and nxt["response_id"] == client.events[i]["response_id"]
    pcm = np.concatenate([delta_pcm(d) for d in deltas]).astype(np.float32) / 32768.0
    assert np.isfinite(pcm).all()
    rms = float(np.sqrt(np.mean(pcm**2)))
    assert rms > 1e-5, "silent output"
    frame_rms = np.sqrt(np.mean(pcm[: len(pcm) // FRAME * FRAME].reshape(-1, FRAME) ** 2, axis=1))
    assert int((frame_rms >= 1e-3).sum()) >= 5, "fewer than 5 voiced output frames"
    return pcm


def test_ready_health_models_metrics(orch_server: Server):
    status, body = orch_server.get("/health")
    assert (status, body) == (200, {"status": "healthy"})
    status, body = orch_server.get("/ready")
    assert status == 200 and body["ready"] is True and body["max_sessions"] == 2 and 0 <= body["free_slots"] <= 2
    status, body = orch_server.get("/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["id"] and body["data"][0]["demo"] is True
    status, text = orch_server.get("/metrics")
    assert status == 200
    for family in ("personaplex_sessions_live", "personaplex_sessions_refused_total",
                   "personaplex_tick_duration_seconds_bucket", "personaplex_batch_size_bucket",
                   "personaplex_frames_in_total", "personaplex_frames_out_total", "personaplex_errors_total"):
        assert f"# TYPE {family.removesuffix('_bucket')}" in text
    assert "demo model" in orch_server.logs() and "PERSONAPLEX_CHECKPOINT" in orch_server.logs()


def test_two_paced_sessions_and_a_refused_third(orch_server: Server):
    """Acceptance 2-4: capabilities and ids, paced real speech, independent concurrent
    output, the N+1th open refused with resource_exhausted."""
    orch_server.wait_free_slots(2)
    frames = speech_frames(36)  # 2.9 s of speech, paced in real time

    async def scenario():
        url = orch_server.ws + "/v1/realtime?duplex=1&model=nvidia/personaplex-7b-v1&autostart=0"
        a, b = await Client.connect(url), await Client.connect(url)
        sa = await a.open(instructions=PERSONA_A, session_id="client-chosen-id-is-ignored")
        sb = await b.open(instructions=PERSONA_B)
        for s in (sa, sb):
            assert s["id"].startswith("duplex-") and len(s["id"]) == len("duplex-") + 32
            for key, value in CAPABILITY_CHECKS.items():
                assert s["capabilities"][key] == value, key
        assert sa["id"] != sb["id"] and sa["capabilities"] == sb["capabilities"]
        assert "server_event_seq" not in a.events[0] and a.events[1]["server_event_seq"] == 1

        c = await Client.connect(url)
        await c.send({"type": "session.update", "event_id": "evt_third", "session": {"voice": "NATF2.pt"}})
        refused = await c.next("error")
        assert refused["error"]["code"] == "resource_exhausted"
        assert refused["error"]["type"] == "rate_limit_error" and refused["error"]["event_id"] == "evt_third"
        await c.wait_closed()

        await asyncio.gather(stream_paced(a, frames), stream_paced(b, frames))
        await asyncio.gather(a.wait_audio_frames(len(frames)), b.wait_audio_frames(len(frames)))
        await asyncio.gather(a.drain(0.3), b.drain(0.3))
        pcm_a, pcm_b = check_stream(a, len(frames)), check_stream(b, len(frames))
        assert a.audio()[0]["response_id"] != b.audio()[0]["response_id"]
        assert not np.array_equal(pcm_a, pcm_b), "two personas gave identical audio: sessions are not independent"
        # Both streams were served at the same time, not one after the other.
        first_b = b.times[b.events.index(b.audio()[0])]
        last_a = a.times[a.events.index(a.audio()[-1])]
        assert first_b < last_a
        for client, session in ((a, sa), (b, sb)):
            assert {d["metadata"]["session_id"] for d in client.audio()} == {session["id"]}
            await client.send({"type": "session.close"})
            closed = await client.next("session.closed")
            assert closed["session_id"] == session["id"] and closed["reason"] == "client_close"
            assert await client.wait_closed() == (1000, "client_close")

    run(scenario())
    assert orch_server.metric("personaplex_sessions_refused_total") >= 1


async def greedy_output(url: str, frames: np.ndarray) -> tuple[str, bytes]:
    """Open a greedy session with PERSONA_C, stream ``frames`` as fast as allowed, close."""
    client = await Client.connect(url)
    session = await client.open(instructions=PERSONA_C, temperature=0)
    for frame in frames:
        await client.send(f32_append(frame))
    pcm = await client.wait_audio_frames(len(frames))
    await client.send({"type": "session.close"})
    await client.wait_closed()
    return session["id"], pcm[: len(frames) * FRAME].tobytes()


def test_close_frees_only_its_slot_and_replacement_does_not_leak(orch_server: Server):
    """Acceptance 5: closing one session frees only its slot; the replacement (another persona,
    greedy) gets a fresh id and its output equals the same input on a fresh server, bit for bit."""
    orch_server.wait_free_slots(2)
    frames = speech_frames(24, offset_s=4.0)
    url = orch_server.ws + "/v1/realtime?duplex=1"

    async def scenario():
        primary, secondary = await Client.connect(url), await Client.connect(url)
        sp = await primary.open(instructions=PERSONA_A, temperature=0)
        ss = await secondary.open(instructions=PERSONA_B)
        for frame in speech_frames(12):  # give both sessions state worth leaking
            await primary.send(f32_append(frame))
            await secondary.send(f32_append(frame))
        await primary.wait_audio_frames(12)
        await secondary.wait_audio_frames(12)
        await primary.send({"type": "session.close"})
        await primary.next("session.closed")
        await primary.wait_closed()
        # Only the primary's slot came back; the survivor keeps streaming its one response.
        assert orch_server.get("/ready")[1]["free_slots"] == 1
        survivor_response = secondary.audio()[0]["response_id"]
        for frame in speech_frames(4, offset_s=3.0):
            await secondary.send(f32_append(frame))
        await secondary.wait_audio_frames(16)
        assert {d["response_id"] for d in secondary.audio()} == {survivor_response}

        replacement_id, replaced = await greedy_output(url, frames)
        assert replacement_id not in (sp["id"], ss["id"])
        await secondary.close()

        fresh = await asyncio.to_thread(Server, max_sessions=2, silence_grace_s=0)
        try:
            _, fresh_pcm = await greedy_output(fresh.ws + "/v1/realtime?duplex=1", frames)
        finally:
            await asyncio.to_thread(fresh.stop)
        return replaced, fresh_pcm

    replaced, fresh_pcm = run(scenario())
    assert len(replaced) == len(fresh_pcm) == len(frames) * FRAME * 2
    assert replaced == fresh_pcm, "the replacement's output depends on an earlier session (state leak)"


def test_stock_openai_realtime_client_shape(orch_server: Server):
    """GA session.update, pcm16 at 24 kHz, bare appends pipelined before session.created, a
    client that reads nothing while sending, a Bearer key, and a plain close."""
    orch_server.wait_free_slots(2)
    audio = speech_frames(25).reshape(-1)  # 2 s

    async def scenario():
        client = await Client.connect(orch_server.ws + "/v1/realtime?model=gpt-realtime",
                                      additional_headers={"Authorization": "Bearer sk-anything"})
        await client.send({"type": "session.update", "session": {
            "type": "realtime", "instructions": PERSONA_A, "output_modalities": ["audio"],
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcm", "rate": 24000}}}}})
        chunk = 2400  # 100 ms chunks: not frame aligned
        for start in range(0, len(audio), chunk):
            await client.send({"type": "input_audio_buffer.append",
                               "audio": base64.b64encode(np.rint(audio[start:start + chunk] * 32767)
                                                         .astype("<i2").tobytes()).decode()})
        created = await client.next("session.created")
        assert created["session"]["model"] == "gpt-realtime"
        assert created["session"]["input_audio_format"] == "pcm16"
        await client.wait_audio_frames(25)
        assert not [e for e in client.events if e["type"] == "error"]
        assert client.audio()[0]["format"] == "pcm16"
        await client.close()  # plain websocket close, no session.close
        orch_server.wait_free_slots(2, timeout=5)

    run(scenario())
