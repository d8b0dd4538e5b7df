"""Slot bookkeeping for the engine's paged KV cache (pure Python/CPU).

Sessions do not come and go inside TensorRT-LLM: we own the KV pool and give every slot a
fixed run of ``ceil(window / tokens_per_block)`` blocks at start-up (static allocation, no
block manager at run time).  The attention plugin uses a sequence's blocks as a ring of
``window`` positions once the sequence is longer than the window (cyclic KV), so a slot
never needs more.  Positions keep growing (RoPE uses absolute positions); only
``max_positions`` (the engine's RoPE table) bounds a call.

Block offsets use TensorRT-LLM's pool layout ``[num_blocks, num_layers, 2, heads,
tokens_per_block, head_dim]``: the K half of block ``b`` is at offset ``b * num_layers * 2``
and its V half at ``+ 1`` (tensorrt_llm/runtime/kv_cache_manager.py,
``get_k_or_v_block_offset``); the plugin adds the layer from ``host_kv_cache_pool_mapping``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def blocks_per_slot(window: int, tokens_per_block: int) -> int:
    """KV blocks that hold ``window`` positions: ``ceil(window / tokens_per_block)``."""
    return -(-window // tokens_per_block)


class SlotKVBlocks:
    def __init__(self, num_slots: int, window: int, tokens_per_block: int, num_layers: int) -> None:
        if num_slots < 1 or window < 1 or tokens_per_block < 1 or num_layers < 1:
            raise ValueError("slots, window, tokens_per_block and num_layers must be >= 1")
        self.num_slots = num_slots
        self.window = window
        self.tokens_per_block = tokens_per_block
        self.num_layers = num_layers
        self.blocks_per_slot = blocks_per_slot(window, tokens_per_block)
        blocks = torch.arange(num_slots * self.blocks_per_slot, dtype=torch.int32).view(num_slots, self.blocks_per_slot)
        k = blocks * (2 * num_layers)
        self._table = torch.stack([k, k + 1], dim=1)  # [slots, 2 (K, V), blocks_per_slot]

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.blocks_per_slot

    def offsets(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``kv_cache_block_offsets`` for a call over ``slots``: [1 pool, B, 2, blocks_per_slot]."""
        index = slot_index(slots)
        outside = (index < 0) | (index >= self.num_slots)
        if outside.any():
            raise ValueError(f"slots {index[outside].tolist()} outside [0, {self.num_slots})")
        return self._table[index].unsqueeze(0)  # a gather: a new, contiguous tensor


def slot_index(slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``slots`` as a host int64 index tensor (as is if it already is one)."""
    return torch.as_tensor(slots, dtype=torch.int64)


class SlotPositions:
    """How many positions each slot's sequence holds, and its context (prefill) length: one
    int32 entry per slot, read and advanced for a call's slots at once."""

    def __init__(self, num_slots: int, max_positions: int) -> None:
        self.max_positions = max_positions
        self.length = torch.zeros(num_slots, dtype=torch.int32)
        self.context = torch.zeros(num_slots, dtype=torch.int32)

    def start(self, slot: int, positions: int) -> None:
        if positions > self.max_positions:
            raise ValueError(f"{positions} positions exceed the engine's {self.max_positions}")
        self.length[slot] = positions
        self.context[slot] = positions

    def full(self, slots: Sequence[int] | torch.Tensor) -> list[int]:
        """The slots of ``slots`` (in their order) with no position left for another step."""
        index = slot_index(slots)
        return index[self.length[index] >= self.max_positions].tolist()

    def advance(self, slots: Sequence[int] | torch.Tensor) -> None:
        """One more position for each of ``slots`` (a slot listed twice advances twice)."""
        index = slot_index(slots)
        self.length.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))

    def reset(self, slot: int) -> None:
        self.length[slot] = 0
        self.context[slot] = 0
