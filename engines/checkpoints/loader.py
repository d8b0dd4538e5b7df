"""Find and read a local checkpoint directory.

Two layouts are understood:
- ``nvidia/personaplex-7b-v1``: ``model.safetensors`` (LM, bf16), Mimi
  ``tokenizer-e351c8d8-checkpoint125.safetensors``, ``tokenizer_spm_32k_3.model``,
  ``voices/*.pt`` or ``voices.tgz``, and an empty ``config.json`` (= PersonaPlex defaults).
- Kyutai Moshi repositories: ``config.json`` holding ``LMModel`` kwargs plus optional file
  names (``moshi_name``, ``mimi_name``, ``tokenizer_name``, ``mimi_config_name``).

LM tensors are validated against the configuration (every missing or mis-shaped tensor is
named) and mapped onto ``engines.model.lm.MoshiLM``'s canonical parameters.  Fused
(``self_attn.in_proj_weight``) and per-step (``self_attn.in_projs.{t}.weight``) attention
names are both accepted, and depformer files with 8 or 16 steps.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from engines.config import (CONFIG_FILE, LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_ARCHIVE, VOICES_DIR, ConfigError,
                     LMConfig, MimiConfig)
from engines.errors import CheckpointError
from engines.model.fp8_weights import fp8_dtype_of
from engines.checkpoints.weights_format import STEPS_KEY, holds_fp8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each part of a checkpoint lives, and the configurations read with it."""

    root: Path | None
    lm_weights: Path
    mimi_weights: Path
    tokenizer: Path
    lm_config: LMConfig
    mimi_config: MimiConfig
    voices_dir: Path | None
    voices_archive: Path | None
    name: str


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    return path


def locate(
    root: str | Path | None = None,
    *,
    lm_weights: str | Path | None = None,
    mimi_weights: str | Path | None = None,
    tokenizer: str | Path | None = None,
    voices_dir: str | Path | None = None,
) -> CheckpointFiles:
    """Resolve the files of a checkpoint directory; explicit paths override the directory's."""
    base = Path(root) if root is not None else None
    if base is not None and not base.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {base}")
    raw: dict = {}
    if base is not None and (base / CONFIG_FILE).is_file():
        text = (base / CONFIG_FILE).read_text(encoding="utf-8").strip()
        if text:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{base / CONFIG_FILE} is not valid JSON: {exc}") from exc
            if not isinstance(raw, dict):
                raise CheckpointError(f"{base / CONFIG_FILE} must hold a JSON object")
    lm_kwargs = dict(raw)
    names = {key: lm_kwargs.pop(key, None) for key in ("moshi_name", "mimi_name", "tokenizer_name", "mimi_config_name")}
    for key in ("lora_name", "model_type", "lm_gen_config", "tts_config", "stt_config", "model_id"):
        value = lm_kwargs.pop(key, None)
        if key == "model_type" and value not in (None, "moshi"):
            raise CheckpointError(f"{base / CONFIG_FILE}: model_type {value!r} is not supported (only 'moshi')")
        if key == "lora_name" and value:
            raise CheckpointError(f"{base / CONFIG_FILE}: LoRA checkpoints are not supported")

    def pick(explicit, default_name, what) -> Path:
        if explicit is not None:
            return _require_file(Path(explicit), what)
        if base is None:
            raise CheckpointError(f"{what}: give a checkpoint directory or an explicit path")
        return _require_file(base / default_name, what)

    try:
        lm_config = LMConfig.from_moshi_kwargs(lm_kwargs) if lm_kwargs else LMConfig()
        mimi_config = MimiConfig()
        if names["mimi_config_name"]:
            mimi_cfg_path = _require_file(base / names["mimi_config_name"], "Mimi config")
            mimi_config = MimiConfig.from_moshi_config(json.loads(mimi_cfg_path.read_text(encoding="utf-8")))
    except ConfigError as exc:
        raise CheckpointError(f"{base}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"Mimi config is not valid JSON: {exc}") from exc

    vdir = Path(voices_dir) if voices_dir is not None else (base / VOICES_DIR if base is not None else None)
    if voices_dir is not None and not vdir.is_dir():
        raise CheckpointError(f"voice prompt directory not found: {vdir}")
    archive = base / VOICES_ARCHIVE if base is not None else None
    return CheckpointFiles(
        root=base,
        lm_weights=pick(lm_weights, names["moshi_name"] or LM_FILE, "LM weights"),
        mimi_weights=pick(mimi_weights, names["mimi_name"] or MIMI_FILE, "Mimi weights"),
        tokenizer=pick(tokenizer, names["tokenizer_name"] or TOKENIZER_FILE, "text tokenizer"),
        lm_config=lm_config,
        mimi_config=mimi_config,
        voices_dir=vdir if vdir is not None and vdir.is_dir() else None,
        voices_archive=archive if archive is not None and archive.is_file() else None,
        name=base.name if base is not None else Path(lm_weights or "model").stem,
    )


class SafetensorsReader:
    """Lazy, validated access to one safetensors file (tensors are read one at a time, so
    a 16.7 GB checkpoint never needs two copies in memory)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            self.keys = set(self._file.keys())
            self.metadata: dict[str, str] = self._file.metadata() or {}
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise CheckpointError(f"cannot read {path}: {exc}") from exc

    def has(self, key: str) -> bool:
        return key in self.keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """From the header: an empty slice of the tensor, no data read."""
        return self._file.get_slice(key)[:0].dtype

    def check(self, key: str, shape: Iterable[int] | None = None) -> tuple[int, ...]:
        """``key``'s shape from the header, or ``CheckpointError`` naming it when it is missing
        or not ``shape``: before a tensor's bytes are read."""
        if key not in self.keys:
            raise CheckpointError(f"{self.path}: missing tensor {key!r}")
        have = self.shape(key)
        if shape is not None and have != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {have}, expected {tuple(shape)}")
        return have

    def get(self, key: str, shape: Iterable[int] | None = None) -> torch.Tensor:
        self.check(key, shape)
        return self._file.get_tensor(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._file.get_tensor(k) for k in sorted(self.keys)}


def _attention_weight(reader: SafetensorsReader, prefix: str, fused: str, split: str, steps: int,
                      rows: int, cols: int) -> torch.Tensor:
    """Per-step attention weight [steps, rows, cols] from fused or split names."""
    if reader.has(prefix + fused):
        shape = reader.shape(prefix + fused)
        if len(shape) != 2 or shape[1] != cols or shape[0] % rows:
            raise CheckpointError(
                f"{reader.path}: tensor {prefix + fused!r} has shape {shape}, expected [n*{rows}, {cols}]"
            )
        have = shape[0] // rows
        if have < steps:
            _too_few(reader, prefix + fused, have, steps)
        w = reader.get(prefix + fused).view(have, rows, cols)
        # Clone the slice so the unused steps' rows are not kept alive.
        return w[:steps].clone() if steps < have else w
    keys = [prefix + split.format(t=t) for t in range(steps)]
    if not reader.has(keys[0]):
        raise CheckpointError(f"{reader.path}: missing tensor {prefix + fused!r} (or {keys[0]!r})")
    return torch.stack([reader.get(k, (rows, cols)) for k in keys])


def _too_few(reader: SafetensorsReader, key: str, have: int, want: int) -> None:
    raise CheckpointError(
        f"{reader.path}: {key!r} holds {have} depformer steps, {want} are needed "
        f"(the 16-step conformance mode needs a 16-step checkpoint)"
    )


def depformer_steps_in_file(reader: SafetensorsReader) -> int:
    n = 0
    while reader.has(f"linears.{n}.weight"):
        n += 1
    return n


def _converter(convert: Callable[[torch.Tensor], torch.Tensor]):
    return lambda reader, key, shape: convert(reader.get(key, shape))


def lm_io_tensors(reader: SafetensorsReader, cfg: LMConfig,
                  convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, torch.Tensor]:
    """The temporal transformer's input tables, final norm and text head (``MoshiLM`` names)."""
    d = cfg.dim
    get = _converter(convert)
    return {
        "emb": torch.stack([get(reader, f"emb.{i}.weight", (cfg.card + 1, d)) for i in range(cfg.n_q)]),
        "text_emb": get(reader, "text_emb.weight", (cfg.text_card + 1, d)),
        "out_norm": get(reader, "out_norm.alpha", (1, 1, d)).view(d),
        "text_linear": get(reader, "text_linear.weight", (cfg.text_card, d)),
    }


def temporal_layer_tensors(reader: SafetensorsReader, cfg: LMConfig, layer: int,
                           convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, torch.Tensor]:
    """One temporal layer's weights, keyed by ``TemporalLayer`` parameter name."""
    d, h = cfg.dim, cfg.ffn_hidden
    get = _converter(convert)
    p = f"transformer.layers.{layer}."
    return {
        "in_proj": convert(_attention_weight(reader, p + "self_attn.", "in_proj_weight", "in_projs.{t}.weight", 1, 3 * d, d)[0]),
        "out_proj": convert(_attention_weight(reader, p + "self_attn.", "out_proj.weight", "out_projs.{t}.weight", 1, d, d)[0]),
        "norm1": get(reader, p + "norm1.alpha", (1, 1, d)).view(d),
        "norm2": get(reader, p + "norm2.alpha", (1, 1, d)).view(d),
        "ffn_in": get(reader, p + "gating.linear_in.weight", (2 * h, d)),
        "ffn_out": get(reader, p + "gating.linear_out.weight", (d, h)),
    }


def depformer_tensors(reader: SafetensorsReader, cfg: LMConfig, steps: int,
                      convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, torch.Tensor]:
    """The depformer's weights for its first ``steps`` codebook steps (``MoshiLM`` names)."""
    d, dd, hd = cfg.dim, cfg.depformer_dim, cfg.depformer_ffn_hidden
    have = depformer_steps_in_file(reader)
    if have == 0:
        raise CheckpointError(f"{reader.path}: missing tensor 'linears.0.weight' (no depformer heads)")
    if have < steps:
        _too_few(reader, "linears.*", have, steps)
    get = _converter(convert)
    out: dict[str, torch.Tensor] = {
        "depformer_in": torch.stack([get(reader, f"depformer_in.{t}.weight", (dd, d)) for t in range(steps)]),
        "depformer_text_emb": get(reader, "depformer_text_emb.weight", (cfg.text_card + 1, dd)),
        "linears": torch.stack([get(reader, f"linears.{t}.weight", (cfg.card, dd)) for t in range(steps)]),
    }
    out["depformer_emb"] = (
        torch.stack([get(reader, f"depformer_emb.{t}.weight", (cfg.card + 1, dd)) for t in range(steps - 1)])
        if steps > 1 else torch.empty(0, cfg.card + 1, dd)
    )
    for layer in range(cfg.depformer_num_layers):
        p = f"depformer.layers.{layer}."
        q = f"depformer_layers.{layer}."
        out[q + "in_proj"] = convert(_attention_weight(reader, p + "self_attn.", "in_proj_weight", "in_projs.{t}.weight", steps, 3 * dd, dd))
        out[q + "out_proj"] = convert(_attention_weight(reader, p + "self_attn.", "out_proj.weight", "out_projs.{t}.weight", steps, dd, dd))
        out[q + "norm1"] = get(reader, p + "norm1.alpha", (1, 1, dd)).view(dd)
        out[q + "norm2"] = get(reader, p + "norm2.alpha", (1, 1, dd)).view(dd)
        out[q + "ffn_in"] = torch.stack([get(reader, p + f"gating.{t}.linear_in.weight", (2 * hd, dd)) for t in range(steps)])
        out[q + "ffn_out"] = torch.stack([get(reader, p + f"gating.{t}.linear_out.weight", (dd, hd)) for t in range(steps)])
    return out


def iter_lm_tensors(
    reader: SafetensorsReader,
    cfg: LMConfig,
    steps: int,
    convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read and validate every LM tensor, as (``MoshiLM`` parameter name, tensor), a layer's
    worth at a time so a consumer can transform each before the next is read.

    ``steps`` is the number of depformer steps to load (8: agent codebooks only).
    ``convert`` is applied to each tensor as it is read (dtype/device), to bound peak memory.
    """
    yield from depformer_tensors(reader, cfg, steps, convert).items()  # first: names a file without heads
    yield from lm_io_tensors(reader, cfg, convert).items()
    for layer in range(cfg.num_layers):
        for name, tensor in temporal_layer_tensors(reader, cfg, layer, convert).items():
            yield f"layers.{layer}.{name}", tensor


# The tensors of an fp8 copy (engines.checkpoints.weights_format) whose first dimension is the depformer
# step (depformer_emb's is step - 1): a copy of more steps serves an engine running fewer.
_PER_STEP = re.compile(r"^(depformer_in|linears|depformer_emb)(_scale)?$"
                       r"|^depformer_layers\.\d+\.(in_proj|out_proj|ffn_in|ffn_out)(_scale)?$")


def is_fp8_copy(reader: SafetensorsReader) -> bool:
    return holds_fp8(reader.metadata)


def iter_fp8_copy_tensors(
    reader: SafetensorsReader,
    expected: dict[str, torch.Tensor],
    convert: Callable[[torch.Tensor], torch.Tensor],
    place: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of an fp8 copy, checked against ``expected`` (an fp8 ``MoshiLM``'s state
    dict, on the meta device: names and shapes).  ``convert`` brings a tensor in the model
    dtype to its device and dtype; ``place`` moves fp8 data and float32 scales as they are."""
    held = int(reader.metadata.get(STEPS_KEY, "0"))
    extra = sorted(reader.keys - set(expected))
    if extra:
        raise CheckpointError(f"{reader.path}: an fp8 copy with tensors this model does not have: {extra[:3]}")
    for name, want in expected.items():
        t = reader.get(name)
        if _PER_STEP.match(name) and t.dim() == want.dim() and t.shape[1:] == want.shape[1:] and \
                t.shape[0] > want.shape[0]:
            t = t[: want.shape[0]]  # the copy holds more depformer steps than this engine runs
        if t.shape != want.shape:
            why = f" (it holds {held} depformer steps)" if _PER_STEP.match(name) else ""
            raise CheckpointError(f"{reader.path}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(want.shape)}{why}")
        stored = fp8_dtype_of(name)
        if stored is not None and t.dtype != stored:
            raise CheckpointError(f"{reader.path}: tensor {name!r} is {t.dtype}, expected {stored}")
        yield name, convert(t) if stored is None else place(t)


def load_lm_tensors(
    reader: SafetensorsReader,
    cfg: LMConfig,
    steps: int,
    convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> dict[str, torch.Tensor]:
    """``iter_lm_tensors`` as one dict."""
    return dict(iter_lm_tensors(reader, cfg, steps, convert))
