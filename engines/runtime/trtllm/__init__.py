"""The TensorRT-LLM backend (``PERSONAPLEX_BACKEND=trtllm``).

The temporal transformer runs as a Llama-shaped TensorRT-LLM 1.2.1 engine built from the
checkpoint ``convert_checkpoint.py`` writes, driven one tick at a time through its prompt
table; the 17-stream embedding, the depformer and Mimi run beside it (docs/TRTLLM.md).
Everything that imports TensorRT or TensorRT-LLM goes through ``guard``; the rest (layout,
prompt-table inputs, slot bookkeeping, the tick) is plain PyTorch and tested on CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engines.state.kv_ring import WindowMode
from engines.runtime.trtllm.guard import BackendUnavailable, require_tensorrt_llm
from engines.runtime.trtllm.layout import BuildLayout

__all__ = ["BackendUnavailable", "check_build", "create_trtllm_engine"]

log = logging.getLogger(__name__)


def check_build(build_dir: str | Path | None) -> BuildLayout:
    """The build directory's layout, or ``BackendUnavailable`` naming the step to run."""
    if build_dir is None:
        raise BackendUnavailable("PERSONAPLEX_BACKEND=trtllm needs PERSONAPLEX_CHECKPOINT set to a build directory "
                                 "written by convert_checkpoint.py (e.g. build/pp7b)")
    layout = BuildLayout(build_dir)
    if not layout.runtime.is_file():
        raise BackendUnavailable(f"{layout.root} is not a converted build directory (no {layout.runtime.name}): "
                                 f"run python convert_checkpoint.py --model-dir CHECKPOINT --output-dir {layout.root}")
    try:
        layout.read_meta()
    except ValueError as exc:
        raise BackendUnavailable(str(exc)) from exc
    missing = [p for p in (layout.lm_config, layout.embeddings, layout.depformer, layout.mimi, layout.mimi_config,
                           layout.tokenizer) if not p.is_file()]
    if missing:
        raise BackendUnavailable(f"{layout.root} is incomplete (missing {', '.join(str(p) for p in missing)}): "
                                 "re-run convert_checkpoint.py with the same arguments to finish it")
    if not (layout.engine_dir / "rank0.engine").is_file():
        raise BackendUnavailable(f"no TensorRT-LLM engine in {layout.engine_dir}: run the trtllm-build command "
                                 f"in {layout.readme}")
    return layout


def create_trtllm_engine(build_dir: str | Path | None, *, max_slots: int, device: str = "cuda",
                         window: str = WindowMode.REFERENCE, kv_cache: str = "auto"):
    """The TensorRT-LLM engine for a converted and built directory (``check_build``)."""
    from engines.runtime.trtllm.engine import TrtllmEngine, attention_window
    from engines.runtime.trtllm.runtime import TrtllmExecutor

    require_tensorrt_llm()
    layout = check_build(build_dir)
    meta = layout.read_meta()
    if kv_cache != "auto" and kv_cache != meta.kv_cache_dtype:
        log.warning(
            "PERSONAPLEX_KV_CACHE=%s is ignored by the trtllm backend: the KV cache dtype (%s) is fixed when "
            "the checkpoint is converted (--kv-cache-dtype)", kv_cache, meta.kv_cache_dtype)
    executor = TrtllmExecutor(layout, meta, max_slots, attention_window(meta.context, window), device)
    return TrtllmEngine.from_build(layout, executor, max_slots, device, window)
