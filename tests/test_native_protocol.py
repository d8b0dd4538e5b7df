"""The native /api/chat protocol as data (orchestrator/protocol/native.py): the query NVIDIA's
web client sends, refusals for what cannot be served, and message kinds."""

from __future__ import annotations

import pytest

from engines.config import DEFAULT_VOICE
from engines.interface import SamplingParams
from orchestrator.protocol import native
from orchestrator.protocol.errors import ProtocolError

# What NVIDIA's web client puts in its /api/chat URL (client/src/pages/Conversation/Conversation.tsx).
STOCK_CLIENT_QUERY = {
    "text_temperature": "0.7", "text_topk": "25", "audio_temperature": "0.8", "audio_topk": "250", "pad_mult": "0",
    "text_seed": "123456", "audio_seed": "654321", "repetition_penalty_context": "64", "repetition_penalty": "1.0",
    "text_prompt": "You enjoy having a good conversation.", "voice_prompt": "NATF0.pt",
}


def test_the_stock_clients_query_is_a_session():
    spec = native.parse_query(STOCK_CLIENT_QUERY)
    assert spec.voice == "NATF0.pt" and spec.persona == "You enjoy having a good conversation."
    assert spec.sampling == SamplingParams(temp_text=0.7, topk_text=25, temp_audio=0.8, topk_audio=250)
    assert spec.seed is None  # text_seed/audio_seed are ignored, as by NVIDIA's server


def test_seed_temperatures_and_defaults():
    spec = native.parse_query({"text_prompt": "", "seed": "42", "text_temperature": "0", "audio_temperature": "0"})
    assert spec.seed == 42 and spec.sampling.greedy and spec.voice == DEFAULT_VOICE
    assert spec.effective_persona  # empty: the default persona, not none
    assert native.parse_query({"text_prompt": "x", "seed": "-1"}).seed is None
    assert native.parse_query({"text_prompt": "x", "text_topk": " "}).sampling.topk_text == SamplingParams().topk_text


@pytest.mark.parametrize(("query", "code", "param"), [
    ({}, "missing_text_prompt", "text_prompt"),
    ({"text_prompt": "x" * 11}, "text_prompt_too_long", "text_prompt"),
    ({"text_prompt": "", "voice_prompt": "../secrets.pt"}, "invalid_voice", "voice_prompt"),
    ({"text_prompt": "", "voice_prompt": ".hidden.pt"}, "invalid_voice", "voice_prompt"),
    ({"text_prompt": "", "seed": "abc"}, "bad_query", "seed"),
    ({"text_prompt": "", "seed": "-2"}, "bad_query", "seed"),
    ({"text_prompt": "", "seed": str(2**63)}, "bad_query", "seed"),
    ({"text_prompt": "", "text_temperature": "nan"}, "bad_query", "text_temperature"),
    ({"text_prompt": "", "audio_temperature": "-1"}, "bad_query", "audio_temperature"),
    ({"text_prompt": "", "audio_topk": "0"}, "bad_query", "audio_topk"),
    ({"text_prompt": "", "text_topk": "2.5"}, "bad_query", "text_topk"),
])
def test_what_cannot_be_served_is_a_typed_refusal(query, code, param):
    with pytest.raises(ProtocolError) as raised:
        native.parse_query(query, max_persona_chars=10)
    assert (raised.value.code, raised.value.param) == (code, param)


def test_message_kinds():
    assert native.split(b"\x01OggS") == (native.AUDIO, b"OggS")
    assert native.split(b"\x06") == (native.PING, b"")
    for bad, code in ((b"", "empty_message"), (b"\x07x", "unknown_kind"), (b"\xff", "unknown_kind")):
        with pytest.raises(ProtocolError) as raised:
            native.split(bad)
        assert raised.value.code == code
    assert native.HANDSHAKE_MESSAGE == b"\x00"
    assert native.text_message(" hello") == b"\x02 hello"
    assert native.audio_message(b"OggS..") == b"\x01OggS.."
    long = native.error_message("é" * 1000)  # cut on a character boundary
    assert long[0] == native.ERROR and len(long) <= native.MAX_ERROR_BYTES + 1
    long[1:].decode("utf-8")
