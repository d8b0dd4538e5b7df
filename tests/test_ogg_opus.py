"""Ogg/Opus streams of the native protocol (orchestrator/protocol/ogg_opus.py) with the real
codec: real speech through the encoder, back through the decoder in arbitrary chunks, and
bytes that are not Ogg refused with a typed error.  Runs on the installed sphn (0.1's API and
0.2's differ; the classes hide which)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engines.config import FRAME_SAMPLES
from orchestrator.protocol.audio import AudioError
from orchestrator.protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder


def _decode_all(decoder: OggOpusDecoder, chunks: list[bytes], expected: int, wait_s: float = 5.0) -> np.ndarray:
    out = [decoder.feed(chunk) for chunk in chunks]
    deadline = time.monotonic() + wait_s  # sphn 0.1 decodes on a thread of its own
    while sum(len(x) for x in out) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
        out.append(decoder.poll())
    return np.concatenate(out)


def test_speech_survives_the_round_trip_in_any_chunking(speech_pcm):
    frames = speech_pcm[: 50 * FRAME_SAMPLES].reshape(50, FRAME_SAMPLES)
    encoder = OggOpusEncoder()
    pages = [encoder.encode(frame) for frame in frames]
    assert pages[0].startswith(b"OggS") and b"OpusHead" in pages[0] and b"OpusTags" in pages[0]
    assert all(page.startswith(b"OggS") and b"OpusHead" not in page for page in pages[1:])
    stream = b"".join(pages)
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, len(stream)), size=40, replace=False))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    decoder = OggOpusDecoder()
    try:
        pcm = _decode_all(decoder, chunks, frames.size)
    finally:
        decoder.close()
    assert len(pcm) == frames.size
    # Lossy, but the same speech: the decoded signal follows the original closely.
    original = frames.reshape(-1)
    # Opus delays the signal by its pre-skip (~6.5 ms), which the stream does not remove.
    correlation = max(np.corrcoef(original[: len(original) - lag], pcm[lag:])[0, 1] for lag in range(0, 480))
    assert correlation > 0.9, correlation


def test_the_encoder_takes_frames_only():
    with pytest.raises(ValueError, match="1920"):
        OggOpusEncoder().encode(np.zeros(960, dtype=np.float32))


def test_bytes_that_are_not_ogg_are_a_typed_error():
    decoder = OggOpusDecoder()
    try:
        with pytest.raises(AudioError) as raised:  # on the spot, on either sphn (the page check)
            decoder.feed(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(range(256)) * 8)
        assert raised.value.code == "bad_audio"
        with pytest.raises(AudioError):  # and stays refused
            decoder.feed(OggOpusEncoder().encode(np.zeros(FRAME_SAMPLES, dtype=np.float32)))
    finally:
        decoder.close()


def test_garbage_after_good_pages_is_refused_on_either_sphn():
    """sphn 0.1 would skip to the next page silently and 0.2 raise: both refuse here."""
    encoder, decoder = OggOpusEncoder(), OggOpusDecoder()
    try:
        good = b"".join(encoder.encode(np.zeros(FRAME_SAMPLES, dtype=np.float32)) for _ in range(3))
        decoder.feed(good[:50])
        decoder.feed(good[50:])
        with pytest.raises(AudioError, match="OggS"):
            decoder.feed(b"\x01\x02not a page" + good)
    finally:
        decoder.close()


def test_the_codec_thread_encodes_a_ticks_frames_in_one_batch(speech_pcm):
    """Several streams' frames in one job give the same pages as encoding each stream alone;
    a stream's failure stays its own; decoding errors come back typed."""
    from orchestrator.frontend.codec_thread import CodecThread

    frames = (speech_pcm[: 6 * FRAME_SAMPLES].reshape(6, FRAME_SAMPLES) * 32767).astype(np.int16)
    codec = CodecThread()
    try:
        streams = [OggOpusEncoder() for _ in range(3)]
        alone = [OggOpusEncoder() for _ in range(3)]
        for t in range(2):
            batch = codec.encode([(streams[i], frames[2 * i + t]) for i in range(3)]).result(5)
            assert batch == [alone[i].encode(frames[2 * i + t].astype(np.float32) / 32768.0) for i in range(3)]
        mixed = codec.encode([(streams[0], frames[0]), (streams[1], frames[1][:100])]).result(5)
        assert isinstance(mixed[0], bytes) and isinstance(mixed[1], ValueError)
        decoder = OggOpusDecoder()
        with pytest.raises(AudioError):
            codec.decode(decoder, b"not an ogg stream").result(5)
        decoder.close()
    finally:
        codec.stop()
    with pytest.raises(RuntimeError):
        codec.encode([]).result(1)
