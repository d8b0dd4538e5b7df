"""The PyTorch engine: a fixed pool of session slots advanced in batched lockstep.

The tick is the shared runtime's (``engines.runtime.engine_runtime``); this backend runs the temporal
transformer itself, over a ``SlotKVRing``, prepares system prompts with the split prefill,
and on CUDA replays whole ticks from CUDA graphs.  Every piece of per-session state (KV
ring, token ring, Mimi state, RNG counter, sampling settings) is a tensor indexed by slot,
so any subset of slots can advance together and resetting one slot touches no other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from engines import progress
from engines.checkpoints.loader import (
    CheckpointFiles,
    SafetensorsReader,
    is_fp8_copy,
    iter_fp8_copy_tensors,
    iter_lm_tensors,
)
from engines.fastpath import gpu_arch
from engines.fastpath.compiled import compile_dynamic
from engines.config import SINE_TOKENS, TEXT_PAD_ID
from engines.interface import WAITING, EngineInfo, Pieces, SessionSpec, to_completion
from engines.model.lm import MoshiLM
from engines.model.mimi import MimiCodec
from engines.model.fp8_weights import fp8_state_entries, quantize_lm_tensors
from engines.state.kv_ring import SlotKVRing, WindowMode
from engines.model.layers import fp8_matmul_for
from engines.model.prefill import (
    PREFILL_CHUNK,
    Prefill,
    PrefillCache,
    plan_prompt,
    prefill_pieces,
    prompt_frames,
    voice_replay_frame,
)
from engines.runtime.engine_runtime import EngineRuntime
from engines.runtime import memory_probe
from engines.errors import MemoryPlanError
from engines.runtime.memory_plan import MemoryPlan, PlanItem, choose_kv_cache, choose_sessions
from engines.spec import EngineSpec, MemorySettings, check_engine_options
from engines.state.prompt_kv import PromptKV
from engines.model.sampling import (
    STATIC_TOP_K,
    SamplingBatch,
    exponential_noise,
    sample_tokens,
    stream_salt,
)
from engines.checkpoints.tokenizer import TextTokenizer
from engines.checkpoints.voices import VoiceStore

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    window: str = WindowMode.REFERENCE
    # 8 runs only the agent codebooks (the user-side steps are dead compute, model.md 3.4);
    # 16 reproduces the reference's full depformer for conformance checks.
    depformer_steps: int = 8
    prefill_cache_entries: int = 16
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
    # (position, head) scales (engines.state.kv_ring): half the bytes per decode step;
    # "int8" = the same bytes as int8, for GPUs without e4m3 (A100).
    kv_cache: str = "auto"
    # LM weights: "auto" = the LM dtype; "fp8" = the projections and FFNs in float8 e4m3
    # with per-output-channel scales, quantized at load (half their bytes, read every tick).
    weights: str = "auto"
    # How fp8 weights multiply (engines.model.layers.linear): "auto" = fp8 tensor cores
    # ("scaled_mm") where the GPU has them, else "w8a16" (dequantize, then the usual GEMM).
    fp8_matmul: str = "auto"
    # The GPU's compute capability as the engine takes it (engines.fastpath.gpu_arch): "auto",
    # or a lower profile ("sm80": what an A100 would take, on the GPU at hand).
    gpu_arch: str = "auto"
    # torch.compile the layer blocks, embeddings, sampling and fp8 writes (CUDA fast path:
    # far fewer kernels per tick; first use of each shape compiles, tens of seconds).
    compile: bool = False
    # On CUDA, Mimi encodes the user's audio on a stream of its own beside the LM call
    # (EngineRuntime.step_tokens: the call does not read those codes until its end).
    overlap_encode: bool = True
    # A tick whose sessions are all greedy takes the argmaxes only, skipping the sampler's
    # noise, softmax and static top-k (a sort of 2048 per stream); with CUDA graphs each batch
    # bucket gets a second graph for it, chosen from host state per tick.
    greedy_ticks: bool = True
    # The device-memory plan's settings (engines.runtime.memory_plan), the prefill cache's
    # byte bound among them (the cache lives on the engine's device beside the sessions).
    memory: MemorySettings = MemorySettings()

    def __post_init__(self) -> None:
        check_engine_options({"window": self.window, "kv_cache": self.kv_cache, "weights": self.weights,
                              "gpu_arch": self.gpu_arch})
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @classmethod
    def from_spec(cls, spec: EngineSpec, **backend_only) -> "EngineOptions":
        """The options ``spec`` gives the PyTorch backend (``backend_only``: the backend's own,
        such as ``depformer_steps``)."""
        return cls(device=spec.device, window=spec.window, kv_cache=spec.kv_cache, weights=spec.weights,
                   compile=spec.compiled, gpu_arch=spec.gpu_arch, memory=spec.memory, **backend_only)


def check_gpu(options: EngineOptions) -> None:
    """At start, before any weight is loaded: the GPU's capability as the engine takes it (its
    profile set, logged once), and what that GPU cannot run refused in one line
    (``GpuArchError``).  An fp8 KV cache below 8.9 is refused rather than read by the gather
    path: both of its kernels (the decode attention's e4m3 variant, the fused write) are
    refused by Triton for sm_80 (``python -m engines.tools.check_targets --arch 80``), and
    the gather path (which copies each window out of the ring every tick, and whose compiled
    fp8 write Inductor would emit in e4m3) is not a GPU serving path."""
    device = torch.device(options.device)
    gpu_arch.configure(options.gpu_arch)
    if device.type != "cuda":
        if options.gpu_arch != "auto":
            log.warning("%s=%s has no effect on %s", gpu_arch.SETTING, options.gpu_arch, device)
        return
    gpu_arch.capability(device)
    if options.kv_cache == "fp8":
        gpu_arch.require_e4m3(device, "PERSONAPLEX_KV_CACHE=fp8",
                              "set PERSONAPLEX_KV_CACHE=int8 (the same memory, no e4m3) or auto")


def plan_slots(lm: MoshiLM, mimi_cfg, num_slots: int | None, options: EngineOptions,
               held_before: tuple[int, int] | None) -> tuple[int, MemoryPlan | None, EngineOptions]:
    """The slots to allocate, the memory plan behind them (None where none is made: planning
    off, or on CPU without a memory limit) and ``options`` with the KV cache's storage decided
    (``kv_cache`` "auto": ``memory_plan.choose_kv_cache``), once ``lm`` is loaded and before the
    slots are allocated; ``num_slots`` None: the most that fit.  ``held_before``: the device's
    (free, total) before the engine loaded anything (``memory_probe.held_before``).  Logs the
    plan; ``MemoryPlanError`` if ``num_slots`` does not fit."""
    memory = options.memory
    if not memory.enabled or (lm.device.type != "cuda" and memory.limit_bytes is None):
        if num_slots is None:
            raise ValueError("num_slots=None (as many as fit) needs a GPU or a memory limit to plan with")
        return num_slots, None, options  # no plan to choose by: "auto" stays the exact cache
    plan = _initial_plan(lm, mimi_cfg, options, held_before)
    if options.kv_cache == "auto":
        compact = "fp8" if gpu_arch.e4m3_kernels(lm.device) else "int8"
        plan = choose_kv_cache(num_slots, plan, _initial_plan(lm, mimi_cfg, replace(options, kv_cache=compact),
                                                              held_before), memory.sessions_setting)
        log.info("PERSONAPLEX_KV_CACHE=auto: the KV cache is %s", plan.kv_choice)
        options = replace(options, kv_cache=plan.kv_cache)
    plan = choose_sessions(plan, num_slots, memory.sessions_setting)
    for line in plan.lines():
        log.info("%s", line)
    return plan.sessions, plan, options


def _initial_plan(lm: MoshiLM, mimi_cfg, options: EngineOptions, held_before: tuple[int, int] | None) -> MemoryPlan:
    """The plan before the slots are allocated: the weights as loaded, one slot's state as
    computed, the graphs and a join as estimated."""
    cfg = lm.cfg
    memory = options.memory
    limit = memory.limit_bytes
    if held_before is not None:
        free, total = held_before
        device_bytes = limit or total
        not_ours = PlanItem("not_ours", 0, "setting") if limit else PlanItem("not_ours", total - free, "measured")
    else:
        device_bytes = limit or 0
        not_ours = PlanItem("not_ours", 0, "setting")
    graphs_on = lm.device.type == "cuda" and options.cuda_graphs
    # A prefill without the piece graph keeps a cache of its own while it runs.
    scratch = 0 if graphs_on else PromptKV.size_for(cfg.context, cfg.context, options.prefill_chunk)
    joins = memory.concurrent_joins
    per_join = memory_probe.join_estimate(cfg, lm.dtype, scratch)
    weights = memory_probe.module_bytes(lm) + memory_probe.mimi_weight_bytes(mimi_cfg, options.window)
    items = (
        not_ours,
        PlanItem("weights", weights, "computed"),
        PlanItem("graphs", memory_probe.GRAPHS_ESTIMATE if graphs_on else 0, "estimated"),
        PlanItem("joins", joins * per_join, "estimated", f"{joins} x the longest prompt"),
        PlanItem("prefill_cache", memory.prefill_cache_bytes, "setting"),
        PlanItem("margin", memory.margin_bytes, "setting"),
    )
    per_session = memory_probe.per_slot_bytes(cfg, mimi_cfg, options.window, lm.dtype, options.kv_cache)
    return MemoryPlan(str(lm.device), device_bytes, 0, per_session, items, kv_cache=options.kv_cache)


def _sample_static(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor,
                   noise: torch.Tensor) -> torch.Tensor:
    """Sampling with the static top-k width of graph-captured ticks (tensors only, so it
    can be compiled)."""
    return sample_tokens(logits, SamplingBatch(temperature, top_k, greedy), noise, k_max=STATIC_TOP_K)


class PersonaPlexEngine(EngineRuntime):
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
        memory_plan: MemoryPlan | None = None,
    ) -> None:
        cfg = lm.cfg
        # What the engine planned its device memory for (from_files); measured once its
        # graphs are captured (settle_memory_plan).
        self.memory_plan = memory_plan
        # The scratch slot (the last): tick graphs pad with it, voices are built in it.
        super().__init__(cfg, lm, mimi, tokenizer, voices, num_slots, lm.device, options.window, scratch=True)
        self.options = options
        log.info("LM weights on %s: %s", self.device, lm.describe_weights())
        self.kv = SlotKVRing(cfg.num_layers, num_slots + 1, cfg.num_heads, cfg.context, cfg.head_dim,
                             device=self.device, dtype=lm.dtype, kv_cache=options.kv_cache)
        self.prefills = PrefillCache(options.prefill_cache_entries, options.memory.prefill_cache_bytes)
        # Accelerators sample with static shapes and no host sync (graph capture); the CPU
        # path keeps the cheaper data-dependent sampling.
        self._static_sampling = self.device.type == "cuda"
        self._noise = exponential_noise
        self._sample_static = _sample_static
        # Per-stream hash salts as device scalars: a graph-safe, compile-friendly argument.
        self._salts = torch.tensor([stream_salt(k) for k in range(cfg.num_streams)], device=self.device)
        # Set for the length of a tick (or a graph's capture) whose every row is greedy.
        self.greedy_tick = False
        if options.compile:
            lm.compile_blocks(options.window)
            mimi.compile_steps()
            self.kv.compile_quantizer()
            self._noise = compile_dynamic(exponential_noise)
            self._sample_static = compile_dynamic(_sample_static, fullgraph=False)
        if self.device.type == "cuda" and options.overlap_encode:
            self.encode_stream = torch.cuda.Stream(self.device)
        self.graphs = None
        self.prefill_graphs = None
        if self.device.type == "cuda" and options.cuda_graphs:
            from engines.fastpath.graphs import TickGraphs
            from engines.fastpath.prefill_graphs import PrefillGraphs

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
        num_slots: int | None,
        options: EngineOptions = EngineOptions(),
        is_demo: bool = False,
    ) -> "PersonaPlexEngine":
        """``num_slots`` None: as many as the memory plan fits (``plan_slots``)."""
        device = torch.device(options.device)
        check_gpu(options)
        # Before anything of ours is on the device: what others (and our CUDA context) hold.
        held_before = memory_probe.held_before(device)
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
        num_slots, plan, options = plan_slots(lm, files.mimi_config, num_slots, options, held_before)
        mimi = MimiCodec.from_state_dict(files.mimi_config, mimi_state, num_slots + 1,
                                         window=options.window, device=device)
        tokenizer = TextTokenizer(files.tokenizer)
        voices = VoiceStore(files.voices_dir, files.root, files.voices_archive, cfg.dim, cfg.num_streams)
        return cls(lm, mimi, tokenizer, voices, num_slots, options, model_name=files.name, is_demo=is_demo,
                   memory_plan=plan)

    # The backend ------------------------------------------------------------------------------
    def prepare(self, spec: SessionSpec) -> Prefill:
        return to_completion(self._prefill(spec, wait=False))

    def prepare_in_pieces(self, spec: SessionSpec) -> Pieces[Prefill]:
        """The prefill of ``spec`` from the cache, or computed ``options.prefill_chunk``
        prompt positions per piece (the first piece also validates, tokenizes and plans; for a
        persona longer than a chunk those are pieces of their own: both grow with its length).
        On CUDA a long prompt waits (``WAITING``) while another one holds the piece graph,
        rather than taking a cache of its own; if that one was the same prompt, its cached
        result is taken instead of computing it again."""
        return self._prefill(spec, wait=True)

    def _prefill(self, spec: SessionSpec, wait: bool) -> Pieces[Prefill]:
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
            pieces = prefill_pieces(self.lm, voice, plan, self.options.window, self.kv.capacity,
                                    self.options.prefill_chunk, self.prefill_graphs, wait)
            while True:
                try:
                    signal = next(pieces)
                except StopIteration as done:
                    prefill = done.value
                    break
                yield signal
                if signal is WAITING:  # the holder may have been this very prompt (a burst of joins alike)
                    cached = self.prefills.get(key)
                    if cached is not None:
                        pieces.close()
                        return cached
            self.prefills.put(key, prefill)
            log.info("prefill for voice %s and a %d-token persona: %d positions",
                     spec.voice, len(persona), prefill.positions)
        return prefill

    def encode_voice(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """A voice prompt from 80 ms frames [N, 1920] of a speaker (``voices.build_voice_prompt``
        prepares them): each frame Mimi-encoded and forced as the agent's audio, with PAD text
        and the sine on the user's side, through the scratch slot.  Returns NVIDIA's ``.pt``
        contents: the model's input embeddings [N-1, 1, 1, D] in bf16 and the token ring
        [1, 17, 4]."""
        cfg = self.cfg
        slot = self.scratch
        idx = torch.tensor([slot], device=self.device)
        forced = torch.zeros(1, cfg.num_streams, dtype=torch.long, device=self.device)
        forced[0, 0] = TEXT_PAD_ID
        forced[0, 1 + cfg.audio_codebooks :] = torch.tensor(SINE_TOKENS)
        mask = torch.ones_like(forced, dtype=torch.bool)
        captured: list[torch.Tensor] = []
        self._reset(slot)
        try:
            with torch.inference_mode():
                for frame in frames:
                    codes = self.mimi.encode_step(idx, torch.from_numpy(frame).to(self.device).view(1, -1))
                    forced[0, 1 : 1 + cfg.audio_codebooks] = codes[0]
                    self.lm_call(idx, forced, mask, capture=captured)
                cache = self.tokens.cache[slot].clone()
        finally:
            self._reset(slot)
        embeddings = torch.stack([c.reshape(1, 1, -1) for c in captured]).to(torch.bfloat16).cpu()
        return {"embeddings": embeddings, "cache": cache.unsqueeze(0).cpu()}

    # torch.compile's portable artifacts of this start (set by ``factory.build_engine`` on a
    # compiled CUDA engine; ``finish_compiling`` writes them).
    compile_artifacts = None

    def finish_compiling(self) -> None:
        """Once the start has compiled everything (graphs captured, the memory plan's dry run
        done): log what torch.compile did and write the portable artifacts for the next start."""
        if not self.options.compile:
            return
        from engines.fastpath import precompiled
        from engines.fastpath.compile_artifacts import compile_report

        log.info("torch.compile this start: %s", compile_report())
        log.info("precompiled variants this start: %s", precompiled.report())
        if self.compile_artifacts is not None:
            self.compile_artifacts.save()

    def capture_graphs(self) -> None:
        """Capture the tick graphs of every batch bucket (sampling, and all greedy), the
        prefill graph of every prompt bucket and the split prefill's piece graph now
        (start-up), not on first use.  (No
        split pass of the server runs eagerly: one that finds the piece graph held waits for
        it, ``prepare_in_pieces``.)"""
        if self.graphs is not None:
            self.graphs.capture_all()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all()

    def settle_memory_plan(self) -> MemoryPlan | None:
        """Measure the plan's items that could only be estimated before allocating (start-up,
        once the graphs are captured): the graph pools, and the peak of a join of the longest
        prompt, by a dry run of that join in the scratch slot.  The allocator keeps the
        blocks the dry run freed, so later joins find them reserved.  Raises
        ``MemoryPlanError`` (one line) when the measured plan does not fit."""
        plan = self.memory_plan
        if plan is None:
            return None
        self.prefills.clear()  # the warm-up's prompt: the cache starts empty, as planned
        memory = self.options.memory
        if self.device.type == "cuda":
            plan = memory_probe.measure(plan, memory_probe.CudaCounters(self.device), self._dry_run_join,
                                        memory.concurrent_joins, memory.sessions_setting)
        else:
            self._dry_run_join()  # the longest join works; its peak stays an estimate here
        plan = replace(plan, stage="measured")
        plan = self._fit_auto(plan)
        self.memory_plan = plan
        for line in plan.lines():
            log.info("%s", line)
        if not plan.fits:
            raise MemoryPlanError(plan.refusal(memory.sessions_setting))
        return plan

    def _fit_auto(self, plan: MemoryPlan) -> MemoryPlan:
        """An auto plan (its sessions chosen by the estimate) that measured a little over: the
        slots are allocated by now, so what is missing comes out of the prefill cache's room,
        as far as that goes (logged); any other plan as it is."""
        cache = plan.item("prefill_cache")
        if plan.fits or not plan.auto or -plan.spare > cache.bytes:
            return plan
        lowered = cache.bytes + plan.spare
        log.warning("memory plan: %d sessions (auto) measured %.2f GiB over the estimate's room: the prefill cache "
                    "keeps %.2f GiB instead of %.2f", plan.sessions, -plan.spare / 2**30, lowered / 2**30,
                    cache.bytes / 2**30)
        self.prefills.max_bytes = lowered
        return plan.with_item(PlanItem("prefill_cache", lowered, "setting", f"lowered from {cache.bytes} bytes"))

    def _dry_run_join(self) -> None:
        """Prepare and install the longest prompt a join may bring (one as long as the window)
        in the scratch slot, as the server's joins run, then wipe the slot."""
        voice = self.voice_store.load(SessionSpec().voice)
        rows = voice.embeddings.shape[0] if voice is not None else 0
        plan = plan_prompt(self.cfg, voice, memory_probe.longest_persona(self.cfg, rows))
        prefill = to_completion(prefill_pieces(self.lm, voice, plan, self.options.window, self.kv.capacity,
                                               self.options.prefill_chunk, self.prefill_graphs, wait=True))
        try:
            self._install(self.scratch, prefill)
        finally:
            self._reset(self.scratch)
        del prefill

    def greedy_tick_for(self, slots: Sequence[int]) -> bool:
        """Whether a tick of ``slots`` takes the argmaxes only (``EngineOptions.greedy_ticks``)."""
        return self.options.greedy_ticks and self.sampling.all_greedy(slots)

    def run_tick(self, slots: Sequence[int], pcm: np.ndarray) -> tuple[np.ndarray, list[int]]:
        greedy = self.greedy_tick_for(slots)
        if self.graphs is not None:
            return self.graphs.run(list(slots), pcm, greedy)
        self.greedy_tick = greedy
        try:
            return super().run_tick(slots, pcm)
        finally:
            self.greedy_tick = False

    def temporal_call(self, slots: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lm.temporal(slots, x, self.kv, self.options.window)[:, 0]
        return hidden, self.lm.text_logits(hidden)

    def install_context(self, slot: int, prefill: Prefill) -> None:
        self.kv.install(slot, prefill.start, prefill.keys, prefill.values)

    def release_context(self, slot: int) -> None:
        self.kv.reset(torch.tensor([slot], device=self.device))

    def release_contexts(self, slots: list[int], idx: torch.Tensor) -> None:
        self.kv.reset(idx)

    def encode_user(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor:
        return self.mimi.encode_step_unchecked(slots, pcm)

    def decode_agent(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.mimi.decode_step_unchecked(slots, codes)

    def sampler(self, slots: torch.Tensor, text: bool) -> Callable[[int, torch.Tensor], torch.Tensor]:
        if self.greedy_tick:  # what sample_tokens gives a greedy row, without the sampler's work
            return lambda stream, logits: torch.argmax(logits, dim=-1)
        st = self.sampling
        if not self._static_sampling:
            return super().sampler(slots, text)
        # Gathered once: the depformer samples 8 streams with the same slots' settings, and
        # each gather is a kernel of its own in the tick.
        batch = st.batch(slots, text)
        seeds, counters = st.seed[slots], st.counter[slots]

        def sample(stream: int, logits: torch.Tensor) -> torch.Tensor:
            noise = self._noise(seeds, counters, self._salts[stream], logits.shape[-1])
            return self._sample_static(logits, batch.temperature, batch.top_k, batch.greedy, noise)
        return sample

    def prefill_stepwise(self, slot: int, spec: SessionSpec) -> None:
        """Run ``spec``'s system prompt frame by frame, as the reference does.

        Slow; exists to check the parallel prefill against the reference loop.
        """
        self.slots.spec(slot)
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
        self.sampling.counter[slot] = 0
