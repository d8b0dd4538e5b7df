"""MimiCodec against the PyPI moshi 0.2.13 oracle on a tiny random Mimi, plus slot isolation.

The tiny model keeps the real frame geometry (ratios 8,6,5,4 -> 1920 samples, 2 latent
steps per frame) and a transformer context of 8 latent steps, so the streaming attention
window wraps after 4 frames.
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("moshi")
sphn = pytest.importorskip("sphn")

from engines.errors import CheckpointError  # noqa: E402
from engines.model.mimi import MimiCodec  # noqa: E402
from engines.state.kv_ring import WindowMode  # noqa: E402
from tests.mimi_oracle import (  # noqa: E402
    FRAME,
    build_oracle,
    naive_windowed_transformer,
    official_state_dict,
    oracle_stream_decode,
    oracle_stream_encode,
    tiny_config,
)
from tests.orch_support import SPEECH_WAV  # noqa: E402

CONTEXT = 8  # latent steps; 4 frames
FIRST_WRAPPED_FRAME = CONTEXT // 2 - 1  # first frame whose reference window drops a key
NUM_FRAMES = 48


@pytest.fixture(scope="module")
def speech() -> torch.Tensor:
    pcm, sample_rate = sphn.read(str(SPEECH_WAV))
    assert sample_rate == 24000 and pcm.shape[0] == 1
    return torch.from_numpy(pcm[0]).float()


@pytest.fixture(scope="module")
def clip(speech) -> torch.Tensor:
    """NUM_FRAMES frames of speech (skipping the file's leading silence)."""
    start = 50 * FRAME
    return speech[start:start + NUM_FRAMES * FRAME]


def _tiny(speech, context):
    cfg = tiny_config(context)
    oracle = build_oracle(cfg, calibration_pcm=speech[-100 * FRAME:])
    return cfg, oracle, official_state_dict(oracle)


@pytest.fixture(scope="module")
def tiny(speech):
    return _tiny(speech, CONTEXT)


@pytest.fixture(scope="module")
def tiny_wide(speech):
    """Same tiny model with a context (250, as released) that never wraps in these tests."""
    return _tiny(speech, 250)


def make_codec(tiny, window=WindowMode.REFERENCE, num_slots=4) -> MimiCodec:
    cfg, _, state = tiny
    return MimiCodec.from_state_dict(cfg, state, num_slots, window=window)


def stream_encode(codec: MimiCodec, slots, pcm: torch.Tensor) -> torch.Tensor:
    """pcm [B, F*1920] -> codes [B, K, F] through encode_step."""
    frames = pcm.view(pcm.shape[0], -1, FRAME)
    return torch.stack([codec.encode_step(slots, frames[:, f]) for f in range(frames.shape[1])], dim=2)


def stream_decode(codec: MimiCodec, slots, codes: torch.Tensor) -> torch.Tensor:
    """codes [B, K, F] -> pcm [B, F*1920] through decode_step."""
    return torch.cat([codec.decode_step(slots, codes[:, :, f]) for f in range(codes.shape[2])], dim=1)


def assert_close_audio(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    scale = expected.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale)


# Oracle conformance ----------------------------------------------------------------------
def test_streaming_encode_matches_oracle_full_window(tiny, clip):
    oracle_codes = oracle_stream_encode(tiny[1], clip)
    codec = make_codec(tiny, WindowMode.FULL)
    codes = stream_encode(codec, torch.tensor([1]), clip[None])[0]
    assert codes.shape == (8, NUM_FRAMES)
    # The test only means something if codes move from frame to frame.
    assert all(len(set(row.tolist())) > 10 for row in oracle_codes)
    assert torch.equal(codes, oracle_codes)


def test_streaming_decode_matches_oracle_full_window(tiny, clip):
    oracle_codes = oracle_stream_encode(tiny[1], clip)
    expected = oracle_stream_decode(tiny[1], oracle_codes)
    pcm = stream_decode(make_codec(tiny, WindowMode.FULL), torch.tensor([2]), oracle_codes[None])[0]
    assert pcm.shape == (NUM_FRAMES * FRAME,)
    assert_close_audio(pcm, expected)


def test_non_streaming_matches_oracle(tiny, clip):
    codec, oracle = make_codec(tiny), tiny[1]
    pcm = clip[: -FRAME + 700]  # not a whole number of frames: the end is zero-padded
    with torch.no_grad():
        expected_codes = oracle.encode(pcm.view(1, 1, -1))
    codes = codec.encode(pcm[None])
    assert codes.shape == (1, 8, NUM_FRAMES)
    assert torch.equal(codes, expected_codes)
    with torch.no_grad():
        expected_pcm = oracle.decode(expected_codes)[:, 0]
    assert_close_audio(codec.decode(codes), expected_pcm)


def test_accepts_moshi_split_attention_names(tiny, clip):
    cfg, oracle, _ = tiny
    split = {k: v.clone() for k, v in oracle.state_dict().items()}
    assert any("in_projs.0.weight" in k for k in split)
    codec = MimiCodec.from_state_dict(cfg, split, 2, window=WindowMode.FULL)
    assert torch.equal(codec.encode(clip[None]), make_codec(tiny, WindowMode.FULL).encode(clip[None]))


# Attention window ------------------------------------------------------------------------
def test_reference_window_equals_full_until_wrap_then_differs(tiny, clip):
    slots = torch.tensor([0])
    ref, full = make_codec(tiny, WindowMode.REFERENCE), make_codec(tiny, WindowMode.FULL)
    ref_codes, full_codes = stream_encode(ref, slots, clip[None]), stream_encode(full, slots, clip[None])
    before = slice(0, FIRST_WRAPPED_FRAME)
    assert torch.equal(ref_codes[..., before], full_codes[..., before])
    assert not torch.equal(ref_codes[..., FIRST_WRAPPED_FRAME:], full_codes[..., FIRST_WRAPPED_FRAME:])
    ref_pcm, full_pcm = stream_decode(ref, slots, full_codes), stream_decode(full, slots, full_codes)
    samples_before = FIRST_WRAPPED_FRAME * FRAME
    assert torch.equal(ref_pcm[:, :samples_before], full_pcm[:, :samples_before])
    assert not torch.allclose(ref_pcm, full_pcm, atol=1e-6)


@pytest.mark.parametrize("window", [WindowMode.REFERENCE, WindowMode.FULL])
@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_streaming_transformer_follows_window_rule(tiny, clip, window, side):
    """Call-by-call ring attention == a per-query-mask float64 pass over the whole sequence."""
    cfg, oracle, _ = tiny
    codec = make_codec(tiny, window)
    with torch.no_grad():
        latent = oracle.encoder(clip.view(1, 1, -1))[0].T  # [T, D], 2 steps per frame
    steps = cfg.latent_steps_per_frame
    ours = getattr(codec, f"{side}_transformer")
    slots = torch.tensor([3])
    with torch.no_grad():
        streamed = torch.cat([ours.step(latent[None, t:t + steps], slots)[0]
                              for t in range(0, latent.shape[0], steps)])
    oracle_tr = getattr(oracle, f"{side}_transformer").transformer
    expected = naive_windowed_transformer(oracle_tr, latent, CONTEXT, steps, window)
    torch.testing.assert_close(streamed.double(), expected, rtol=0, atol=1e-5)
    # The rules really differ once the ring has wrapped.
    other = naive_windowed_transformer(oracle_tr, latent, CONTEXT, steps,
                                       "full" if window == WindowMode.REFERENCE else "reference")
    assert (other - expected).abs().max() > 1e-3


def test_streaming_equals_non_streaming(tiny_wide, clip):
    """Whole-signal encode/decode == frame-by-frame streaming (full window).

    With a context that wraps, moshi's own streaming and non-streaming passes differ:
    its ring of ``context`` entries has already dropped the oldest key the first query of
    each 2-step call would see.  So this uses the released context of 250 steps.
    The whole-signal pass runs PyTorch's default kernels (oneDNN for long inputs, like
    moshi) and streaming runs batch-invariant ones: latents agree to float precision, and
    a near-tie code may flip on some machines (it does for moshi itself).
    """
    slots = torch.tensor([2])
    codec = make_codec(tiny_wide, WindowMode.FULL)
    frames = clip.view(-1, FRAME)
    with torch.no_grad():
        streamed = torch.cat([codec._latent_step(slots, frame[None]) for frame in frames], dim=2)
        whole = codec._latent(clip[None])
    assert_close_audio(streamed, whole, rel=1e-5)

    codec.reset(slots)
    codes = stream_encode(codec, slots, clip[None])
    assert torch.equal(codes[0], oracle_stream_encode(tiny_wide[1], clip))
    agreement = (codes == codec.encode(clip[None])).float().mean().item()
    assert agreement >= 0.98, agreement
    assert_close_audio(stream_decode(codec, slots, codes), codec.decode(codes))


# Slots -----------------------------------------------------------------------------------
def _three_clips(speech, frames):
    return torch.stack([speech[(60 + 110 * i) * FRAME:(60 + 110 * i + frames) * FRAME] for i in range(3)])


def test_batched_slots_match_single_runs(tiny, speech):
    frames = 12
    audio = _three_clips(speech, frames)
    singles = []
    for pcm in audio:
        codec = make_codec(tiny)
        codes = stream_encode(codec, torch.tensor([0]), pcm[None])
        singles.append((codes[0], stream_decode(codec, torch.tensor([0]), codes)[0]))
    codec = make_codec(tiny)
    slots = torch.tensor([3, 0, 2])  # any order
    codes = stream_encode(codec, slots, audio)
    pcm = stream_decode(codec, slots, codes)
    for i, (single_codes, single_pcm) in enumerate(singles):
        assert torch.equal(codes[i], single_codes)
        # Bit-identical on a 2-thread CPU; a many-thread BLAS may split a lone slot's
        # GEMMs differently, hence the (very tight) tolerance.
        assert_close_audio(pcm[i], single_pcm, rel=1e-6)


def test_step_leaves_other_slots_untouched(tiny, speech):
    codec = make_codec(tiny)
    audio = _three_clips(speech, 3)
    stream_encode(codec, torch.tensor([0, 1, 2]), audio)
    stream_decode(codec, torch.tensor([0, 1, 2]), torch.randint(0, 2048, (3, 8, 3)))
    before = {slot: codec.slot_state(slot) for slot in range(4)}
    stream_encode(codec, torch.tensor([2, 0]), audio[:2, :FRAME])
    stream_decode(codec, torch.tensor([2]), torch.randint(0, 2048, (1, 8, 1)))
    for slot in (1, 3):
        after = codec.slot_state(slot)
        assert all(torch.equal(after[k], v) for k, v in before[slot].items())
    assert codec.slot_state(2)["encoder_transformer.ring.length"] == 8
    assert codec.slot_state(1)["encoder_transformer.ring.length"] == 6
    changed = codec.slot_state(0)
    assert not all(torch.equal(changed[k], v) for k, v in before[0].items())


def test_reset_restarts_one_slot_only(tiny, speech):
    frames = 6  # past the window wrap
    audio = _three_clips(speech, 2 * frames)
    first, second = audio[:, : frames * FRAME], audio[:, frames * FRAME:]
    codec, uninterrupted = make_codec(tiny), make_codec(tiny)
    slots = torch.tensor([0, 1])
    stream_encode(codec, slots, first[:2])
    stream_encode(uninterrupted, torch.tensor([0]), first[:1])
    warm_codes = torch.randint(0, 2048, (2, 8, frames))
    stream_decode(codec, slots, warm_codes)
    stream_decode(uninterrupted, torch.tensor([0]), warm_codes[:1])

    codec.reset(torch.tensor([1]))
    codes = stream_encode(codec, slots, torch.stack([second[0], second[2]]))
    pcm = stream_decode(codec, slots, codes)

    assert torch.equal(codes[0], stream_encode(uninterrupted, torch.tensor([0]), second[:1])[0])
    assert_close_audio(pcm[0], stream_decode(uninterrupted, torch.tensor([0]), codes[:1])[0], rel=1e-6)
    fresh = make_codec(tiny)
    assert torch.equal(codes[1], stream_encode(fresh, torch.tensor([3]), second[2:3])[0])
    assert_close_audio(pcm[1], stream_decode(fresh, torch.tensor([3]), codes[1:2])[0], rel=1e-6)


def test_reset_encoder_and_decoder_separately(tiny, speech):
    codec = make_codec(tiny)
    slots = torch.tensor([1])
    stream_encode(codec, slots, _three_clips(speech, 2)[:1])
    stream_decode(codec, slots, torch.randint(0, 2048, (1, 8, 2)))
    before = codec.slot_state(1)
    codec.reset_encoder(slots)
    after = codec.slot_state(1)
    for name, value in before.items():
        if name.startswith(("decoder", "upsample")):
            assert torch.equal(after[name], value), name
    assert after["encoder_transformer.ring.length"] == 0
    assert after["decoder_transformer.ring.length"] == 4
    codec.reset_decoder(slots)
    assert codec.slot_state(1)["decoder_transformer.ring.length"] == 0
    assert not codec.slot_state(1)["upsample.partial"].any()


# Real speech -----------------------------------------------------------------------------
def test_real_speech_round_trip(tiny, speech):
    codec = make_codec(tiny)
    codes = codec.encode(speech[None])
    assert codes.shape == (1, 8, 500) and codes.dtype == torch.long
    assert codes.min() >= 0 and codes.max() < 2048
    pcm = codec.decode(codes)
    assert pcm.shape == (1, 500 * FRAME) and torch.isfinite(pcm).all()


# Errors ----------------------------------------------------------------------------------
def test_missing_tensor_is_named(tiny):
    cfg, _, state = tiny
    broken = dict(state)
    del broken["decoder.model.5.convtr.convtr.weight"]
    with pytest.raises(CheckpointError, match=r"decoder\.model\.5\.convtr\.convtr\.weight"):
        MimiCodec.from_state_dict(cfg, broken, 1)
    broken = dict(state)
    del broken["quantizer.rvq_rest.vq.layers.6._codebook.embedding_sum"]
    with pytest.raises(CheckpointError, match=r"rvq_rest\.vq\.layers\.6\._codebook\.embedding_sum"):
        MimiCodec.from_state_dict(cfg, broken, 1)


def test_misshaped_tensor_is_named_with_shapes(tiny):
    cfg, _, state = tiny
    key = "encoder_transformer.transformer.layers.1.self_attn.in_proj_weight"
    broken = dict(state)
    broken[key] = torch.zeros(96, 16)
    with pytest.raises(CheckpointError) as err:
        MimiCodec.from_state_dict(cfg, broken, 1)
    message = str(err.value)
    assert key in message and "(96, 16)" in message and "(96, 32)" in message


def test_unused_quantizer_levels_are_optional(tiny, clip):
    """A checkpoint without a quantizer level past the codebooks the model uses loads, and
    codes and decodes exactly as the full one: the level was not used, nor replaced by
    anything (a loader that filled it in and used it would change the codes)."""
    cfg, _, state = tiny
    trimmed = {k: v for k, v in state.items() if "rvq_rest.vq.layers.20." not in k}
    assert len(trimmed) < len(state)
    full, lean = (MimiCodec.from_state_dict(cfg, s, 1) for s in (state, trimmed))
    slots = torch.tensor([0])
    pcm = clip[: 8 * FRAME].view(1, -1)
    codes = stream_encode(full, slots, pcm)
    assert torch.equal(stream_encode(lean, slots, pcm), codes)
    assert torch.equal(stream_decode(lean, slots, codes), stream_decode(full, slots, codes))


def test_bad_inputs_raise_value_error(tiny):
    codec = make_codec(tiny)
    frame = torch.zeros(2, FRAME)
    codes = torch.zeros(2, 8, dtype=torch.long)
    bad_calls = [
        lambda: codec.encode_step(torch.tensor([0, 1]), torch.zeros(2, FRAME - 1)),
        lambda: codec.encode_step(torch.tensor([0]), frame),
        lambda: codec.encode_step(torch.tensor([0, 0]), frame),
        lambda: codec.encode_step(torch.tensor([0, 4]), frame),
        lambda: codec.encode_step(torch.tensor([0, 1]), frame.long()),
        lambda: codec.decode_step(torch.tensor([0, 1]), torch.zeros(2, 7, dtype=torch.long)),
        lambda: codec.decode_step(torch.tensor([0, 1]), codes + 2048),
        lambda: codec.decode_step(torch.tensor([0, 1]), codes - 1),
        lambda: codec.decode_step(torch.tensor([0, 1]), codes.float()),
        lambda: codec.encode(torch.zeros(1, 2, FRAME)),
        lambda: codec.encode(torch.zeros(1, 0)),
        lambda: codec.decode(torch.zeros(1, 8, dtype=torch.long)),
        lambda: codec.decode(torch.full((1, 8, 2), 5000)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    for slot in range(4):  # nothing was advanced by the refused calls
        assert codec.slot_state(slot)["encoder_transformer.ring.length"] == 0
