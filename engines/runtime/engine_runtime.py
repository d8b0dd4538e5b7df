"""The engine runtime both backends share: session slots, sampling settings, the token ring,
Mimi, and one implementation of the tick's call sequence (spec/model.md 3.2).

A tick for slots [B]: Mimi-encode each slot's 80 ms of user audio -> teacher-force the user
codes into each slot's token ring -> embed the input position's 17 streams -> the temporal
transformer -> sample text -> the depformer (8 agent codebooks by default) -> Mimi-decode the
de-delayed agent frame.  A backend (``torch_engine.PersonaPlexEngine``, ``trtllm.engine.TrtllmEngine``)
supplies what differs: where the temporal transformer runs and holds each slot's context
(``temporal_call``, ``install_context``, ``release_context``), how a session's system prompt
is prepared (``prepare_in_pieces``), and optionally a faster tick or depformer.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from engines.config import LMConfig
from engines.interface import EngineInfo, FrameOutput, SessionSpec, to_completion
from engines.model.lm import MoshiLM
from engines.runtime.profiling import StageClock
from engines.state.session_slots import SessionSlots, SlotSampling
from engines.state.token_state import TokenState
from engines.checkpoints.tokenizer import TextTokenizer
from engines.checkpoints.voices import VoiceStore


class EngineRuntime:
    """``num_slots`` session slots and the shared tick.  ``scratch``: one more slot past the
    sessions' (``self.scratch``) for work that is no session's: tick-graph padding, voices."""

    info: EngineInfo

    def __init__(self, cfg: LMConfig, lm: MoshiLM, mimi: Any, tokenizer: TextTokenizer, voices: VoiceStore,
                 num_slots: int, device: torch.device, window: str, scratch: bool) -> None:
        self.cfg = cfg
        self.lm = lm  # the embedding tables and the depformer (all of the model for the PyTorch backend)
        self.mimi = mimi
        self.tokenizer = tokenizer
        self.voice_store = voices
        self.num_slots = num_slots
        self.device = device
        self.window = window
        self.slots = SessionSlots(num_slots)
        total = num_slots + 1 if scratch else num_slots
        self.scratch = num_slots if scratch else None
        self.tokens = TokenState(cfg, total, device=device)
        self.sampling = SlotSampling(total, device)
        self.clock = StageClock()  # per-stage timing for benchmarks (GPU only)
        # A CUDA stream for Mimi's encoding of the user's audio beside the LM call, or None
        # (encode first, on the current stream).
        self.encode_stream: torch.cuda.Stream | None = None

    # What a backend provides ------------------------------------------------------------------
    def temporal_call(self, slots: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The temporal transformer on input embeddings ``x`` [B, 1, D] of ``slots`` at their
        next positions: (normed hidden state [B, D], text logits [B, text_card] in float32)."""
        raise NotImplementedError

    def install_context(self, slot: int, prefill: Any) -> None:
        """Give ``slot`` the temporal context of ``prefill`` (``prepare``'s result)."""
        raise NotImplementedError

    def release_context(self, slot: int) -> None:
        """Forget ``slot``'s temporal context."""
        raise NotImplementedError

    def release_contexts(self, slots: list[int], idx: torch.Tensor) -> None:
        """``release_context`` of several slots (``idx``: the same on the device); a backend
        whose release is one write for any number of slots overrides it."""
        for slot in slots:
            self.release_context(slot)

    def prepare_in_pieces(self, spec: SessionSpec) -> Any:
        raise NotImplementedError

    def depformer_call(self, slots: torch.Tensor, hidden: torch.Tensor, text: torch.Tensor, forced: torch.Tensor,
                       forced_mask: torch.Tensor) -> torch.Tensor:
        """The depformer's samples [B, steps] for one frame (``MoshiLM.depformer``)."""
        sample = self.sampler(slots, text=False)  # the slots' settings gathered once for all steps
        return self.lm.depformer(hidden, text, forced, forced_mask, lambda k, logits: sample(1 + k, logits),
                                 self.window)

    def sample(self, slots: torch.Tensor, stream: int, logits: torch.Tensor, text: bool) -> torch.Tensor:
        """``stream``'s tokens for ``slots`` from float32 ``logits`` with their settings."""
        return self.sampler(slots, text)(stream, logits)

    def sampler(self, slots: torch.Tensor, text: bool) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``sample`` for ``slots`` and one kind of stream, as a function of (stream, logits):
        a backend may gather the slots' settings once for several streams."""
        return lambda stream, logits: self.sampling.sample(slots, stream, logits, text)

    def encode_user(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor:
        return self.mimi.encode_step(slots, pcm)

    def decode_agent(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.mimi.decode_step(slots, codes)

    def run_tick(self, slots: Sequence[int], pcm: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """One tick of checked ``slots``: (agent pcm [B, 1920], text ids), eagerly."""
        idx = torch.tensor(list(slots), device=self.device, dtype=torch.long)
        with torch.inference_mode():
            self.clock.start()
            agent_pcm, text = self.live_tick(idx, torch.from_numpy(pcm).to(self.device))
        text_ids = text.tolist()  # the tick's one host synchronisation
        return agent_pcm.float().cpu().numpy(), text_ids

    def capture_graphs(self) -> None:
        """Nothing to capture unless a backend says otherwise."""

    def settle_memory_plan(self) -> Any:
        """The backend's memory plan, measured (start-up, after ``capture_graphs``), or None
        for a backend that makes none (``memory_plan``)."""
        return None

    # Engine interface ---------------------------------------------------------------------------
    def voices(self) -> list[str]:
        return self.voice_store.names()

    def validate(self, spec: SessionSpec) -> None:
        self.voice_store.check(spec.voice)

    def prepare(self, spec: SessionSpec) -> Any:
        return to_completion(self.prepare_in_pieces(spec))

    def open_slot(self, spec: SessionSpec, prefill: Any = None) -> int:
        """``prefill``: ``prepare``'s result (benchmarks also fill windows this way)."""
        if prefill is None:
            prefill = self.prepare(spec)
        slot = self.slots.reserve()
        try:
            self.sampling.set(slot, spec)
            self._install(slot, prefill)
        except BaseException:
            try:
                self._reset(slot)  # nothing of a half-installed session stays reachable
            finally:
                self.slots.cancel(slot)  # whatever failed, the slot is not lost
            raise
        self.slots.bind(slot, spec)
        return slot

    def restart_slot(self, slot: int, prefill: Any = None) -> None:
        spec = self.slots.spec(slot)
        self._install(slot, prefill if prefill is not None else self.prepare(spec))

    def close_slot(self, slot: int) -> None:
        """Free ``slot``, wiped now rather than on the next open: nothing of its session stays
        reachable.  The slot is free even if the wipe raises."""
        self._wipe_and_release([slot])

    def close_slots(self, slots: Sequence[int]) -> None:
        """``close_slot`` of several slots at once: one wipe of all of them.  A wipe is ~60
        small writes and as many host synchronisations whatever the number of slots (1.4-1.8
        ms on an idle H200, 2.2-2.9 ms in the server), so a burst of closes costs about one
        close, not one each (76: 1.5 ms against 107-135 ms).  Every open slot of ``slots`` is
        free afterwards even if the wipe raises; one that is not open is a ``ValueError``,
        raised after the others are closed."""
        self._wipe_and_release(slots)

    def _wipe_and_release(self, slots: Sequence[int]) -> None:
        """Wipe and release the open slots of ``slots`` (what both closes do)."""
        open_slots, not_open = [], []
        for slot in dict.fromkeys(slots):
            (open_slots if self.slots.is_open(slot) else not_open).append(slot)
        try:
            if open_slots:
                self._reset_many(open_slots)
        finally:
            for slot in open_slots:
                self.slots.release(slot)
        if not_open:
            raise ValueError(f"slot(s) {', '.join(map(str, not_open))} not open")

    def free_slots(self) -> int:
        return self.slots.free()

    def allocator_counters(self) -> dict[str, int]:
        """What the device's memory allocator has done so far (torch's cumulative counters),
        for explaining a slow tick (orchestrator/lockstep/slow_ticks.py): a retry freed the
        allocator's cache and synchronised the device; a device allocation or free is a
        cudaMalloc or cudaFree.  Empty off CUDA.  A host call, no device sync."""
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in (
            ("alloc_retries", "num_alloc_retries"), ("device_allocs", "num_device_alloc"),
            ("device_frees", "num_device_free"), ("ooms", "num_ooms"))}

    def open_slots(self) -> list[int]:
        return self.slots.open()

    def step(self, slots: Sequence[int], pcm: np.ndarray) -> list[FrameOutput]:
        if len(slots) == 0:
            return []
        self.clock.host_start()
        pcm = self.slots.check_step(slots, pcm)
        audio, text_ids = self.run_tick(slots, pcm)
        outputs = [FrameOutput(audio[i], t, self.tokenizer.transcript_piece(t)) for i, t in enumerate(text_ids)]
        self.clock.host_mark("outputs")
        return outputs

    # The tick -------------------------------------------------------------------------------------
    def live_tick(self, slots: torch.Tensor, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode -> LM -> depformer -> decode for live ``slots`` [B] with ``pcm`` [B, 1920].

        Device tensors in and out (agent pcm [B, 1920], text ids [B]); no validation, and no
        host synchronisation of its own (the PyTorch backend captures it in a CUDA graph; the
        TensorRT-LLM engine call is not capturable and samples with data-dependent shapes).
        With ``encode_stream`` set, Mimi encodes the user's audio on that stream, beside the
        LM call on the current one (``step_tokens`` says why that is the same computation).
        """
        side = self.encode_stream
        if side is None:
            user_codes = self.encode_user(slots, pcm)
        else:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                user_codes = self.encode_user(slots, pcm)
        self.clock.mark("mimi_encode")  # with a side stream: the encode's launch only
        out = self.step_tokens(slots, user_codes, encoded_on=side)
        # Rows of the scratch slot (graph padding) may hold placeholder ids: clamp for Mimi.
        agent = out[:, 1 : 1 + self.cfg.audio_codebooks].clamp(0, self.cfg.card - 1)
        agent_pcm = self.decode_agent(slots, agent)
        self.clock.mark("mimi_decode")
        return agent_pcm, out[:, 0]

    def step_tokens(self, slots: torch.Tensor, user_codes: torch.Tensor,
                    encoded_on: torch.cuda.Stream | None = None) -> torch.Tensor:
        """One live LM call with ``user_codes`` [B, 8] forced; returns the emitted frames [B, 17].

        The user's codes are forced at the end of the call, not before it as ``lm_call``
        forces: nothing the call reads is written by them.  User stream k's code of this frame
        goes to position offset + delay_k; the call reads the model input at offset - 1 (a
        different ring entry while delay_k <= RING - 2: the checkpoint's delays are 0 and 1),
        the targets at offset of the text and agent streams only (the depformer's steps up to
        ``audio_codebooks``), and emits positions offset - max_delay + delay_k < offset +
        delay_k.  So the codes need to exist only by the end of the call, and their encoding
        (``encoded_on``: the stream it runs on) overlaps the model's work.  A depformer that
        runs the user side's steps too (``depformer_steps=16``, the conformance setting) reads
        the user streams' targets as teacher forcing: there the codes are forced first."""
        cfg = self.cfg
        half = cfg.audio_codebooks

        def force_user_codes() -> None:
            if encoded_on is not None:
                torch.cuda.current_stream(self.device).wait_stream(encoded_on)
            forced = torch.zeros(slots.shape[0], cfg.num_streams, dtype=torch.long, device=self.device)
            mask = torch.zeros_like(forced, dtype=torch.bool)
            forced[:, 1 + half :] = user_codes
            mask[:, 1 + half :] = True
            self.tokens.force(slots, forced, mask)

        if self.lm.depformer_steps > half:
            force_user_codes()
            return self._model_call(slots, live=True)
        return self._model_call(slots, live=True, before_end=force_user_codes)

    def lm_call(
        self,
        slots: torch.Tensor,
        forced: torch.Tensor,
        mask: torch.Tensor,
        embeddings: torch.Tensor | None = None,
        capture: list[torch.Tensor] | None = None,
        live: bool = False,
    ) -> torch.Tensor | None:
        """One call of the PersonaPlex loop (model.md 3.2) for slots in the same phase.

        ``forced``/``mask`` [B, 17] teacher-force this call's frame; ``embeddings`` [B, D]
        replaces the token embedding of the input position (voice replay); the input
        embedding of a model call is appended to ``capture`` when given (voice building).
        ``live`` slots are past their system prompt: no phase checks, no host synchronisation.
        """
        self.tokens.force(slots, forced, mask)
        if not live:
            offsets = self.tokens.offset[slots]
            if bool((offsets == 0).all()):
                self.tokens.skip_call(slots)
                return None
            if bool((offsets == 0).any()):
                raise RuntimeError("slots in different start-up phases cannot share a call")
        return self._model_call(slots, embeddings, capture, live)

    def _model_call(self, slots: torch.Tensor, embeddings: torch.Tensor | None = None,
                    capture: list[torch.Tensor] | None = None, live: bool = False,
                    before_end: Callable[[], None] | None = None) -> torch.Tensor | None:
        """``lm_call`` once its frame is forced: the model's input and targets, the temporal
        transformer, the text and audio samples, the end of the call.  ``before_end`` runs
        just before the call's end (``step_tokens``' late forcing)."""
        model_input, target, target_forced = self.tokens.begin_call(slots)
        if embeddings is None:
            x = self.lm.embed_tokens(model_input.unsqueeze(1))
        else:
            x = embeddings.unsqueeze(1).to(self.lm.dtype)
        if capture is not None:
            capture.append(x)
        hidden, text_logits = self.temporal_call(slots, x)
        text = self.sample(slots, 0, text_logits, text=True)
        self.clock.mark("temporal")
        text_in = torch.where(target_forced[:, 0], target[:, 0], text)
        steps = self.lm.depformer_steps
        audio = self.depformer_call(slots, hidden, text_in, target[:, 1 : 1 + steps], target_forced[:, 1 : 1 + steps])
        self.sampling.counter[slots] += 1
        if before_end is not None:
            before_end()
        out = self.tokens.end_call(slots, text, audio, live=live)
        self.clock.mark("depformer")
        return out

    # Slots ------------------------------------------------------------------------------------------
    def _install(self, slot: int, prefill: Any) -> None:
        self._reset(slot)
        self.install_context(slot, prefill)
        self.tokens.restore(slot, prefill.token_cache, prefill.token_provided, prefill.offset)

    def _reset(self, slot: int) -> None:
        self._reset_many([slot])

    def _reset_many(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, device=self.device)
        self.release_contexts(slots, idx)
        self.tokens.reset(idx)
        self.mimi.reset(idx)
        self.sampling.counter[idx] = 0
