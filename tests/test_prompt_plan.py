"""The closed-form prompt plan against the frame-by-frame replay of the token loop."""

from __future__ import annotations

import pytest
import torch

from engines.config import LMConfig
from engines.model.prefill import plan_prompt, plan_prompt_by_replay
from engines.checkpoints.voices import VoicePrompt


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
    assert torch.equal(fast.inputs, slow.inputs)
    assert torch.equal(fast.token_cache, slow.token_cache)
    assert torch.equal(fast.token_provided, slow.token_provided)
    assert fast.offset == slow.offset == (voice_frames or 0) + persona_len + 12
