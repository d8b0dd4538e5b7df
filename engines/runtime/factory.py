"""Build the configured engine (the one entry point the orchestrator and CLIs use): from an
``engines.spec.EngineSpec``, whole."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from engines.checkpoints.random_weights import RANDOM_PREFIX, random_model_name
from engines.interface import Engine
from engines.spec import EngineSpec

log = logging.getLogger(__name__)


def create_torch_engine(spec: EngineSpec, depformer_steps: int = 8, **locate_overrides):
    """The PyTorch engine of ``spec`` (its checkpoint ``None``: the embedded tiny demo model).

    The checkpoint is a directory or a Hugging Face repo id (``owner/name[@revision]``,
    downloaded into the standard cache: ``engines/checkpoints/hub.py``).  ``locate_overrides``
    are explicit file paths (``lm_weights``, ``mimi_weights``, ``tokenizer``, ``voices_dir``)
    that take precedence over the directory's files.
    """
    from engines.checkpoints import loader as ckpt
    from engines.checkpoints.hub import resolve_checkpoint
    from engines.checkpoints.tiny import ensure_tiny_checkpoint
    from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine

    checkpoint = spec.checkpoint
    is_demo = checkpoint is None and not locate_overrides.get("lm_weights")
    if is_demo:
        checkpoint = ensure_tiny_checkpoint()
        # The server and the CLIs each say how to point at real weights in their own terms.
        log.info("using the embedded tiny demo checkpoint (untrained) at %s", checkpoint)
    files = ckpt.locate(resolve_checkpoint(checkpoint), **locate_overrides)
    options = EngineOptions.from_spec(spec, depformer_steps=depformer_steps)
    return PersonaPlexEngine.from_files(files, spec.max_slots, options, is_demo=is_demo)


def create_random_engine(name: str, spec: EngineSpec):
    """A ``PersonaPlexEngine`` with random weights at ``name``'s shapes
    (``engines/checkpoints/random_weights.py``), as ``spec`` describes it."""
    from engines import progress
    from engines.checkpoints import loader as ckpt
    from engines.checkpoints.random_model import build_random_engine
    from engines.checkpoints.tiny import TINY_LM, TINY_MIMI, TINY_VOICES, ensure_tiny_checkpoint
    from engines.config import LMConfig, MimiConfig
    from engines.runtime.torch_engine import EngineOptions

    lm_cfg, mimi_cfg = (TINY_LM, TINY_MIMI) if name == "tiny" else (LMConfig(), MimiConfig())
    log.warning("RANDOM WEIGHTS: building %s%s on %s with random weights at %s shapes; its speech is noise "
                "(for capacity and latency measurements only)", RANDOM_PREFIX, name, spec.device, name)
    tokenizer = ensure_tiny_checkpoint() / ckpt.TOKENIZER_FILE
    progress.report(progress.WEIGHTS, f"random weights at {name} shapes")
    return build_random_engine(spec.max_slots, spec.device, tokenizer, lm_cfg=lm_cfg, mimi_cfg=mimi_cfg,
                               kv_cache=spec.kv_cache, compile=spec.compiled, weights=spec.weights,
                               window=spec.window, voice_names=tuple(TINY_VOICES), model_name=f"random-{name}",
                               is_demo=True, options=EngineOptions.from_spec(spec))


def _bind_thread_to(device: str) -> None:
    """Make ``device`` the calling thread's current CUDA device.

    The engine's side streams, CUDA graph captures and Triton kernels use the *current*
    device, which is per thread and defaults to cuda:0: an engine on cuda:1 built or driven
    from a thread left on cuda:0 would launch its work on the wrong GPU.  The caller drives
    the engine from this same thread (the server's scheduler does: one thread per engine).
    """
    if not device.startswith("cuda"):
        return
    import torch

    index = torch.device(device).index
    if index is not None:
        torch.cuda.set_device(index)


def build_engine(spec: EngineSpec) -> Engine:
    """The engine ``spec`` describes (checked when the spec was made).  Its checkpoint: a local
    checkpoint directory or a Hugging Face repo id; ``None``, the embedded default (the
    deterministic tiny demo checkpoint, generated once into a cache directory); ``random:<model>``,
    random weights at that model's shapes (``engines/checkpoints/random_weights.py``); with the
    trtllm backend, a build directory written by convert_checkpoint.py.  ``voice_dir``: more
    voices, served ahead of the checkpoint's (every file checked now).  ``cpu_threads``:
    torch's intra-op threads for an engine on the CPU (the whole process's).

    On CUDA the calling thread's current device becomes the spec's: drive the engine from
    this thread."""
    device = spec.device
    _bind_thread_to(device)
    if device == "cpu" and spec.cpu_threads > 0:
        import torch

        torch.set_num_threads(spec.cpu_threads)
    if device.startswith("cuda"):  # compiled pieces and Triton kernels: keep them for the next start
        from engines.fastpath.compiled import use_persistent_caches

        use_persistent_caches()
    artifacts = None
    if spec.compiled and spec.backend == "torch":  # before the first compilation
        from engines.fastpath.compile_artifacts import CompileArtifacts

        artifacts = CompileArtifacts.for_device(spec.compile_artifacts, device, spec.weights, spec.kv_cache)
        if artifacts is not None:
            artifacts.load()
    random_model = random_model_name(spec.checkpoint)
    # The pieces it compiles keep their compilations beside the artifacts (artifacts ``off`` or
    # ``precompile`` off: not).
    with _precompiling(artifacts if spec.precompile == "on" else None):
        engine = _create(spec, random_model, device)
    if artifacts is not None:
        engine.compile_artifacts = artifacts  # written once the start has compiled everything
    if spec.voice_dir is not None:
        names = engine.voice_store.add_directory(spec.voice_dir)
        log.info("serving %d voice(s) from %s: %s", len(names), spec.voice_dir, ", ".join(names) or "none")
    return engine


def _create(spec: EngineSpec, random_model: str | None, device: str) -> Engine:
    if random_model is not None:
        return create_random_engine(random_model, spec)
    if spec.backend == "torch":
        return create_torch_engine(spec)

    from engines.runtime.trtllm import create_trtllm_engine

    if spec.gpu_arch != "auto":  # a TensorRT-LLM engine's kernels are chosen when it is built
        log.warning("PERSONAPLEX_GPU_ARCH=%s is ignored by the trtllm backend", spec.gpu_arch)
    return create_trtllm_engine(spec.checkpoint, max_slots=spec.max_slots, device=device, window=spec.window,
                                kv_cache=spec.kv_cache)


def _precompiling(artifacts) -> contextlib.AbstractContextManager:
    """Pieces compiled inside are kept ahead of time beside ``artifacts`` (``fastpath.precompiled``)."""
    if artifacts is None:
        return contextlib.nullcontext()
    from engines.fastpath.precompiled import storing_in

    return storing_in(artifacts.precompiled_dir())


def create_engine(checkpoint: str | Path | None = None, **options) -> Engine:
    """``build_engine(EngineSpec(checkpoint, **options))``: the same, named by keyword."""
    return build_engine(EngineSpec(checkpoint, **options))
