"""Ogg/Opus streams of the native protocol (orchestrator/protocol/ogg_opus.py) with the real
codecs: real speech through the encoder, back through the decoder in arbitrary chunks, and
bytes that are not Ogg refused with a typed error.  Every test runs on both codecs: libopus
through our binding, and the installed sphn (0.1's API and 0.2's differ; the classes hide
which)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engines.config import FRAME_SAMPLES
from orchestrator.protocol import libopus, ogg_opus
from orchestrator.protocol.audio import AudioError
from orchestrator.protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder
from tests.native_support import ogg_page, page_ids


@pytest.fixture(params=ogg_opus.CODECS, autouse=True)
def codec(request, monkeypatch) -> str:
    """The codec every encoder and decoder of the test uses (``default_codec``)."""
    if request.param == "libopus" and not libopus.available():
        pytest.skip("libopus is not installed here (Debian: libopus0)")
    monkeypatch.setattr(ogg_opus, "default_codec", lambda: request.param)
    return request.param


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
    per_frame = [encoder.encode(frame) for frame in frames]
    # The headers, then the frame's pages: sphn 0.1 (what NVIDIA's server runs) writes one
    # 80 ms packet on one page, 0.2 two 40 ms packets on a page each.
    per_page = len(per_frame[1])
    assert per_page in (1, 2) and [len(pages) for pages in per_frame] == [2 + per_page] + [per_page] * 49
    assert per_frame[0][0].startswith(b"OggS\x00\x02") and b"OpusHead" in per_frame[0][0]
    assert b"OpusTags" in per_frame[0][1]
    pages = [page for frame_pages in per_frame for page in frame_pages]
    assert all(page.startswith(b"OggS") for page in pages)
    for page in pages[2:]:  # one packet per page: only the last lacing value is < 255
        lacing = page[27: 27 + page[26]]
        assert [v < 255 for v in lacing] == [False] * (len(lacing) - 1) + [True]
        assert len(page) == 27 + len(lacing) + sum(lacing)
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
            decoder.feed(b"".join(OggOpusEncoder().encode(np.zeros(FRAME_SAMPLES, dtype=np.float32))))
    finally:
        decoder.close()


def test_garbage_after_good_pages_is_refused_on_either_sphn():
    """sphn 0.1 would skip to the next page silently and 0.2 raise: both refuse here."""
    encoder, decoder = OggOpusEncoder(), OggOpusDecoder()
    try:
        good = b"".join(b"".join(encoder.encode(np.zeros(FRAME_SAMPLES, dtype=np.float32))) for _ in range(3))
        decoder.feed(good[:50])
        decoder.feed(good[50:])
        with pytest.raises(AudioError, match="OggS"):
            decoder.feed(b"\x01\x02not a page" + good)
    finally:
        decoder.close()


def test_the_codec_threads_batch_encodes_and_hand_decoded_audio_back(speech_pcm, codec):
    """Frames asked for in one pass of the loop are one job: the pages equal encoding each
    stream alone, in order; one stream's failure stays its own.  Decoding hands back all
    the PCM (sphn 0.1 decodes on a thread of its own: the codec thread polls it), and a
    stream that is not Ogg its typed error."""
    import asyncio

    from orchestrator.frontend.codec_threads import CodecThreads
    from orchestrator.protocol.ogg_opus import split_pages

    frames = (speech_pcm[: 6 * FRAME_SAMPLES].reshape(6, FRAME_SAMPLES) * 32767).astype(np.int16)

    async def scenario():
        threads = CodecThreads(asyncio.get_running_loop(), codec=codec, encode_threads=2)
        got: dict[int, list] = {0: [], 1: [], 2: []}
        try:
            streams = [OggOpusEncoder() for _ in range(3)]
            for t in range(2):
                for i in range(3):
                    threads.encode(streams[i], frames[2 * i + t], got[i].append)
            threads.encode(streams[0], frames[0][:100], got[0].append)  # not a frame: this stream's error
            threads.encode(streams[1], frames[5], got[1].append)
            while sum(map(len, got.values())) < 8:
                await asyncio.sleep(0.01)
            for i in range(3):
                alone = OggOpusEncoder()
                want = [alone.encode(frames[2 * i + t].astype(np.float32) / 32768.0) for t in range(2)]
                assert got[i][:2] == want
            assert isinstance(got[0][2], ValueError) and isinstance(got[1][2], list)

            stream = b"".join(page for pages in got[2][:2] for page in pages)
            assert split_pages(stream) == [page for pages in got[2][:2] for page in pages]
            decoded: list = []
            decoder = OggOpusDecoder()
            for cut in range(0, len(stream), 100):
                threads.decode(decoder, stream[cut:cut + 100], decoded.append)
            deadline = time.monotonic() + 5
            while sum(len(x) for x in decoded) < 2 * FRAME_SAMPLES and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sum(len(x) for x in decoded) == 2 * FRAME_SAMPLES
            threads.close(decoder)

            refused: list = []
            threads.decode(OggOpusDecoder(), b"not an ogg stream", refused.append)
            while not refused:
                await asyncio.sleep(0.01)
            assert isinstance(refused[0], AudioError) and refused[0].code == "bad_audio"
        finally:
            threads.stop()

    asyncio.run(scenario())


def test_the_audio_a_stream_may_run_ahead_is_reckoned_before_decoding():
    """Packets are counted and their duration read from their TOC bytes as pages complete,
    whatever the chunking; a stream whose audio runs more than max_ahead_s ahead of real time
    is refused before the reader sees it, however few bytes that audio takes."""
    from orchestrator.protocol.ogg_opus import OggPages, opus_packet_samples

    encoder = OggOpusEncoder()
    per_frame = [b"".join(encoder.encode(np.zeros(FRAME_SAMPLES, np.float32))) for _ in range(10)]
    stream = b"".join(per_frame)
    for cut in (1, 5, 333, len(stream)):
        pages = OggPages()
        for i in range(0, len(stream), cut):
            pages.check(stream[i:i + cut])
        assert (pages.packets, pages.samples) == (2 + len(split_opus(stream)), 10 * FRAME_SAMPLES)
    assert opus_packet_samples(bytes([(3 << 3) | 3, 2])) == 2 * 60 * 24  # two 60 ms SILK frames in 2 bytes

    now = [0.0]
    decoder = OggOpusDecoder(max_ahead_s=1.0, clock=lambda: now[0])
    try:
        tiny = ogg_page([bytes([(3 << 3) | 3, 2])] * 6, sequence=2)  # 18 bytes of packets: 0.72 s
        decoder.feed(per_frame[0])  # OpusHead, OpusTags and 80 ms
        decoder.feed(tiny)  # 0.8 s of the 1 s budget spent
        now[0] = 0.5  # half a second later: 0.7 s left
        with pytest.raises(AudioError) as refused:
            decoder.feed(tiny)
        assert refused.value.code == "input_backpressure"
        with pytest.raises(AudioError):  # the stream stays ended
            decoder.feed(tiny)
    finally:
        decoder.close()


def split_opus(stream: bytes) -> list[bytes]:
    """The audio pages of an encoder's stream (after OpusHead and OpusTags)."""
    from orchestrator.protocol.ogg_opus import split_pages

    return split_pages(stream)[2:]


def test_one_broken_stream_does_not_cost_the_others_their_audio(speech_pcm, codec):
    """A stream that sphn can no longer take (its decoder stopped on a bad page) fails alone
    (bad_audio); another stream's audio in the same batches is all handed back."""
    import asyncio

    from orchestrator.frontend.codec_threads import CodecThreads

    frames = speech_pcm[: 8 * FRAME_SAMPLES].reshape(8, FRAME_SAMPLES)
    encoder = OggOpusEncoder()
    per_frame = [b"".join(encoder.encode(frame)) for frame in frames]
    serial, sequence = page_ids(per_frame[2])
    # A well-formed page whose packet Opus refuses (code 3 with no frames): sphn 0.1's
    # decoding thread stops there, 0.2 raises.
    bad_page = ogg_page([bytes([0xFF, 0x00])], sequence=sequence, serial=serial)

    async def scenario():
        threads = CodecThreads(asyncio.get_running_loop(), codec=codec, encode_threads=2)
        healthy, broken = OggOpusDecoder(), OggOpusDecoder()
        got: list = []
        failed: list = []
        try:
            for i, chunk in enumerate(per_frame):
                threads.decode(healthy, chunk, got.append)
                threads.decode(broken, bytes(bad_page) if i == 2 else chunk, failed.append)
                await asyncio.sleep(0.02)
            deadline = time.monotonic() + 5
            while sum(len(x) for x in got) < 8 * FRAME_SAMPLES and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sum(len(x) for x in got) == 8 * FRAME_SAMPLES
            errors = [x for x in failed if isinstance(x, AudioError)]
            assert errors and {e.code for e in errors} == {"bad_audio"}
            threads.close(healthy)
            threads.close(broken)
        finally:
            threads.stop()

    asyncio.run(scenario())


def test_a_burst_of_encodes_leaves_the_event_loop_running(codec):
    """While a worker's Opus threads encode a burst of frames (a tick's worth for many
    sessions), its event loop keeps running: it is never held for long at a time, and it
    waits for the interpreter lock only a small part of the time.  Both are measured on the
    loop's own clock (wall time less its waits for a CPU), the lock wait as own time not spent
    computing, each as the best of three bursts (a waiter whose lock holder is itself waiting
    for a CPU counts that wait: a busy machine blurs single bursts).  Encoding on the loop's
    thread holds the loop for a whole burst (a 42 ms gap, planted) and fails the first check;
    sphn, which holds the lock for each encode, measured 0.63-0.85 of the loop's time waiting
    on an idle machine (0.14-0.36 beside the test suite: that it holds the lock is measured by
    opus_codec_bench, not judged here)."""
    import asyncio

    from orchestrator.frontend.codec_threads import CodecThreads
    from orchestrator.own_clock import OwnClock
    from tests.e2e.online_serving.opus_codec_bench import noise_frames

    frames = (noise_frames(48) * 32767).astype(np.int16)  # noise: the dearest audio to encode

    async def burst(threads: CodecThreads, encoders: list) -> tuple[float, float]:
        """The loop's longest own-time gap between passes, and the part of its own time spent
        waiting (for the lock), while the burst is encoded."""
        done: list = []
        clock = OwnClock()
        try:
            for encoder, frame in zip(encoders, frames):
                threads.encode(encoder, frame, done.append)
            started_own, started_cpu = clock.now(), time.thread_time()
            last, longest = started_own, 0.0
            while len(done) < len(frames):
                await asyncio.sleep(0)
                now = clock.now()
                longest, last = max(longest, now - last), now
                for _ in range(200):  # the loop's own work between passes
                    pass
            own, cpu = clock.now() - started_own, time.thread_time() - started_cpu
        finally:
            clock.close()
        assert all(isinstance(pages, list) for pages in done)
        return longest, max(0.0, own - cpu) / own

    async def scenario() -> list[tuple[float, float]]:
        threads = CodecThreads(asyncio.get_running_loop(), codec=codec, encode_threads=2)
        encoders = [threads.new_encoder() for _ in frames]
        try:
            return [await burst(threads, encoders) for _ in range(3)]
        finally:
            threads.stop()

    if codec != "libopus":
        pytest.skip("sphn holds the interpreter lock while it encodes: the fallback, not judged here")
    results = asyncio.run(scenario())
    longest = min(gap for gap, _ in results)
    waiting = min(share for _, share in results)
    assert longest < 0.010, results  # a burst is ~30 ms of encoding (48 x ~0.7 ms)
    assert waiting < 0.3, results


def test_libopus_streams_are_laid_out_as_sphn_writes_them(speech_pcm, codec):
    """What NVIDIA's clients get from NVIDIA's server (sphn 0.1's writer) they get from ours:
    the same OpusHead page byte for byte, and per frame one page with the same header (flags,
    granule position, serial, sequence) holding one packet of the same Opus configuration.
    (On this speech the packets are byte for byte sphn's too where the system's libopus is
    the version sphn bundles; that is a fact of the libraries, not checked here.)"""
    import sphn

    if codec != "libopus":
        pytest.skip("compares the two codecs: runs once, with libopus")
    if not hasattr(sphn.OpusStreamWriter, "read_bytes"):
        pytest.skip("sphn 0.2 writes two 40 ms packets per frame; NVIDIA's server runs 0.1")
    frames = speech_pcm[: 60 * FRAME_SAMPLES].reshape(60, FRAME_SAMPLES)
    encoder, reference = OggOpusEncoder(codec="libopus"), OggOpusEncoder(codec="sphn")
    ours = [page for frame in frames for page in encoder.encode(frame)]
    theirs = [page for frame in frames for page in reference.encode(frame)]
    assert len(ours) == len(theirs) == 2 + len(frames)
    assert ours[0] == theirs[0]  # OpusHead: version, one channel, pre-skip 3840, 24 kHz
    assert ours[1][:22] == theirs[1][:22] and b"OpusTags" in ours[1]
    for mine, reference_page in zip(ours[2:], theirs[2:]):
        assert mine[:22] == reference_page[:22]  # capture, version, flags, granule, serial, sequence
        body = mine[27 + mine[26]:]
        assert body[0] == reference_page[27 + reference_page[26]]  # TOC: mode, bandwidth, 80 ms
        assert len(mine) == 27 + mine[26] + sum(mine[27:27 + mine[26]])  # one packet, whole


def test_empty_packets_are_refused_not_decoded_into_minutes_of_audio(codec):
    """An empty packet is not Opus (at least one byte, RFC 6716 R1), but a decoder takes it as
    a lost packet and conceals it at any length: sphn 0.1 turned four pages of 255 empty
    packets into 980 s of audio, none of it charged against the stream's budget.  Refused
    before decoding, on either codec, and the stream ends."""
    decoder = OggOpusDecoder(max_ahead_s=1.0)
    try:
        head = b"".join(OggOpusEncoder().encode(np.zeros(FRAME_SAMPLES, dtype=np.float32)))
        decoded = len(_decode_all(decoder, [head], FRAME_SAMPLES))
        with pytest.raises(AudioError) as refused:
            decoder.feed(ogg_page([b""] * 255, sequence=2))
        assert refused.value.code == "bad_audio"
        with pytest.raises(AudioError):
            decoder.poll() if decoder.waiting else decoder.feed(ogg_page([b"\x03\x00"], sequence=3))
        assert decoded == FRAME_SAMPLES
    finally:
        decoder.close()
