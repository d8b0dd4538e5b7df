"""The PyTorch engine: a fixed pool of session slots advanced in batched lockstep.

A tick for slots [B] is: Mimi-encode each slot's 80 ms of user audio -> teacher-force the
user codes into each slot's token ring -> one temporal transformer step for all B -> text
sample -> depformer (8 agent codebooks by default) -> Mimi-decode the de-delayed agent
frame.  Every piece of per-session state (KV ring, token ring, Mimi state, RNG counter,
sampling settings) is a tensor indexed by slot, so any subset of slots can advance together
and resetting one slot touches no other.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from . import progress
from .checkpoint import CheckpointFiles, SafetensorsReader, is_fp8_copy, iter_fp8_copy_tensors, iter_lm_tensors
from .compiled import compile_dynamic
from .config import FRAME_SAMPLES, KV_CACHE_MODES, WEIGHT_MODES
from .interface import EngineInfo, FrameOutput, NoFreeSlot, Pieces, SessionSpec, to_completion
from .lm import MoshiLM
from .mimi import MimiCodec
from .modules.fp8_weights import fp8_state_entries, quantize_lm_tensors
from .modules.kv_ring import SlotKVRing, WindowMode
from .modules.layers import fp8_matmul_for
from .prefill import (PREFILL_CHUNK, Prefill, PrefillCache, plan_prompt, prefill_pieces, prompt_frames, prompt_pass,
                      voice_replay_frame)
from .profiling import StageClock
from .sampling import STATIC_TOP_K, SamplingBatch, exponential_noise, sample_tokens, stream_salt
from .token_state import TokenState
from .tokenizer import TextTokenizer
from .voices import VoiceStore

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    window: str = WindowMode.REFERENCE
    # 8 runs only the agent codebooks (the user-side steps are dead compute, model.md 3.4);
    # 16 reproduces the reference's full depformer for conformance checks.
    depformer_steps: int = 8
    prefill_cache_entries: int = 16
    # ... and at most this many bytes of them (they live on the engine's device, in the
    # headroom the server's admission leaves beside the sessions' windows).
    prefill_cache_bytes: int = 2 << 30
    # On CUDA, live ticks replay CUDA graphs captured per batch bucket (padded with the
    # scratch slot); buckets above the slot count are dropped.
    cuda_graphs: bool = True
    # LM weight/activation dtype: None = float32 on CPU (the exact path), bfloat16 elsewhere.
    lm_dtype: str | None = None
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160)
    # Prompt positions per piece of a cold prefill: the scheduler runs live ticks between
    # pieces, so this bounds how long a joining session can hold them up.
    prefill_chunk: int = PREFILL_CHUNK
    # Temporal KV cache storage: "auto" = the LM dtype; "fp8" = float8 e4m3 with per-
    # (position, head) scales (engines.modules.kv_ring): half the bytes per decode step.
    kv_cache: str = "auto"
    # LM weights: "auto" = the LM dtype; "fp8" = the projections and FFNs in float8 e4m3
    # with per-output-channel scales, quantized at load (half their bytes, read every tick).
    weights: str = "auto"
    # How fp8 weights multiply (engines.modules.layers.linear): "auto" = fp8 tensor cores
    # ("scaled_mm") where the GPU has them, else "w8a16" (dequantize, then the usual GEMM).
    fp8_matmul: str = "auto"
    # torch.compile the layer blocks, embeddings, sampling and fp8 writes (CUDA fast path:
    # far fewer kernels per tick; first use of each shape compiles, tens of seconds).
    compile: bool = False

    def __post_init__(self) -> None:
        if self.window not in WindowMode.ALL:
            raise ValueError(f"window must be one of {WindowMode.ALL}, got {self.window!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {self.kv_cache!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")


def _sample_static(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor,
                   noise: torch.Tensor) -> torch.Tensor:
    """Sampling with the static top-k width of graph-captured ticks (tensors only, so it
    can be compiled)."""
    return sample_tokens(logits, SamplingBatch(temperature, top_k, greedy), noise, k_max=STATIC_TOP_K)


class _SlotSettings:
    """Per-slot sampling settings and RNG state as tensors (gathered per tick)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        f32 = dict(device=device, dtype=torch.float32)
        i64 = dict(device=device, dtype=torch.long)
        self.temp_text = torch.zeros(num_slots, **f32)
        self.temp_audio = torch.zeros(num_slots, **f32)
        self.topk_text = torch.ones(num_slots, **i64)
        self.topk_audio = torch.ones(num_slots, **i64)
        self.greedy = torch.ones(num_slots, device=device, dtype=torch.bool)
        self.seed = torch.zeros(num_slots, **i64)
        self.counter = torch.zeros(num_slots, **i64)

    def set(self, slot: int, spec: SessionSpec) -> None:
        s = spec.sampling
        self.temp_text[slot] = s.temp_text
        self.temp_audio[slot] = s.temp_audio
        # Wider top-k than the graphs' static width samples from that width (see sampling).
        self.topk_text[slot] = min(s.topk_text, STATIC_TOP_K)
        self.topk_audio[slot] = min(s.topk_audio, STATIC_TOP_K)
        self.greedy[slot] = s.greedy
        seed = spec.seed if spec.seed is not None else secrets.randbits(62)
        self.seed[slot] = int(seed) & ((1 << 63) - 1)
        self.counter[slot] = 0

    def batch(self, slots: torch.Tensor, text: bool) -> SamplingBatch:
        """The settings of ``slots`` for a text (``text``) or audio stream."""
        return SamplingBatch(
            temperature=(self.temp_text if text else self.temp_audio)[slots],
            top_k=(self.topk_text if text else self.topk_audio)[slots],
            greedy=self.greedy[slots],
        )

    def sample(self, slots: torch.Tensor, stream: int, logits: torch.Tensor, text: bool) -> torch.Tensor:
        """Draw ``stream``'s tokens for ``slots`` with data-dependent shapes (no graph capture):
        the noise is only drawn when some slot samples."""
        batch = self.batch(slots, text)
        noise = None
        if not bool(batch.greedy.all()):
            noise = exponential_noise(self.seed[slots], self.counter[slots], stream, logits.shape[-1])
        return sample_tokens(logits, batch, noise)


class PersonaPlexEngine:
    def __init__(
        self,
        lm: MoshiLM,
        mimi: MimiCodec,
        tokenizer: TextTokenizer,
        voices: VoiceStore,
        num_slots: int,
        options: EngineOptions = EngineOptions(),
        model_name: str = "personaplex",
        is_demo: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        cfg = lm.cfg
        self.cfg = cfg
        self.lm = lm
        self.mimi = mimi
        self.tokenizer = tokenizer
        self.voice_store = voices
        self.options = options
        self.device = lm.device
        self.num_slots = num_slots
        # One extra slot (the last) is scratch space: tick graphs pad with it, voices are built in it.
        self.scratch = num_slots
        self.kv = SlotKVRing(cfg.num_layers, num_slots + 1, cfg.num_heads, cfg.context, cfg.head_dim,
                             device=self.device, dtype=lm.dtype, fp8=options.kv_cache == "fp8")
        self.tokens = TokenState(cfg, num_slots + 1, device=self.device)
        self.settings = _SlotSettings(num_slots + 1, self.device)
        self.prefills = PrefillCache(options.prefill_cache_entries, options.prefill_cache_bytes)
        self._specs: dict[int, SessionSpec] = {}
        self._free = list(range(num_slots))
        self.clock = StageClock()  # per-stage timing for benchmarks (GPU only)
        # Accelerators sample with static shapes and no host sync (graph capture); the CPU
        # path keeps the cheaper data-dependent sampling.
        self._static_sampling = self.device.type == "cuda"
        self._noise = exponential_noise
        self._sample_static = _sample_static
        # Per-stream hash salts as device scalars: a graph-safe, compile-friendly argument.
        self._salts = torch.tensor([stream_salt(k) for k in range(cfg.num_streams)], device=self.device)
        if options.compile:
            lm.compile_blocks()
            mimi.compile_steps()
            self.kv.compile_quantizer()
            self._noise = compile_dynamic(exponential_noise)
            self._sample_static = compile_dynamic(_sample_static, fullgraph=False)
        self.graphs = None
        self.prefill_graphs = None
        if self.device.type == "cuda" and options.cuda_graphs:
            from .gpu.graphs import TickGraphs
            from .gpu.prefill_graphs import PrefillGraphs

            self.graphs = TickGraphs(self, options.graph_buckets)
            self.prefill_graphs = PrefillGraphs(lm, options.window, cfg.context, options.prefill_chunk)
        self.info = EngineInfo(
            model=model_name,
            backend="torch",
            device=str(self.device),
            max_slots=num_slots,
            is_demo=is_demo,
        )

    # Construction -------------------------------------------------------------------------
    @classmethod
    def from_files(
        cls,
        files: CheckpointFiles,
        num_slots: int,
        options: EngineOptions = EngineOptions(),
        is_demo: bool = False,
    ) -> "PersonaPlexEngine":
        device = torch.device(options.device)
        if options.lm_dtype is not None:
            lm_dtype = getattr(torch, options.lm_dtype)
        else:
            lm_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        cfg = files.lm_config
        reader = SafetensorsReader(files.lm_weights)
        stored_fp8 = is_fp8_copy(reader)  # convert_checkpoint.py --target torch-fp8 wrote it
        fp8 = options.weights == "fp8" or stored_fp8
        fp8_matmul = fp8_matmul_for(device, options.fp8_matmul) if fp8 else None
        lm = MoshiLM(cfg, options.depformer_steps, fp8_matmul)
        how = "" if not fp8 else f" ({'stored' if stored_fp8 else 'quantized at load'} in fp8, {fp8_matmul} products)"
        log.info("loading LM weights from %s%s", files.lm_weights, how)
        progress.report(progress.WEIGHTS, files.lm_weights.name)

        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=lm_dtype)

        if stored_fp8:
            with torch.device("meta"):
                expected = MoshiLM(cfg, options.depformer_steps, fp8_matmul).state_dict()
            tensors = iter_fp8_copy_tensors(reader, expected, convert, place=lambda t: t.to(device))
        else:
            tensors = iter_lm_tensors(reader, cfg, options.depformer_steps, convert)
            if fp8:  # on the device, a layer at a time: its bf16 copy never all exists at once
                tensors = fp8_state_entries(quantize_lm_tensors(tensors))
        lm.load_state_dict(dict(tensors), strict=True, assign=True)
        lm.eval()
        log.info("loading Mimi weights from %s", files.mimi_weights)
        progress.report(progress.WEIGHTS, files.mimi_weights.name)
        mimi_state = SafetensorsReader(files.mimi_weights).state_dict()
        mimi = MimiCodec.from_state_dict(files.mimi_config, mimi_state, num_slots + 1,
                                         window=options.window, device=device)
        tokenizer = TextTokenizer(files.tokenizer)
        voices = VoiceStore(files.voices_dir, files.root, files.voices_archive, cfg.dim, cfg.num_streams)
        return cls(lm, mimi, tokenizer, voices, num_slots, options, model_name=files.name, is_demo=is_demo)

    # Engine interface ---------------------------------------------------------------------
    def voices(self) -> list[str]:
        return self.voice_store.names()

    def validate(self, spec: SessionSpec) -> None:
        self.voice_store.check(spec.voice)

    def prepare(self, spec: SessionSpec) -> Prefill:
        return to_completion(self.prepare_in_pieces(spec))

    def prepare_in_pieces(self, spec: SessionSpec) -> Pieces[Prefill]:
        """The prefill of ``spec`` from the cache, or computed ``options.prefill_chunk``
        prompt positions per piece (the first piece also validates, tokenizes and plans; for a
        persona longer than a chunk those are pieces of their own, ~30 and ~130 ms for
        200,000 characters on the dev VM)."""
        self.validate(spec)
        persona = tuple(self.tokenizer.persona_tokens(spec.effective_persona))
        key = (spec.voice, persona)
        prefill = self.prefills.get(key)
        if prefill is None:
            voice = self.voice_store.load(spec.voice)
            long_persona = len(persona) > self.options.prefill_chunk
            if long_persona:
                yield  # tokenizing a long persona is a piece of its own; planning it, another
            plan = plan_prompt(self.cfg, voice, persona)
            if long_persona:
                yield
            prefill = yield from prefill_pieces(self.lm, voice, plan, self.options.window, self.kv.capacity,
                                                self.options.prefill_chunk, self.prefill_graphs)
            self.prefills.put(key, prefill)
            log.info("prefill for voice %s and a %d-token persona: %d positions",
                     spec.voice, len(persona), prefill.positions)
        return prefill

    def open_slot(self, spec: SessionSpec, prefill: Prefill | None = None) -> int:
        """``prefill``: ``prepare``'s result (benchmarks also fill windows this way)."""
        if prefill is None:
            prefill = self.prepare(spec)
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} session slots are in use")
        slot = self._free.pop(0)
        try:
            self._specs[slot] = spec
            self.settings.set(slot, spec)
            self._install(slot, prefill)
        except BaseException:
            self._give_back(slot)  # whatever failed, the slot is not lost
            raise
        return slot

    def restart_slot(self, slot: int, prefill: Prefill | None = None) -> None:
        spec = self._spec(slot)
        self._install(slot, prefill if prefill is not None else self.prepare(spec))

    def close_slot(self, slot: int) -> None:
        self._spec(slot)
        self._give_back(slot)

    def _give_back(self, slot: int) -> None:
        """Return ``slot`` to the free list, wiped now rather than on the next open: nothing of
        its session stays reachable.  The slot is free even if the wipe raises."""
        self._specs.pop(slot, None)
        try:
            self._reset(slot)
        finally:
            self._free.append(slot)
            self._free.sort()

    def capture_graphs(self) -> None:
        """Capture the tick graph of every batch bucket and the prefill graph of every prompt
        bucket, and warm the split prefill's pieces, now (start-up), not on first use."""
        if self.graphs is not None:
            self.graphs.capture_all()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all()
        if self.device.type == "cuda":
            # A split prefill runs eagerly when another one holds the piece graph: its first
            # pieces would compile the layer halves for their shape and plan their kernels
            # (6.8 s on the H200 with live sessions waiting).  Run one long enough to wrap
            # its cache now.
            chunk = self.options.prefill_chunk
            length = self.kv.capacity + 2 * chunk
            tokens = torch.zeros(1, chunk, self.cfg.num_streams, device=self.device, dtype=torch.long)

            def embed(start: int, end: int) -> torch.Tensor:  # a piece's embedding, in case its length compiles
                return self.lm.embed_tokens(tokens[:, : end - start])[0]
            to_completion(prompt_pass(self.lm, embed, length, self.options.window, self.kv.capacity, chunk))

    def free_slots(self) -> int:
        return len(self._free)

    def step(self, slots: Sequence[int], pcm: np.ndarray) -> list[FrameOutput]:
        if len(slots) == 0:
            return []
        self.clock.host_start()
        pcm = np.asarray(pcm, dtype=np.float32)
        if pcm.shape != (len(slots), FRAME_SAMPLES):
            raise ValueError(f"pcm must have shape ({len(slots)}, {FRAME_SAMPLES}), got {pcm.shape}")
        for s in slots:
            self._spec(s)
        if len(set(slots)) != len(slots):
            raise ValueError("a slot may appear only once per step")
        if self.graphs is not None:
            audio, text_ids = self.graphs.run(list(slots), pcm)
        else:
            idx = torch.tensor(list(slots), device=self.device, dtype=torch.long)
            with torch.inference_mode():
                self.clock.start()
                agent_pcm, text = self.live_tick(idx, torch.from_numpy(pcm).to(self.device))
            text_ids = text.tolist()  # the tick's one host synchronisation
            audio = agent_pcm.float().cpu().numpy()
        outputs = [FrameOutput(audio[i], t, self.tokenizer.transcript_piece(t)) for i, t in enumerate(text_ids)]
        self.clock.host_mark("outputs")
        return outputs

    def live_tick(self, slots: torch.Tensor, pcm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode -> LM -> depformer -> decode for live ``slots`` [B] with ``pcm`` [B, 1920].

        Device tensors in and out (agent pcm [B, 1920], text ids [B]); no validation and no
        host synchronisation, so it can be captured in a CUDA graph.
        """
        user_codes = self.mimi.encode_step_unchecked(slots, pcm)
        self.clock.mark("mimi_encode")
        out = self.step_tokens(slots, user_codes)
        # Rows of the scratch slot (graph padding) may hold placeholder ids: clamp for Mimi.
        agent = out[:, 1 : 1 + self.cfg.audio_codebooks].clamp(0, self.cfg.card - 1)
        agent_pcm = self.mimi.decode_step_unchecked(slots, agent)
        self.clock.mark("mimi_decode")
        return agent_pcm, out[:, 0]

    # Lower-level operations (also used by the offline CLI, voice builder and tests) ------------
    def step_tokens(self, slots: torch.Tensor, user_codes: torch.Tensor) -> torch.Tensor:
        """One live LM call: force ``user_codes`` [B, 8], return the emitted frames [B, 17]."""
        cfg = self.cfg
        B = slots.shape[0]
        forced = torch.zeros(B, cfg.num_streams, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(forced, dtype=torch.bool)
        half = cfg.audio_codebooks
        forced[:, 1 + half :] = user_codes
        mask[:, 1 + half :] = True
        return self.lm_call(slots, forced, mask, live=True)

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
        model_input, target, target_forced = self.tokens.begin_call(slots)
        if embeddings is None:
            x = self.lm.embed_tokens(model_input.unsqueeze(1))
        else:
            x = embeddings.unsqueeze(1).to(self.lm.dtype)
        if capture is not None:
            capture.append(x)
        hidden = self.lm.temporal(slots, x, self.kv, self.options.window)[:, 0]
        text = self._sample(slots, 0, self.lm.text_logits(hidden), text=True)
        self.clock.mark("temporal")
        text_in = torch.where(target_forced[:, 0], target[:, 0], text)
        steps = self.lm.depformer_steps
        audio = self.lm.depformer(
            hidden, text_in, target[:, 1 : 1 + steps], target_forced[:, 1 : 1 + steps],
            lambda k, logits: self._sample(slots, 1 + k, logits, text=False),
            self.options.window,
        )
        self.settings.counter[slots] += 1
        out = self.tokens.end_call(slots, text, audio, live=live)
        self.clock.mark("depformer")
        return out

    def _sample(self, slots: torch.Tensor, stream: int, logits: torch.Tensor, text: bool) -> torch.Tensor:
        st = self.settings
        if not self._static_sampling:
            return st.sample(slots, stream, logits, text)
        batch = st.batch(slots, text)
        noise = self._noise(st.seed[slots], st.counter[slots], self._salts[stream], logits.shape[-1])
        return self._sample_static(logits, batch.temperature, batch.top_k, batch.greedy, noise)

    def _install(self, slot: int, prefill: Prefill) -> None:
        self._reset(slot)
        self.kv.install(slot, prefill.start, prefill.keys, prefill.values)
        self.tokens.restore(slot, prefill.token_cache, prefill.token_provided, prefill.offset)

    def _reset(self, slot: int) -> None:
        idx = torch.tensor([slot], device=self.device)
        self.kv.reset(idx)
        self.tokens.reset(idx)
        self.mimi.reset(idx)
        self.settings.counter[slot] = 0

    def _spec(self, slot: int) -> SessionSpec:
        spec = self._specs.get(slot)
        if spec is None:
            raise ValueError(f"slot {slot} is not open")
        return spec

    def prefill_stepwise(self, slot: int, spec: SessionSpec) -> None:
        """Run ``spec``'s system prompt frame by frame, as the reference does.

        Slow; exists to check the parallel prefill against the reference loop.
        """
        self._spec(slot)
        self._reset(slot)
        voice = self.voice_store.load(spec.voice)
        persona = self.tokenizer.persona_tokens(spec.effective_persona)
        idx = torch.tensor([slot], device=self.device)
        all_forced = torch.ones(1, self.cfg.num_streams, dtype=torch.bool, device=self.device)
        with torch.inference_mode():
            dummy = torch.tensor([voice_replay_frame(self.cfg).streams()], device=self.device)
            self.lm_call(idx, dummy, all_forced)  # offset 0: no model call
            for row in voice.embeddings:
                self.lm_call(idx, dummy, all_forced, embeddings=row.view(1, -1).to(self.device))
            self.tokens.cache[slot] = voice.cache.to(self.device)
            for frame in prompt_frames(persona):
                self.lm_call(idx, torch.tensor([frame.streams()], device=self.device), all_forced)
        self.settings.counter[slot] = 0
