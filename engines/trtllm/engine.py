"""The TensorRT-LLM backend: the engine interface over a compiled temporal transformer.

A tick for slots [B] is the PyTorch engine's tick with its temporal step swapped out:
Mimi-encode the user frame -> teacher-force the user codes into the token ring -> sum the
17 stream embeddings of each slot's input position (outside the engine) -> one engine call
with those B rows as its prompt table -> text logits and normed hidden state from the
engine's logits -> sample text -> depformer -> Mimi-decode.  Token bookkeeping, sampling,
the depformer and Mimi are the PyTorch engine's own code (``TokenState``, ``sampling``,
``MoshiLM.depformer``, ``MimiCodec``), so the two backends differ only in the temporal call.
A session's system prompt is one context call over its prompt embeddings, precomputed by
the converter for the bundled voices with the default persona.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ..config import LMConfig, MimiConfig
from ..engine import (
    _SlotSettings,  # the PyTorch engine's per-slot sampling state: both backends sample alike
)
from ..interface import (
    EngineInfo,
    FrameOutput,
    Pieces,
    PrefillUnavailable,
    SessionSpec,
    in_one_piece,
)
from ..lm import MoshiLM
from ..mimi import MimiCodec
from ..modules.kv_ring import WindowMode
from ..prefill import PrefillCache, plan_prompt, prompt_embeddings
from ..token_state import TokenState
from ..tokenizer import TextTokenizer
from ..voices import VoiceStore
from .layout import BuildLayout, BuildMeta
from .native import (
    StoredPrefill,
    load_prefills,
    partial_lm,
    read_tensors,
    stored_prefill,
)
from .plans import GraphDepformer, load_plans
from .sessions import SessionSlots
from .temporal import Executor, TemporalRunner

log = logging.getLogger(__name__)


class Codec(Protocol):
    """Mimi's streaming interface (``MimiCodec``, or its TensorRT plans)."""

    def encode_step(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor: ...

    def decode_step(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor: ...

    def reset(self, slots: torch.Tensor) -> None: ...


def attention_window(context: int, window: str) -> int:
    """Keys a query sees once the window is full (spec/model.md 10): NVIDIA's reference
    drops the oldest entry of its ring (context - 1 keys), upstream Kyutai keeps context."""
    if window == WindowMode.REFERENCE:
        return context - 1
    if window == WindowMode.FULL:
        return context
    raise ValueError(f"unknown window mode {window!r}")


class TrtllmEngine:
    def __init__(self, meta: BuildMeta, cfg: LMConfig, temporal: TemporalRunner, lm: MoshiLM, mimi: Codec,
                 tokenizer: TextTokenizer, voices: VoiceStore, stored: dict, num_slots: int,
                 device: torch.device, window: str, graph_depformer: GraphDepformer | None = None) -> None:
        self.meta = meta
        self.cfg = cfg
        self.temporal = temporal
        self.lm = lm  # embedding tables (+ depformer weights without a depformer plan): partial_lm
        self.graph_depformer = graph_depformer
        self.mimi = mimi
        self.tokenizer = tokenizer
        self.voice_store = voices
        self.stored = stored  # (voice, persona tokens) -> StoredPrefill, from the converter
        self.prefills = PrefillCache()
        self.num_slots = num_slots
        self.device = device
        self.window = window
        self.tokens = TokenState(cfg, num_slots, device=device)
        self.settings = _SlotSettings(num_slots, device)
        self.slots = SessionSlots(num_slots)
        self.info = EngineInfo(model=meta.model_name, backend="trtllm", device=str(device), max_slots=num_slots)

    # Construction -------------------------------------------------------------------------------
    @classmethod
    def from_build(cls, layout: BuildLayout, executor: Executor, num_slots: int, device: str = "cuda",
                   window: str = WindowMode.REFERENCE) -> TrtllmEngine:
        """The engine over a converted build directory; ``executor`` runs the temporal calls."""
        meta = layout.read_meta()
        if num_slots > meta.max_sessions:
            raise ValueError(f"{num_slots} sessions asked, the build is for at most {meta.max_sessions} "
                             "(set PERSONAPLEX_MAX_SESSIONS lower or convert with a larger --max-sessions)")
        dev = torch.device(device)
        dtype = getattr(torch, meta.dtype)
        cfg = LMConfig.from_moshi_kwargs(json.loads(layout.lm_config.read_text()))
        mimi, depformer = load_plans(layout.onnx, layout.plans, num_slots, dev, window, meta.depformer_steps, cfg.card)
        tensors = read_tensors(layout.embeddings, dev, dtype)
        if depformer is None:
            tensors.update(read_tensors(layout.depformer, dev, dtype))
        lm = partial_lm(cfg, meta.depformer_steps, tensors)
        if mimi is None:
            raw = json.loads(layout.mimi_config.read_text())
            mimi_cfg = MimiConfig.from_moshi_config(raw, num_codebooks=int(raw.get("num_codebooks", 8)))
            mimi = MimiCodec.from_state_dict(mimi_cfg, read_tensors(layout.mimi), num_slots, window=window, device=dev)
        voices = VoiceStore(layout.voices, None, None, cfg.dim, cfg.num_streams)
        temporal = TemporalRunner(executor, meta, num_slots, attention_window(cfg.context, window))
        return cls(meta, cfg, temporal, lm, mimi, TextTokenizer(layout.tokenizer), voices,
                   load_prefills(layout.prefill), num_slots, dev, window, depformer)

    # Engine interface -----------------------------------------------------------------------------
    def voices(self) -> list[str]:
        return self.voice_store.names()

    def validate(self, spec: SessionSpec) -> None:
        self.voice_store.check(spec.voice)

    def prepare(self, spec: SessionSpec) -> StoredPrefill:
        self.validate(spec)
        persona = tuple(self.tokenizer.persona_tokens(spec.effective_persona))
        key = (spec.voice, persona)
        prefill = self.stored.get(key) or self.prefills.get(key)
        if prefill is None:
            voice = self.voice_store.load(spec.voice)
            plan = plan_prompt(self.cfg, voice, persona)
            with torch.inference_mode():
                prefill = stored_prefill(prompt_embeddings(self.lm, voice, plan), plan)
            self.prefills.put(key, prefill)
            log.info("prompt embeddings for voice %s and a %d-token persona: %d positions", spec.voice,
                     len(persona), prefill.positions)
        if prefill.positions > self.meta.max_prefill:
            raise PrefillUnavailable(f"voice {spec.voice} with this persona needs {prefill.positions} prompt "
                                     f"positions; the engine takes {self.meta.max_prefill}")
        return prefill

    def prepare_in_pieces(self, spec: SessionSpec) -> Pieces[StoredPrefill]:
        """One piece: here ``prepare`` only embeds the prompt (milliseconds); the pass itself
        is the context phase that ``open_slot`` runs in TensorRT-LLM, which cannot be split."""
        return in_one_piece(lambda: self.prepare(spec))

    def open_slot(self, spec: SessionSpec, prefill: StoredPrefill | None = None) -> int:
        if prefill is None:
            prefill = self.prepare(spec)
        slot = self.slots.reserve()
        try:
            self._install(slot, prefill)
        except BaseException:
            self.slots.cancel(slot)
            raise
        self.slots.bind(slot, spec)
        self.settings.set(slot, spec)
        return slot

    def restart_slot(self, slot: int, prefill: StoredPrefill | None = None) -> None:
        self._install(slot, prefill if prefill is not None else self.prepare(self.slots.spec(slot)))

    def close_slot(self, slot: int) -> None:
        self.slots.release(slot)
        self._reset(slot)  # now, not on the next open: nothing of the session stays reachable

    def free_slots(self) -> int:
        return self.slots.free()

    def step(self, slots: Sequence[int], pcm: np.ndarray) -> list[FrameOutput]:
        if len(slots) == 0:
            return []
        pcm = self.slots.check_step(slots, pcm)
        idx = torch.tensor(list(slots), device=self.device, dtype=torch.long)
        with torch.inference_mode():
            user = self.mimi.encode_step(idx, torch.from_numpy(pcm).to(self.device))
            frame = self.tick(list(slots), idx, user)
            audio = self.mimi.decode_step(idx, frame[:, 1 : 1 + self.cfg.audio_codebooks]).float().cpu().numpy()
        return [FrameOutput(audio[i], t, self.tokenizer.transcript_piece(t)) for i, t in enumerate(frame[:, 0].tolist())]

    # The tick -------------------------------------------------------------------------------------
    def tick(self, slots: list[int], idx: torch.Tensor, user_codes: torch.Tensor) -> torch.Tensor:
        """One live model call with ``user_codes`` [B, 8] forced; the emitted frames [B, 17]."""
        cfg = self.cfg
        half = cfg.audio_codebooks
        forced = torch.zeros(len(slots), cfg.num_streams, dtype=torch.long, device=self.device)
        forced[:, 1 + half :] = user_codes
        mask = torch.zeros_like(forced, dtype=torch.bool)
        mask[:, 1 + half :] = True
        self.tokens.force(idx, forced, mask)
        model_input, target, target_forced = self.tokens.begin_call(idx)
        x = self.lm.embed_tokens(model_input.unsqueeze(1))[:, 0]
        text_logits, hidden = self.temporal.step(slots, x)
        text = self._sample(idx, 0, text_logits.float(), text=True)
        text_in = torch.where(target_forced[:, 0], target[:, 0], text)
        steps = self.meta.depformer_steps
        forced_audio, forced_mask = target[:, 1 : 1 + steps], target_forced[:, 1 : 1 + steps]
        if self.graph_depformer is not None:
            audio = self.graph_depformer(idx, hidden, text_in, forced_audio, forced_mask, self.settings)
        else:
            audio = self.lm.depformer(hidden.to(self.lm.dtype), text_in, forced_audio, forced_mask,
                                      lambda k, logits: self._sample(idx, 1 + k, logits, text=False), self.window)
        self.settings.counter[idx] += 1
        return self.tokens.end_call(idx, text, audio, live=True)

    def _sample(self, idx: torch.Tensor, stream: int, logits: torch.Tensor, text: bool) -> torch.Tensor:
        return self.settings.sample(idx, stream, logits, text)

    # Slots ------------------------------------------------------------------------------------------
    def _install(self, slot: int, prefill: StoredPrefill) -> None:
        self._reset(slot)
        with torch.inference_mode():
            self.temporal.prefill(slot, prefill.embeddings.to(self.device))
        self.tokens.restore(slot, prefill.token_cache, prefill.token_provided, prefill.offset)

    def _reset(self, slot: int) -> None:
        idx = torch.tensor([slot], device=self.device)
        self.temporal.release(slot)
        self.tokens.reset(idx)
        self.mimi.reset(idx)
        self.settings.counter[slot] = 0
