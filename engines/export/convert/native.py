"""Writers of the native artifacts: what the TensorRT-LLM backend runs outside the engine.

Each writer reads the source checkpoint through the same loaders as the PyTorch engine
(``engines.checkpoints.loader``, ``engines.checkpoints.voices``, ``engines.model.prefill``) and writes one artifact
under a temporary name (``manifest.atomic_path``); the pipeline commits and records it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engines.checkpoints.loader import (
    CheckpointFiles,
    SafetensorsReader,
    depformer_tensors,
    lm_io_tensors,
)
from engines.config import DEFAULT_PERSONA
from engines.model.mimi import MimiCodec
from engines.model.prefill import plan_prompt, prompt_embeddings
from engines.checkpoints.tokenizer import TextTokenizer
from engines.runtime.trtllm.native import (
    EMBEDDING_KEYS,
    partial_lm,
    prefill_file_name,
    stored_prefill,
    write_prefill,
    write_prefill_index,
)
from engines.checkpoints.voices import VoiceStore
from engines.export.convert.manifest import atomic_path, commit

log = logging.getLogger(__name__)


def write_lm_config(files: CheckpointFiles, path: Path) -> list[Path]:
    atomic_path(path).write_text(json.dumps(files.lm_config.to_moshi_kwargs(), indent=2) + "\n")
    return [commit(path)]


def write_embeddings(reader: SafetensorsReader, files: CheckpointFiles, dtype: torch.dtype, path: Path) -> list[Path]:
    """The 16 audio tables and the text table, in the engine dtype: the per-tick input
    embedding is their 17-way sum (audio streams first, then text, as the reference)."""
    io = lm_io_tensors(reader, files.lm_config, convert=lambda t: t.to(dtype))
    save_file({k: io[k].contiguous() for k in EMBEDDING_KEYS}, str(atomic_path(path)))
    return [commit(path)]


def write_depformer(reader: SafetensorsReader, files: CheckpointFiles, steps: int, dtype: torch.dtype,
                    path: Path) -> list[Path]:
    tensors = depformer_tensors(reader, files.lm_config, steps, convert=lambda t: t.to(dtype))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(atomic_path(path)),
              metadata={"depformer_steps": str(steps)})
    return [commit(path)]


def mimi_state_with_codebooks(files: CheckpointFiles) -> dict[str, torch.Tensor]:
    """The Mimi state dict in the official layout, with each used codebook stored
    precomputed: ``embedding_sum`` holds ``embedding_sum / clamp(cluster_usage)`` and
    ``cluster_usage`` is one, so any reader of the official layout (our loader, the ONNX
    exporter) gets the same codebook without the division.  Unused levels are dropped."""
    state = SafetensorsReader(files.mimi_weights).state_dict()
    cfg = files.mimi_config
    codec = MimiCodec.from_state_dict(cfg, state, 1)  # validates every tensor it uses
    out: dict[str, torch.Tensor] = {}
    used = {"rvq_first": {0}, "rvq_rest": set(range(cfg.num_codebooks - 1))}
    for key, tensor in state.items():
        parts = key.split(".")
        if key.startswith("quantizer.rvq_") and ".vq.layers." in key:
            half, level = parts[1], int(parts[4])
            if level not in used[half]:
                continue
            k = 0 if half == "rvq_first" else level + 1
            if key.endswith("embedding_sum"):
                tensor = codec.quantizer.codebooks[k].detach().clone()
            elif key.endswith("cluster_usage"):
                tensor = torch.ones_like(tensor)
        out[key] = tensor.contiguous()
    return out


def write_mimi(files: CheckpointFiles, mimi_path: Path, config_path: Path) -> list[Path]:
    save_file(mimi_state_with_codebooks(files), str(atomic_path(mimi_path)))
    config = dict(files.mimi_config.to_moshi_config(), num_codebooks=files.mimi_config.num_codebooks)
    atomic_path(config_path).write_text(json.dumps(config, indent=2) + "\n")
    return [commit(mimi_path), commit(config_path)]


def voice_store(files: CheckpointFiles) -> VoiceStore:
    cfg = files.lm_config
    return VoiceStore(files.voices_dir, files.root, files.voices_archive, cfg.dim, cfg.num_streams)


def write_tokenizer_and_voices(files: CheckpointFiles, tokenizer_path: Path, voices_dir: Path) -> list[Path]:
    shutil.copyfile(files.tokenizer, atomic_path(tokenizer_path))
    written = [commit(tokenizer_path)]
    voices_dir.mkdir(parents=True, exist_ok=True)
    store = voice_store(files)
    for name in store.names():
        voice = store.load(name)
        path = voices_dir / name
        # The reference's layout: embeddings [N-1, 1, 1, D], cache [1, 17, 4].
        torch.save({"embeddings": voice.embeddings.view(-1, 1, 1, voice.embeddings.shape[-1]),
                    "cache": voice.cache.view(1, *voice.cache.shape)}, atomic_path(path))
        written.append(commit(path))
    return written


def write_prefills(reader: SafetensorsReader, files: CheckpointFiles, dtype: torch.dtype, max_prefill: int,
                   directory: Path) -> tuple[list[Path], tuple[int, ...]]:
    """The default persona with every bundled voice: prompt embeddings + token-ring state.

    Returns the files and the default persona's token ids.
    """
    cfg = files.lm_config
    io = lm_io_tensors(reader, cfg, convert=lambda t: t.to(dtype))
    lm = partial_lm(cfg, 1, {k: io[k] for k in EMBEDDING_KEYS})
    persona = tuple(TextTokenizer(files.tokenizer).persona_tokens(DEFAULT_PERSONA))
    store = voice_store(files)
    directory.mkdir(parents=True, exist_ok=True)
    written, index = [], []
    names = store.names()
    if not names:
        log.warning("the checkpoint bundles no voices: no prefill is precomputed")
    for name in tqdm(names, desc="prefills", unit="voice", disable=None):
        voice = store.load(name)
        plan = plan_prompt(cfg, voice, persona)
        with torch.inference_mode():
            prefill = stored_prefill(prompt_embeddings(lm, voice, plan), plan)
        if prefill.positions > max_prefill:
            raise ValueError(f"voice {name} with the default persona needs {prefill.positions} prompt positions, "
                             f"more than --max-prefill {max_prefill}")
        path = directory / prefill_file_name(name, persona)
        write_prefill(atomic_path(path), name, persona, prefill)
        written.append(commit(path))
        index.append({"voice": name, "persona": "default", "file": path.name, "positions": prefill.positions})
    write_prefill_index(directory, index)
    written.append(directory / "index.json")
    return written, persona
