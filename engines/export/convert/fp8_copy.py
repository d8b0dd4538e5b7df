"""An fp8 copy of a checkpoint for the PyTorch engine (``convert_checkpoint.py --target torch-fp8``).

The engine can quantize bf16 weights at every start (``PERSONAPLEX_WEIGHTS=fp8``); this
writes the result once instead: a checkpoint directory like the source, whose LM file holds
``MoshiLM``'s own names with the projections and FFNs in fp8 beside their scales
(``engines.checkpoints.weights_format``), half the bytes to store, read and move.  The engine recognises
such a file and serves it in fp8 without being told.  The checkpoint's other files (Mimi,
the text tokenizer, the voices, the configs, the model card and licence) are copied as they
are (hard links where the file system allows).

Tensors are read, quantized and written one layer at a time (``write_streaming``), so host
memory stays near one layer's worth whatever the model's size.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from engines.checkpoints import loader as ckpt
from engines.errors import CheckpointError
from engines.model.fp8_weights import fp8_dtype_of, fp8_state_entries, is_quantized, quantize_lm_tensors, scale_name
from engines.checkpoints.weights_format import FORMAT_KEY, FP8_FORMAT, STEPS_KEY
from engines.export.convert.manifest import atomic_path, commit
from engines.export.convert.safetensors_stream import TensorSpec, write_streaming

log = logging.getLogger(__name__)


class _ShapesOnly:
    """A reader that answers from the file's header: the tensors it returns are on the meta
    device, so the copy's names, order and shapes are known before any weight is read."""

    def __init__(self, reader: ckpt.SafetensorsReader, dtype: torch.dtype) -> None:
        self.path, self.keys, self._reader, self._dtype = reader.path, reader.keys, reader, dtype

    def has(self, key: str) -> bool:
        return self._reader.has(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._reader.shape(key)

    def get(self, key: str, shape=None) -> torch.Tensor:
        return torch.empty(self._reader.check(key, shape), dtype=self._dtype, device="meta")


def _specs(reader: ckpt.SafetensorsReader, cfg, steps: int, dtype: torch.dtype) -> list[TensorSpec]:
    """What ``fp8_state_entries(quantize_lm_tensors(...))`` will produce, in its order."""
    specs = []
    for name, t in ckpt.iter_lm_tensors(_ShapesOnly(reader, dtype), cfg, steps):
        specs.append(TensorSpec(name, tuple(t.shape), fp8_dtype_of(name) or dtype))
        if is_quantized(name):
            specs.append(TensorSpec(scale_name(name), tuple(t.shape[:-1]), torch.float32))
    return specs


def _copy_file(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(source, target)


def write_fp8_copy(model_dir: Path, output_dir: Path, steps: int = 8, force: bool = False) -> Path:
    """Write the fp8 copy of the checkpoint in ``model_dir`` to ``output_dir`` (``steps``
    depformer steps: 8, the agent's codebooks, or 16); returns its LM file."""
    files = ckpt.locate(model_dir)
    reader = ckpt.SafetensorsReader(files.lm_weights)
    if ckpt.is_fp8_copy(reader):
        raise CheckpointError(f"{files.lm_weights} is already an fp8 copy")
    have = ckpt.depformer_steps_in_file(reader)
    if have < steps:
        raise CheckpointError(f"{files.lm_weights}: {have} depformer steps, --depformer-steps {steps} asked")
    output_dir = Path(output_dir)
    for leftover in output_dir.glob(".*.partial"):  # an interrupted run's (write_streaming's temporary name)
        leftover.unlink()
    if output_dir.resolve() == Path(model_dir).resolve():
        raise CheckpointError("--output-dir is the checkpoint itself: give another directory")
    if output_dir.exists() and (not output_dir.is_dir() or (any(output_dir.iterdir()) and not force)):
        raise CheckpointError(f"--output-dir {output_dir} exists and is not an empty directory; pass --force "
                              "to overwrite it")
    cfg = files.lm_config
    dtype = reader.dtype("text_emb.weight")  # the checkpoint's: the unquantized tensors keep it
    lm_file = output_dir / files.lm_weights.relative_to(files.root)
    specs = _specs(reader, cfg, steps, dtype)
    log.info("writing %s: %d tensors, %.2f GB (the source LM file: %.2f GB)", lm_file, len(specs),
             sum(s.nbytes for s in specs) / 1e9, files.lm_weights.stat().st_size / 1e9)
    layers_done = 0

    def counted(tensors):
        nonlocal layers_done
        for name, tensor in tensors:
            if name.endswith(".ffn_out_scale") and name.startswith("layers."):
                layers_done += 1
                if layers_done % 8 == 0 or layers_done == cfg.num_layers:
                    log.info("quantized %d/%d temporal layers", layers_done, cfg.num_layers)
            yield name, tensor

    tensors = counted(fp8_state_entries(quantize_lm_tensors(ckpt.iter_lm_tensors(reader, cfg, steps))))
    write_streaming(atomic_path(lm_file), specs, tensors,
                    metadata={FORMAT_KEY: FP8_FORMAT, STEPS_KEY: str(steps), "source": files.lm_weights.name})
    commit(lm_file)
    # Everything else as it is: Mimi, the tokenizer, voices.tgz, the configs, the model card.
    for path in sorted(files.root.iterdir()):
        if path.is_file() and path != files.lm_weights:
            _copy_file(path, output_dir / path.name)
    for path in (files.mimi_weights, files.tokenizer):  # named by config.json in a subdirectory
        if path.parent != files.root:
            _copy_file(path, output_dir / path.relative_to(files.root))
    if files.voices_dir is not None:
        for voice in sorted(files.voices_dir.iterdir()):
            if voice.is_file():
                _copy_file(voice, output_dir / files.voices_dir.name / voice.name)
    log.info("wrote the fp8 copy %s; serve it with PERSONAPLEX_CHECKPOINT=%s", output_dir, output_dir)
    return lm_file
