"""The closed-form prompt plan against the frame-by-frame replay of the token loop."""

from __future__ import annotations

import pytest
import torch

from engines.config import LMConfig
from engines.model.prefill import plan_prompt, plan_prompt_by_replay
from engines.model.prefill import VoicePrompt


@pytest.mark.parametrize("voice_frames", [None, 1, 2, 3, 4, 5, 7, 60])
@pytest.mark.parametrize("persona_len", [0, 1, 2, 3, 7, 100])
def test_closed_form_plan_equals_the_replay(voice_frames, persona_len):
    cfg = LMConfig()
    g = torch.Generator().manual_seed((voice_frames or 0) + 100 * persona_len)
    voice = None
    if voice_frames is not None:
        # A saved ring that differs from everything the prompt writes, so a wrong source shows.
        voice = VoicePrompt("v.pt", torch.zeros(voice_frames - 1, 8), torch.randint(0, 2000, (17, 4), generator=g))
    persona = torch.randint(0, cfg.text_card, (persona_len,), generator=g).tolist()
    fast, slow = plan_prompt(cfg, voice, persona), plan_prompt_by_replay(cfg, voice, persona)
    assert fast.length == slow.length
    assert torch.equal(fast.rows(), slow.rows())
    assert torch.equal(fast.token_cache, slow.token_cache)
    assert torch.equal(fast.token_provided, slow.token_provided)
    assert fast.offset == slow.offset == (voice_frames or 0) + persona_len + 12


@pytest.mark.parametrize("voice_frames", [None, 3, 60])
def test_a_plan_asked_a_range_at_a_time_gives_the_replay_s_rows(voice_frames):
    """A long persona's prefill asks for its rows one piece at a time; every range, including
    ones across the voice, persona and silence boundaries and past the end, is the replay's."""
    cfg = LMConfig()
    g = torch.Generator().manual_seed(7)
    voice = None
    if voice_frames is not None:
        voice = VoicePrompt("v.pt", torch.zeros(voice_frames - 1, 8), torch.randint(0, 2000, (17, 4), generator=g))
    persona = torch.randint(0, cfg.text_card, (300,), generator=g).tolist()
    fast, slow = plan_prompt(cfg, voice, persona), plan_prompt_by_replay(cfg, voice, persona)
    whole = slow.rows()
    for start, end in [(0, 1), (0, 7), (5, 6), (3, 100), (250, 317), (300, 400), (311, 311), (0, None)]:
        stop = whole.shape[0] if end is None else min(end, whole.shape[0])
        assert torch.equal(fast.rows(start, end), whole[start:stop]), (start, end)
    pieces = torch.cat([fast.rows(a, a + 64) for a in range(0, fast.length, 64)])
    assert torch.equal(pieces, whole)
