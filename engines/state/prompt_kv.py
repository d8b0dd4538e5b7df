"""The keys and values of one system prompt while its prefill runs, possibly in pieces.

A prefill is one causal pass of the temporal transformer over a prompt, starting from an
empty cache.  Done in one go, a long prompt holds the engine thread (and every live tick)
for as long as the whole pass takes; done in chunks, each chunk's queries must see exactly
the keys the one pass would have shown them.  ``SlotKVRing`` cannot give that once a prompt
is longer than its window: a chunk's writes land on ring entries its own first queries still
need.  ``PromptKV`` is a ring large enough that they never do (window + chunk - 1 positions,
or the whole prompt when that is shorter), kept in the compute dtype even when the session
cache stores 8 bits (fp8, int8: ``SlotKVRing.install`` quantizes what it installs), so a
chunked pass computes what the one pass computes.

It offers what ``MoshiLM.temporal`` uses of a cache (``capacity``, ``positions``, ``attend``,
``advance``) for a single sequence; ``capacity`` is the session window, which decides the
keys a query may see.  The next position is a device tensor and attention always spans the
whole ring (entries not holding a visible position are masked), so a piece has the same
shapes whatever its place in the prompt: one CUDA graph replays every piece
(``engines.fastpath.prefill_graphs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.state.kv_ring import ring_positions


class PromptKV:
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, *, window: int, size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if window < 1 or size < 1:
            raise ValueError(f"window and size must be >= 1, got {window}, {size}")
        self.capacity = window
        self.size = size
        shape = (num_layers, 1, num_heads, size, head_dim)
        # Zeros, not empty: entries no query may see are masked, and a masked NaN would still
        # poison the weighted sum of values.
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.device = torch.device(device)
        self.start = torch.zeros(1, device=device, dtype=torch.long)  # the next position, on the device
        self.written = 0  # the same, on the host (kept by whoever advances it outside a graph)

    @staticmethod
    def size_for(window: int, prompt: int, chunk: int) -> int:
        """Ring positions a pass over ``prompt`` positions in pieces of ``chunk`` needs: a
        piece starting at s reads keys s - window + 1 .. s + chunk - 1."""
        return min(prompt, window + chunk - 1)

    def reset(self) -> None:
        self.start.zero_()
        self.written = 0

    def positions(self, slots: torch.Tensor, steps: int) -> torch.Tensor:
        """Positions [1, steps] of the next ``steps`` queries (``slots`` is ignored: one sequence)."""
        return (self.start + torch.arange(steps, device=self.device)).view(1, -1)

    def advance(self, slots: torch.Tensor, steps: int) -> None:
        self.start += steps
        self.written += steps

    def attend(self, layer: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        """Store ``k, v`` [1, H, T, D] at ``positions`` [1, T], then attend with ``q`` over every
        stored key from ``lo`` [1, T] (lowest visible position per query) to the query's own."""
        T = k.shape[2]
        if T > self.size - min(self.capacity - 1, self.written):
            raise ValueError(f"a call of {T} positions after {self.written} does not fit a prompt cache of "
                             f"{self.size}")
        index = torch.remainder(positions[0], self.size)
        self.keys[layer, 0].index_copy_(1, index, k[0])
        self.values[layer, 0].index_copy_(1, index, v[0])
        key_pos = ring_positions(positions[0, -1:] + 1, self.size).view(1, 1, -1)  # -1: never written
        mask = (key_pos >= 0) & (key_pos <= positions.view(1, T, 1)) & (key_pos >= lo.reshape(1, -1, 1))
        return F.scaled_dot_product_attention(q, self.keys[layer], self.values[layer], mask.unsqueeze(1))

    def export(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, H, end-start, D] of positions ``start..end-1`` (still held)."""
        if not (max(0, self.written - self.size) <= start <= end <= self.written):
            raise ValueError(f"positions {start}..{end} are not held (written {self.written}, size {self.size})")
        index = torch.remainder(torch.arange(start, end, device=self.device), self.size)
        return self.keys[:, 0][:, :, index], self.values[:, 0][:, :, index]
