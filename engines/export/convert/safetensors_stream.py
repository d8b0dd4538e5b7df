"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once: 14 GB for the 7B
temporal transformer.  The format is simple (an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the raw little-endian bytes in
that order), so when the shapes are known up front the header can be written first and the
tensors streamed after it, each produced, written and dropped in turn.  Files written here
are read back with the ``safetensors`` library in the tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} is not supported")
        header[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(out: BinaryIO, spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(f"{spec.name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                         f"declared {spec.shape} {spec.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        out.write(flat.view(torch.uint8).numpy().tobytes())


def write_streaming(path: str | Path, specs: Iterable[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                    metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name, tensor) in the order of ``specs`` to ``path``.

    Each produced tensor must match its spec exactly; a missing or extra tensor is an error
    (the header would otherwise promise bytes that never come).
    """
    specs = list(specs)
    with open(path, "wb") as out:
        out.write(_header(specs, metadata))
        produced = iter(tensors)
        for spec in specs:
            try:
                name, tensor = next(produced)
            except StopIteration:
                raise ValueError(f"tensor {spec.name!r} was declared but never produced") from None
            if name != spec.name:
                raise ValueError(f"produced {name!r} where {spec.name!r} was declared")
            _write_tensor(out, spec, tensor)
        extra = next(produced, None)
        if extra is not None:
            raise ValueError(f"tensor {extra[0]!r} was produced but not declared")
