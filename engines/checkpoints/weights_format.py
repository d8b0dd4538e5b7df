"""How a checkpoint stores its LM weights, read without torch (the server's settings size
admission with it before any engine exists).

The official ``model.safetensors`` holds bf16 tensors under the reference's names.  A copy
written by ``convert_checkpoint.py --target torch-fp8`` (``engines.export.convert.fp8_copy``) holds
``MoshiLM``'s own names instead, the projections and FFNs in float8 e4m3 with their
``NAME_scale`` tensors, and says so in the file's metadata: ``FORMAT_KEY`` = ``FP8_FORMAT``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from engines.config import LM_FILE

FORMAT_KEY = "personaplex_format"
FP8_FORMAT = "moshi-lm-fp8-v1"
STEPS_KEY = "depformer_steps"  # how many depformer steps the copy holds
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file ({} when it has none); ``ValueError`` when
    the file is not one."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def holds_fp8(metadata: dict[str, str]) -> bool:
    """Whether an LM file with this ``__metadata__`` is an fp8 copy."""
    return metadata.get(FORMAT_KEY) == FP8_FORMAT


def is_fp8_checkpoint(directory: Path) -> bool:
    """Whether ``directory``'s LM file is an fp8 copy (False when it cannot be read: the
    engine then says what is wrong with it)."""
    try:
        return holds_fp8(safetensors_metadata(Path(directory) / LM_FILE))
    except (OSError, ValueError):
        return False
