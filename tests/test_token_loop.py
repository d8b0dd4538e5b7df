"""The PersonaPlex delayed-token loop (spec/model.md 3.2): what the model sees and emits."""

from __future__ import annotations

import pytest
import torch

from engines.checkpoints import loader as ckpt
from engines.config import SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD_ID
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.interface import SamplingParams, SessionSpec


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 2, EngineOptions())


def random_frames(cfg, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, cfg.card, (n, cfg.num_streams), generator=g)
    frames[:, 0] = torch.randint(0, cfg.text_card, (n,), generator=g)
    return frames


def test_forced_frames_come_out_one_frame_late_and_the_first_is_discarded(engine):
    cfg = engine.cfg
    slot = torch.tensor([engine.scratch])
    engine._reset(engine.scratch)
    frames = random_frames(cfg, 10)
    mask = torch.ones(1, cfg.num_streams, dtype=torch.bool)
    captured, outs = [], []
    with torch.inference_mode():
        for f in frames:
            outs.append(engine.lm_call(slot, f.view(1, -1), mask, capture=captured))
    assert outs[0] is None and outs[1] is None  # offset 0: no model call; offset 1: no output
    for c in range(2, len(frames)):
        assert torch.equal(outs[c][0], frames[c - 1])  # frame c-1, fully de-delayed
    delays = torch.tensor(cfg.delays)
    initial = torch.tensor(cfg.initial_tokens())
    assert len(captured) == len(frames) - 1
    for j, x in enumerate(captured):
        q = j  # the call at offset j+1 feeds position j
        expected = torch.where(delays == 0, frames[q], frames[q - 1] if q >= 1 else initial)
        expected = torch.where(q <= delays, initial, expected)
        assert torch.equal(x, engine.lm.embed_tokens(expected.view(1, 1, -1))), f"position {q}"
    # The very first frame given to a session never reaches the model.
    assert all(not torch.equal(x, engine.lm.embed_tokens(frames[0].view(1, 1, -1))) for x in captured)
    engine._reset(engine.scratch)


def test_first_live_frame_is_the_last_prompt_frame(engine):
    cfg = engine.cfg
    slot = engine.open_slot(SessionSpec(sampling=SamplingParams(greedy=True)))
    idx = torch.tensor([slot])
    user = torch.tensor([SINE_TOKENS])  # any valid user codes
    with torch.inference_mode():
        first = engine.step_tokens(idx, user)[0]
        second = engine.step_tokens(idx, user)[0]
    assert int(first[0]) == TEXT_PAD_ID
    assert first[1 : 1 + cfg.audio_codebooks].tolist() == list(SILENCE_TOKENS)
    assert first[1 + cfg.audio_codebooks :].tolist() == list(SINE_TOKENS)
    # From the second live call on, the agent side is the model's own (greedy) output.
    assert second[1 : 1 + cfg.audio_codebooks].tolist() != list(SILENCE_TOKENS)
    engine.close_slot(slot)


def test_prefill_length_is_voice_plus_silences_plus_persona(engine):
    spec = SessionSpec(voice="NATF2.pt", persona="Hello there.")
    persona = engine.tokenizer.persona_tokens("Hello there.")
    voice = engine.voice_store.load("NATF2.pt")
    prefill = engine.prepare(spec)
    assert prefill.offset == voice.frames + 12 + len(persona)
    assert prefill.positions == prefill.offset - 1


def test_forcing_the_user_codes_at_the_end_of_a_live_call_changes_nothing(engine):
    """``step_tokens`` forces the user's codes after the model call (so that their encoding can
    overlap it on the GPU); a session stepped that way emits what one forced first emits."""
    cfg = engine.cfg
    spec = SessionSpec(sampling=SamplingParams(greedy=True))
    late, early = engine.open_slot(spec), engine.open_slot(spec)
    half = cfg.audio_codebooks
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for _ in range(8):
            user = torch.randint(0, cfg.card, (1, half), generator=g)
            forced = torch.zeros(1, cfg.num_streams, dtype=torch.long)
            mask = torch.zeros_like(forced, dtype=torch.bool)
            forced[:, 1 + half :], mask[:, 1 + half :] = user, True
            got = engine.step_tokens(torch.tensor([late]), user)
            want = engine.lm_call(torch.tensor([early]), forced, mask, live=True)
            assert torch.equal(got, want)
        assert torch.equal(engine.tokens.cache[late], engine.tokens.cache[early])
        assert torch.equal(engine.tokens.provided[late], engine.tokens.provided[early])
    engine.close_slot(late)
    engine.close_slot(early)


def test_a_sixteen_step_depformer_is_teacher_forced_with_this_frames_user_codes(tiny_checkpoint):
    """With the user side's depformer steps run too (the conformance setting), their targets
    at the call's position are this frame's user codes, forced before the model call: the
    first user codebook (delay 0) is teacher-forced in every live call."""
    engine = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 1, EngineOptions(depformer_steps=16))
    cfg = engine.cfg
    half = cfg.audio_codebooks
    seen = []
    depformer_call = engine.depformer_call

    def recording(slots, hidden, text, forced, forced_mask):
        seen.append((forced.clone(), forced_mask.clone()))
        return depformer_call(slots, hidden, text, forced, forced_mask)

    engine.depformer_call = recording
    slot = engine.open_slot(SessionSpec(sampling=SamplingParams(greedy=True)))
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for _ in range(4):
            user = torch.randint(0, cfg.card, (1, half), generator=g)
            engine.step_tokens(torch.tensor([slot]), user)
            forced, mask = seen[-1]
            first_user = half  # depformer step of stream 1 + half (delay 0)
            assert bool(mask[0, first_user]) and int(forced[0, first_user]) == int(user[0, 0])
    engine.close_slot(slot)
