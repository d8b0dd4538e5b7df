"""Build the configured engine (the one entry point the orchestrator and CLIs use)."""

from __future__ import annotations

import logging
from pathlib import Path

from engines.config import BACKENDS, WindowMode
from engines.interface import Engine
from engines.runtime.memory_plan import MemorySettings
from engines.checkpoints.random_weights import create_random_engine, random_model_name

log = logging.getLogger(__name__)

def create_torch_engine(
    checkpoint: str | Path | None,
    *,
    max_slots: int | None,
    device: str = "cpu",
    window: str = WindowMode.REFERENCE,
    depformer_steps: int = 8,
    kv_cache: str = "auto",
    compile: str = "auto",
    weights: str = "auto",
    memory: MemorySettings = MemorySettings(),
    **locate_overrides,
):
    """The PyTorch engine for ``checkpoint`` (``None``: the embedded tiny demo model).

    ``checkpoint`` is a directory or a Hugging Face repo id (``owner/name[@revision]``,
    downloaded into the standard cache: ``engines/checkpoints/hub.py``).  ``locate_overrides`` are
    explicit file paths (``lm_weights``, ``mimi_weights``, ``tokenizer``, ``voices_dir``)
    that take precedence over the directory's files.
    """
    from engines.checkpoints import loader as ckpt
    from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
    from engines.checkpoints.hub import resolve_checkpoint
    from engines.checkpoints.tiny import ensure_tiny_checkpoint

    is_demo = checkpoint is None and not locate_overrides.get("lm_weights")
    if is_demo:
        checkpoint = ensure_tiny_checkpoint()
        # The server and the CLIs each say how to point at real weights in their own terms.
        log.info("using the embedded tiny demo checkpoint (untrained) at %s", checkpoint)
    files = ckpt.locate(resolve_checkpoint(checkpoint), **locate_overrides)
    options = EngineOptions(device=device, window=window, depformer_steps=depformer_steps, kv_cache=kv_cache,
                            compile=_compile_enabled(compile, device), weights=weights, memory=memory)
    return PersonaPlexEngine.from_files(files, max_slots, options, is_demo=is_demo)


def _compile_enabled(compile: str, device: str) -> bool:
    # Compiled blocks pay off on a GPU (fewer kernels in the tick graph); on CPU the exact
    # eager path is the reference.
    return compile == "on" or (compile == "auto" and device.startswith("cuda"))


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


def create_engine(
    checkpoint: str | Path | None,
    *,
    max_slots: int | None,
    device: str = "cpu",
    backend: str = "torch",
    window: str = WindowMode.REFERENCE,
    kv_cache: str = "auto",
    compile: str = "auto",
    weights: str = "auto",
    voice_dir: str | Path | None = None,
    cpu_threads: int = 0,
    memory: MemorySettings = MemorySettings(),
) -> Engine:
    """Load ``checkpoint`` (a local checkpoint directory, or a Hugging Face repo id) into an
    engine with ``max_slots`` session slots (None: the torch backend's memory plan decides,
    ``memory`` its settings; ``engines/runtime/memory_plan.py``).  ``None`` selects the embedded default: the
    deterministic tiny demo checkpoint, generated once into a cache directory;
    ``random:<model>`` random weights at that model's shapes (``engines/checkpoints/random_weights.py``).
    ``voice_dir``: more voices, served ahead of the checkpoint's (every file checked now).
    ``weights``: ``EngineOptions.weights`` ("fp8": the torch backend only).
    ``cpu_threads``: torch's intra-op threads for an engine on the CPU (the whole process's;
    0 leaves torch's default).

    On CUDA the calling thread's current device becomes ``device``: drive the engine from
    this thread."""
    _bind_thread_to(device)
    if device == "cpu" and cpu_threads > 0:
        import torch

        torch.set_num_threads(cpu_threads)
    if device.startswith("cuda"):  # compiled pieces and Triton kernels: keep them for the next start
        from engines.fastpath.compiled import use_persistent_caches

        use_persistent_caches()
    random_model = random_model_name(checkpoint)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if weights != "auto" and backend != "torch":
        # TensorRT-LLM fixes its weights' precision when its engine is built.
        raise ValueError(f"weights={weights!r} needs the torch backend, not {backend!r}")
    if random_model is not None:
        if backend != "torch":
            raise ValueError(f"random weights ({checkpoint}) need the torch backend, not {backend!r}")
        engine = create_random_engine(random_model, max_slots=max_slots, device=device, window=window,
                                      kv_cache=kv_cache, compile=_compile_enabled(compile, device),
                                      weights=weights, memory=memory)
    elif backend == "torch":
        engine = create_torch_engine(checkpoint, max_slots=max_slots, device=device, window=window,
                                     kv_cache=kv_cache, compile=compile, weights=weights, memory=memory)
    else:
        # ``checkpoint`` is then a build directory written by convert_checkpoint.py.
        from engines.runtime.trtllm import create_trtllm_engine

        if max_slots is None:
            raise ValueError("the TensorRT-LLM backend admits the sessions its build was made for: give max_slots")

        engine = create_trtllm_engine(checkpoint, max_slots=max_slots, device=device, window=window,
                                      kv_cache=kv_cache)
    if voice_dir is not None:
        names = engine.voice_store.add_directory(voice_dir)
        log.info("serving %d voice(s) from %s: %s", len(names), voice_dir, ", ".join(names) or "none")
    return engine
