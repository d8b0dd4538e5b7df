"""Voice + persona prefill as one parallel causal pass, cached per (voice, persona).

Every stream is teacher-forced during the system prompt, so the temporal KV cache it leaves
behind is a deterministic function of (voice, persona).  The reference spends one model
call per prompt frame (100-200 calls); we replay the token bookkeeping without the model to
learn what each position's input is, embed all positions at once, run the temporal
transformer once over the whole prompt, and keep the resulting keys/values.  Installing a
cached prefill into a slot is a copy.

Prompt phases (spec/model.md 4.3): the voice (replayed embeddings, N frames), 6 silence
frames, one frame per persona token, 6 silence frames.  Live audio starts at offset
P = N + 12 + T with P - 1 positions in the KV cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from .config import AUDIO_SILENCE_FRAMES, SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD_ID, LMConfig
from .lm import MoshiLM
from .modules.kv_ring import SlotKVRing
from .token_state import TokenState
from .voices import VoicePrompt


@dataclass(frozen=True)
class PromptFrame:
    """Tokens forced for one prompt frame: text, agent codebooks, user codebooks."""

    text: int
    agent: tuple[int, ...]
    user: tuple[int, ...]

    def streams(self) -> list[int]:
        return [self.text, *self.agent, *self.user]


def prompt_frames(persona_tokens: Sequence[int]) -> list[PromptFrame]:
    silence = PromptFrame(TEXT_PAD_ID, SILENCE_TOKENS, SINE_TOKENS)
    persona = [PromptFrame(int(t), SILENCE_TOKENS, SINE_TOKENS) for t in persona_tokens]
    return [silence] * AUDIO_SILENCE_FRAMES + persona + [silence] * AUDIO_SILENCE_FRAMES


def voice_replay_frame(cfg: LMConfig) -> PromptFrame:
    """The dummy tokens the reference forces while replaying voice embeddings."""
    init = cfg.audio_initial_id
    half = cfg.audio_codebooks
    return PromptFrame(TEXT_PAD_ID, (init,) * half, (init,) * half)


@dataclass(frozen=True)
class Prefill:
    """What a session's slot holds right after its system prompt."""

    keys: torch.Tensor  # [layers, heads, n, head_dim] of positions start..start+n-1
    values: torch.Tensor
    start: int
    token_cache: torch.Tensor  # [17, 4]
    token_provided: torch.Tensor  # [17, 4]
    offset: int  # P: the offset of the first live call

    @property
    def positions(self) -> int:
        return self.start + self.keys.shape[2]


def _frame_tensor(frame: PromptFrame, device: torch.device) -> torch.Tensor:
    return torch.tensor([frame.streams()], dtype=torch.long, device=device)


def build_prefill(
    lm: MoshiLM,
    kv: SlotKVRing,
    voice: VoicePrompt | None,
    persona_tokens: Sequence[int],
    window: str,
    scratch_slot: int = 0,
) -> Prefill:
    """Compute the prefill in one temporal pass using ``scratch_slot`` of ``kv``.

    The token bookkeeping of the prompt runs on the CPU (hundreds of tiny steps that would
    each be a kernel launch on a GPU); only the transformer pass runs on ``lm``'s device.
    """
    cfg = lm.cfg
    device = torch.device("cpu")
    tokens = TokenState(cfg, 1, device=device)
    slot = torch.tensor([0])
    kv.reset(torch.tensor([scratch_slot], device=lm.device))
    all_forced = torch.ones(1, cfg.num_streams, dtype=torch.bool, device=device)
    no_samples = (torch.zeros(1, dtype=torch.long, device=device),
                  torch.zeros(1, cfg.dep_q, dtype=torch.long, device=device))
    inputs: list[torch.Tensor] = []  # token rows of the positions after the voice

    def run_frame(frame: PromptFrame, record: bool) -> None:
        tokens.force(slot, _frame_tensor(frame, device), all_forced)
        if int(tokens.offset[0]) == 0:
            tokens.skip_call(slot)
            return
        model_input, _, _ = tokens.begin_call(slot)
        if record:
            inputs.append(model_input)
        # Every target entry is forced during the prompt, so no sample is ever stored.
        tokens.end_call(slot, *no_samples)

    voice_embeddings = None
    if voice is not None:
        dummy = voice_replay_frame(cfg)
        for _ in range(voice.frames):
            run_frame(dummy, record=False)
        tokens.cache[0] = voice.cache
        voice_embeddings = voice.embeddings.to(device=lm.device, dtype=lm.dtype)
    for frame in prompt_frames(persona_tokens):
        run_frame(frame, record=True)

    parts = []
    if voice_embeddings is not None:
        parts.append(voice_embeddings)
    if inputs:
        parts.append(lm.embed_tokens(torch.cat(inputs, dim=0).to(lm.device).unsqueeze(0))[0])
    x = torch.cat(parts, dim=0).unsqueeze(0)
    with torch.no_grad():
        lm.temporal(torch.tensor([scratch_slot], device=lm.device), x, kv, window)
    total = x.shape[1]
    start = max(0, total - kv.capacity)
    keys, values = kv.export(scratch_slot, start, total)
    cache, provided, offset = tokens.snapshot(0)
    return Prefill(keys, values, start, cache, provided, offset)


class PrefillCache:
    """LRU of prefills keyed by (voice name, persona token ids); safe to share by threads."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, Prefill] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Prefill | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: tuple, value: Prefill) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
