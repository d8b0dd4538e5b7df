"""fp8 (e4m3) weights for the LM's linear layers, one scale per output channel (issue 20).

A weight W [..., out, in] is stored as Q = e4m3(W / s) with s[..., o] = max|W[..., o, :]| /
448 (``fp8.quantize_fp8`` over the input dimension): half the bytes of bf16, which every tick
reads.  Which weights: the temporal transformer's and the depformer's projections and FFNs
(``is_quantized``; the depformer's carry a leading step dimension, so their scales are per
step and output channel).  Embeddings, norms and the output heads keep the model dtype.

The reference computation (the CPU, and GPUs without fp8 GEMMs) is W8A16: dequantize to the
activations' dtype, then the usual product (``Fp8Weight.dequantize``); Hopper runs fp8 GEMMs
(``layers.linear``).  In a ``MoshiLM`` state dict a quantized weight NAME is two entries:
NAME (the fp8 data) and NAME_scale (``fp8_state_entries``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from engines.model.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8

# Canonical LM weight names (``engines.checkpoints.loader``) stored in fp8.
_QUANTIZED = re.compile(r"^(layers|depformer_layers)\.\d+\.(in_proj|out_proj|ffn_in|ffn_out)$|^depformer_in$")


def is_quantized(name: str) -> bool:
    return _QUANTIZED.match(name) is not None


@dataclass(frozen=True)
class Fp8Weight:
    data: torch.Tensor  # float8 e4m3 [..., out, in]
    scale: torch.Tensor  # float32 [..., out]

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE or self.scale.dtype != torch.float32:
            raise ValueError(f"an fp8 weight is {FP8_DTYPE} data with float32 scales, got {self.data.dtype} and "
                             f"{self.scale.dtype}")
        if self.scale.shape != self.data.shape[:-1]:
            raise ValueError(f"scales {tuple(self.scale.shape)} do not match a weight of {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale, dtype)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    if weight.dim() < 2:
        raise ValueError(f"a linear weight has an output and an input dimension, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("the weight holds non-finite values")
    data, scale = quantize_fp8(weight)
    return Fp8Weight(data, scale)


def quantize_lm_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """``tensors`` (name, tensor) with the weights ``is_quantized`` names in fp8, one at a time
    as they come, so a checkpoint streamed through it never holds two copies in memory."""
    for name, tensor in tensors:
        yield name, quantize_weight(tensor) if is_quantized(name) else tensor


_SCALE_SUFFIX = "_scale"


def scale_name(name: str) -> str:
    """The state-dict name of the scales of the fp8 weight ``name`` (``MoshiLM``'s layout)."""
    return name + _SCALE_SUFFIX


def fp8_dtype_of(name: str) -> torch.dtype | None:
    """The dtype of the state-dict entry ``name`` of an fp8 model: fp8 data, float32 scales,
    or None for a weight in the model dtype."""
    if is_quantized(name):
        return FP8_DTYPE
    if name.endswith(_SCALE_SUFFIX) and is_quantized(name.removesuffix(_SCALE_SUFFIX)):
        return torch.float32
    return None


def fp8_state_entries(
        tensors: Iterable[tuple[str, torch.Tensor | Fp8Weight]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``quantize_lm_tensors``' output as ``MoshiLM`` state-dict entries."""
    for name, value in tensors:
        if isinstance(value, Fp8Weight):
            yield name, value.data
            yield scale_name(name), value.scale
        else:
            yield name, value
