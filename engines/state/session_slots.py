"""Per-slot state every backend keeps outside its model: which slots are open for which
session (``SessionSlots``), and each slot's sampling settings and random stream
(``SlotSampling``, tensors gathered per tick).

``SessionSlots`` is the engine interface's contract as plain bookkeeping (engines/interface.py):
slots are handed out lowest first, a closed slot is reusable at once, a step names each open
slot at most once with one 80 ms frame per slot.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

from engines.config import FRAME_SAMPLES
from engines.interface import NoFreeSlot, SessionSpec
from engines.model.sampling import STATIC_TOP_K, SamplingBatch, exponential_noise, sample_tokens


class SessionSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._specs: dict[int, SessionSpec] = {}
        self._free = list(range(num_slots))

    def free(self) -> int:
        return len(self._free)

    def open(self) -> list[int]:
        return sorted(self._specs)

    def reserve(self) -> int:
        """The lowest free slot, taken until ``bind`` or ``cancel``."""
        if not self._free:
            raise NoFreeSlot(f"all {self.num_slots} session slots are in use")
        return self._free.pop(0)

    def bind(self, slot: int, spec: SessionSpec) -> None:
        self._specs[slot] = spec

    def cancel(self, slot: int) -> None:
        """Give back a reserved slot whose set-up failed."""
        self._free.append(slot)
        self._free.sort()

    def release(self, slot: int) -> None:
        self.spec(slot)
        del self._specs[slot]
        self.cancel(slot)

    def is_open(self, slot: int) -> bool:
        return slot in self._specs

    def spec(self, slot: int) -> SessionSpec:
        spec = self._specs.get(slot)
        if spec is None:
            raise ValueError(f"slot {slot} is not open")
        return spec

    def check_step(self, slots: Sequence[int], pcm: np.ndarray) -> np.ndarray:
        """``pcm`` as float32 [len(slots), 1920], or ValueError for a malformed step call."""
        pcm = np.asarray(pcm, dtype=np.float32)
        if pcm.shape != (len(slots), FRAME_SAMPLES):
            raise ValueError(f"pcm must have shape ({len(slots)}, {FRAME_SAMPLES}), got {pcm.shape}")
        if len(set(slots)) != len(slots):
            raise ValueError("a slot may appear only once per step")
        for s in slots:
            self.spec(s)
        return pcm


class SlotSampling:
    """Per-slot sampling settings and RNG state as tensors (gathered per tick)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        f32 = dict(device=device, dtype=torch.float32)
        i64 = dict(device=device, dtype=torch.long)
        self.temp_text = torch.zeros(num_slots, **f32)
        self.temp_audio = torch.zeros(num_slots, **f32)
        self.topk_text = torch.ones(num_slots, **i64)
        self.topk_audio = torch.ones(num_slots, **i64)
        self.greedy = torch.ones(num_slots, device=device, dtype=torch.bool)
        # On the host too: whether every stream of a slot is greedy (its flag, or both
        # temperatures <= 0) picks a tick that only takes argmaxes, with no device read.
        self.greedy_host = np.ones(num_slots, dtype=bool)
        self.seed = torch.zeros(num_slots, **i64)
        self.counter = torch.zeros(num_slots, **i64)

    def set(self, slot: int, spec: SessionSpec) -> None:
        s = spec.sampling
        self.temp_text[slot] = s.temp_text
        self.temp_audio[slot] = s.temp_audio
        # Wider top-k than the graphs' static width samples from that width (see sampling).
        self.topk_text[slot] = min(s.topk_text, STATIC_TOP_K)
        self.topk_audio[slot] = min(s.topk_audio, STATIC_TOP_K)
        self.greedy[slot] = s.greedy
        self.greedy_host[slot] = s.greedy or (s.temp_text <= 0 and s.temp_audio <= 0)
        seed = spec.seed if spec.seed is not None else secrets.randbits(62)
        self.seed[slot] = int(seed) & ((1 << 63) - 1)
        self.counter[slot] = 0

    def all_greedy(self, slots: Sequence[int]) -> bool:
        """Whether every stream of every one of ``slots`` is greedy (host state only)."""
        return bool(self.greedy_host[np.asarray(slots, dtype=np.int64)].all())

    def batch(self, slots: torch.Tensor, text: bool) -> SamplingBatch:
        """The settings of ``slots`` for a text (``text``) or audio stream."""
        return SamplingBatch(
            temperature=(self.temp_text if text else self.temp_audio)[slots],
            top_k=(self.topk_text if text else self.topk_audio)[slots],
            greedy=self.greedy[slots],
        )

    def sample(self, slots: torch.Tensor, stream: int, logits: torch.Tensor, text: bool) -> torch.Tensor:
        """Draw ``stream``'s tokens for ``slots`` with data-dependent shapes (no graph capture):
        the noise is only drawn when some slot samples."""
        batch = self.batch(slots, text)
        noise = None
        if not bool(batch.greedy.all()):
            noise = exponential_noise(self.seed[slots], self.counter[slots], stream, logits.shape[-1])
        return sample_tokens(logits, batch, noise)
