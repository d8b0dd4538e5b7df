"""A tick whose sessions are all greedy takes the argmaxes only (``EngineOptions.greedy_ticks``):
the same tokens as the sampler's greedy rows, chosen from host state, and never for a tick
with a sampling session in it.  (The GPU's argmax graph: tests/test_gpu_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.checkpoints import loader as ckpt
from engines.interface import SamplingParams, SessionSpec
from engines.model import sampling
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.state.session_slots import SlotSampling

GREEDY = SessionSpec(sampling=SamplingParams(greedy=True))
COLD = SessionSpec(sampling=SamplingParams(temp_text=0.0, temp_audio=0.0), seed=1)  # greedy by temperature
SAMPLED = SessionSpec(seed=5)


def _texts(engine, specs, frames):
    slots = [engine.open_slot(s) for s in specs]
    out = [[o.text_id for o in engine.step(slots, frames[:, f])] for f in range(frames.shape[1])]
    for slot in slots:
        engine.close_slot(slot)
    return out


@pytest.fixture(scope="module")
def frames(speech_pcm):
    return np.stack([speech_pcm[s * 24000 : s * 24000 + 12 * 1920].reshape(12, 1920) for s in (1, 10)])


def test_host_state_says_which_slots_are_all_greedy():
    slots = SlotSampling(4, torch.device("cpu"))
    for slot, spec in enumerate([GREEDY, COLD, SAMPLED, SessionSpec(sampling=SamplingParams(temp_text=0.0))]):
        slots.set(slot, spec)
    assert slots.all_greedy([0, 1]) and slots.all_greedy([1])
    assert not slots.all_greedy([0, 2]) and not slots.all_greedy([3])  # text greedy, audio sampled


def test_greedy_ticks_give_the_sampler_s_tokens_and_skip_it(tiny_checkpoint, frames, monkeypatch):
    files = ckpt.locate(tiny_checkpoint)
    fast = PersonaPlexEngine.from_files(files, 2, EngineOptions())
    plain = PersonaPlexEngine.from_files(files, 2, EngineOptions(greedy_ticks=False))
    want = _texts(plain, [GREEDY, COLD], frames)
    calls = []
    real = sampling.sample_tokens
    monkeypatch.setattr("engines.state.session_slots.sample_tokens",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert _texts(fast, [GREEDY, COLD], frames) == want
    assert calls == []  # the sampler never ran
    mixed = _texts(fast, [GREEDY, SAMPLED], frames)
    assert calls  # a sampled session in the tick: the sampler ran
    assert mixed == _texts(plain, [GREEDY, SAMPLED], frames)
