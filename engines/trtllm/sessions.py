"""Which engine slots are open, for which session, and what a valid step call is.

Plain bookkeeping of the engine interface's contract (engines/interface.py): slots are
handed out lowest first, a closed slot is reusable at once, a step names each open slot at
most once with one 80 ms frame per slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import FRAME_SAMPLES
from ..interface import NoFreeSlot, SessionSpec


class SessionSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._specs: dict[int, SessionSpec] = {}
        self._free = list(range(num_slots))

    def free(self) -> int:
        return len(self._free)

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
