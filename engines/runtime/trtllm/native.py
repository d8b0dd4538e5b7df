"""The parts of the model that run outside the TensorRT-LLM engine, and their files.

The engine only holds the temporal transformer.  The 17-stream input embedding, the
depformer and Mimi run here, from the native artifacts the converter writes beside the
engine (``engines.runtime.trtllm.layout``).  They reuse the PyTorch model code: a ``MoshiLM`` built
on the meta device gets only its embedding tables and depformer weights, so the 7B temporal
weights are never allocated twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.config import LMConfig
from engines.model.lm import MoshiLM
from engines.model.prefill import PromptPlan

log = logging.getLogger(__name__)

EMBEDDING_KEYS = ("emb", "text_emb")
PREFILL_INDEX = "index.json"


def partial_lm(cfg: LMConfig, depformer_steps: int, tensors: Mapping[str, torch.Tensor]) -> MoshiLM:
    """A ``MoshiLM`` whose temporal weights stay unallocated (meta) and whose other
    parameters are exactly ``tensors`` (embedding tables and/or depformer weights)."""
    with torch.device("meta"):
        lm = MoshiLM(cfg, depformer_steps)
    missing = [k for k in tensors if k not in dict(lm.named_parameters())]
    if missing:
        raise ValueError(f"not MoshiLM parameters: {', '.join(sorted(missing))}")
    lm.load_state_dict(dict(tensors), strict=False, assign=True)
    lm.eval()
    return lm


def read_tensors(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            t = f.get_tensor(key)
            out[key] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    return out


# Prefill files ---------------------------------------------------------------------------------
def persona_digest(persona_tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in persona_tokens]).encode()).hexdigest()[:16]


def prefill_file_name(voice: str, persona_tokens: Sequence[int]) -> str:
    return f"{Path(voice).stem}-{persona_digest(persona_tokens)}.safetensors"


@dataclass(frozen=True)
class StoredPrefill:
    """A system prompt as the TensorRT-LLM backend replays it: one context call over
    ``embeddings`` [N, D], then the token ring restored to the snapshot."""

    embeddings: torch.Tensor
    token_cache: torch.Tensor  # [17, 4] int64
    token_provided: torch.Tensor  # [17, 4] bool
    offset: int

    @property
    def positions(self) -> int:
        return self.embeddings.shape[0]


def stored_prefill(embeddings: torch.Tensor, plan: PromptPlan) -> StoredPrefill:
    return StoredPrefill(embeddings, plan.token_cache.long(), plan.token_provided.bool(), int(plan.offset))


def write_prefill(path: Path, voice: str, persona_tokens: Sequence[int], prefill: StoredPrefill) -> None:
    save_file(
        {"embeddings": prefill.embeddings.contiguous().cpu(), "token_cache": prefill.token_cache.contiguous().cpu(),
         "token_provided": prefill.token_provided.contiguous().cpu()},
        str(path),
        metadata={"voice": voice, "persona_tokens": json.dumps([int(t) for t in persona_tokens]),
                  "offset": str(prefill.offset)},
    )


def read_prefill(path: Path) -> tuple[str, tuple[int, ...], StoredPrefill]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in ("embeddings", "token_cache", "token_provided")}
    prefill = StoredPrefill(tensors["embeddings"], tensors["token_cache"], tensors["token_provided"],
                            int(meta["offset"]))
    return meta["voice"], tuple(json.loads(meta["persona_tokens"])), prefill


def write_prefill_index(directory: Path, entries: list[dict]) -> None:
    (directory / PREFILL_INDEX).write_text(json.dumps(entries, indent=2) + "\n")


def load_prefills(directory: Path) -> dict[tuple[str, tuple[int, ...]], StoredPrefill]:
    """Every prefill listed in ``directory``'s index, keyed by (voice, persona token ids)."""
    index = directory / PREFILL_INDEX
    if not index.is_file():
        return {}
    out = {}
    for entry in json.loads(index.read_text()):
        voice, persona, prefill = read_prefill(directory / entry["file"])
        out[(voice, persona)] = prefill
    log.info("loaded %d stored prefills from %s", len(out), directory)
    return out
