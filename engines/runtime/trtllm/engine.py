"""The TensorRT-LLM backend: the engine interface over a compiled temporal transformer.

The tick is the shared runtime's (``engines.runtime.engine_runtime``) with its temporal call made by the
engine: the 17 stream embeddings of each slot's input position are summed outside it, the B
rows go in as its prompt table, and the text logits and normed hidden state come back from
its logits.  A session's system prompt is one context call over its prompt embeddings,
precomputed by the converter for the bundled voices with the default persona.  Mimi and the
depformer may run as TensorRT plans (``plans``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import NoReturn, Protocol

import numpy as np
import torch

from engines.config import LMConfig, MimiConfig, WindowMode
from engines.interface import EngineInfo, FrameOutput, Pieces, PrefillUnavailable, SessionSpec, SlotFault, in_one_piece
from engines.model.lm import MoshiLM
from engines.model.mimi import MimiCodec
from engines.model.prefill import PrefillCache, plan_prompt, prompt_embeddings
from engines.runtime.engine_runtime import EngineRuntime
from engines.checkpoints.tokenizer import TextTokenizer
from engines.checkpoints.voices import VoiceStore
from engines.runtime.trtllm.layout import BuildLayout, BuildMeta
from engines.runtime.trtllm.native import (
    StoredPrefill,
    load_prefills,
    partial_lm,
    read_tensors,
    stored_prefill,
)
from engines.runtime.trtllm.plans import GraphDepformer, load_plans
from engines.runtime.trtllm.temporal import Executor, TemporalRunner, positions_exhausted

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


class TrtllmEngine(EngineRuntime):
    def __init__(self, meta: BuildMeta, cfg: LMConfig, temporal: TemporalRunner, lm: MoshiLM, mimi: Codec,
                 tokenizer: TextTokenizer, voices: VoiceStore, stored: dict, num_slots: int,
                 device: torch.device, window: str, graph_depformer: GraphDepformer | None = None) -> None:
        # ``lm``: the embedding tables (+ depformer weights without a depformer plan): partial_lm
        super().__init__(cfg, lm, mimi, tokenizer, voices, num_slots, device, window, scratch=False)
        self.meta = meta
        self.temporal = temporal
        self.graph_depformer = graph_depformer
        self.stored = stored  # (voice, persona tokens) -> StoredPrefill, from the converter
        self.prefills = PrefillCache()
        self._tick_slots: list[int] | None = None  # run_tick's slots, while it runs
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

    # The backend ------------------------------------------------------------------------------------
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

    def capture_graphs(self) -> None:
        """Nothing to do: trtllm-build compiled the engine, and its runtime captures its own."""

    def run_tick(self, slots: Sequence[int], pcm: np.ndarray) -> tuple[np.ndarray, list[int]]:
        full = self.temporal.full_slots(slots)
        if full:
            self._step_all_but(full, slots, pcm)
        # The runner maps slots to sequences on the host: keep this tick's list rather than
        # read it back from the device mid-tick (a synchronisation).
        self._tick_slots = list(slots)
        try:
            return super().run_tick(slots, pcm)
        finally:
            self._tick_slots = None

    def _step_all_but(self, full: list[int], slots: Sequence[int], pcm: np.ndarray) -> NoReturn:
        """Slots at the engine's ``--max-positions`` cannot step: the tick's other slots step
        without them, then ``SlotFault`` names only the full ones, with the others' outputs
        (the caller restarts the full slots and hands the outputs on).  Checked before the
        tick, not in the engine call: by then Mimi and the token ring would have advanced
        every slot, the full ones included.  The form with outputs, not a fault before the
        step, so the other sessions do not lose this tick.  A fault of the others' own step
        joins this one: its slots are named too, and if none of them advanced, none did."""
        keep = [i for i, slot in enumerate(slots) if slot not in full]
        message = positions_exhausted(full, self.meta.max_positions)
        try:
            kept: Sequence[FrameOutput | None] = self.step([slots[i] for i in keep], pcm[keep])
        except SlotFault as fault:
            failed = [*full, *fault.slots]
            if fault.outputs is None:
                raise SlotFault(f"{message}; {fault}", failed) from fault
            kept, full, message = fault.outputs, failed, f"{message}; {fault}"
        outputs: list[FrameOutput | None] = [None] * len(slots)
        for i, out in zip(keep, kept, strict=True):
            outputs[i] = out
        raise SlotFault(message, full, outputs)

    def temporal_call(self, slots: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        host_slots = self._tick_slots if self._tick_slots is not None else slots.tolist()
        text_logits, hidden = self.temporal.step(host_slots, x[:, 0])
        return hidden, text_logits.float()

    def depformer_call(self, slots: torch.Tensor, hidden: torch.Tensor, text: torch.Tensor, forced: torch.Tensor,
                       forced_mask: torch.Tensor) -> torch.Tensor:
        if self.graph_depformer is not None:
            return self.graph_depformer(slots, hidden, text, forced, forced_mask, self.sampling)
        return super().depformer_call(slots, hidden.to(self.lm.dtype), text, forced, forced_mask)

    def install_context(self, slot: int, prefill: StoredPrefill) -> None:
        with torch.inference_mode():
            self.temporal.prefill(slot, prefill.embeddings.to(self.device))

    def release_context(self, slot: int) -> None:
        self.temporal.release(slot)
