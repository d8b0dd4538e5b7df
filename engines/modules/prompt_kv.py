"""The keys and values of one system prompt while its prefill runs, possibly in pieces.

A prefill is one causal pass of the temporal transformer over a prompt, starting from an
empty cache.  Done in one go, a long prompt holds the engine thread (and every live tick)
for as long as the whole pass takes; done in chunks, each chunk's queries must see exactly
the keys the one pass would have shown them.  ``SlotKVRing`` cannot give that once a prompt
is longer than its window: a chunk's writes land on ring entries its own first queries still
need.  ``PromptKV`` is a ring large enough that they never do (window + chunk - 1 positions,
or the whole prompt when that is shorter), kept in the compute dtype even when the session
cache stores fp8, so a chunked pass computes what the one pass computes.

It offers what ``MoshiLM.temporal`` uses of a cache (``capacity``, ``positions``, ``attend``,
``advance``) for a single sequence; ``capacity`` is the session window, which is what decides
the keys a query may see.  Positions and sizes are Python integers, so a pass over it can be
captured in a CUDA graph (``engines.gpu.prefill_graphs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PromptKV:
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, *, window: int, prompt: int, chunk: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if window < 1 or prompt < 1 or chunk < 1:
            raise ValueError(f"window, prompt and chunk must be >= 1, got {window}, {prompt}, {chunk}")
        self.capacity = window
        # A chunk of ``chunk`` queries starting at s needs keys s - window + 1 .. s + chunk - 1.
        self.size = min(prompt, window + chunk - 1)
        shape = (num_layers, 1, num_heads, self.size, head_dim)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.device = torch.device(device)
        self.written = 0  # positions stored so far (the next query's position)

    def positions(self, slots: torch.Tensor, steps: int) -> torch.Tensor:
        """Positions [1, steps] of the next ``steps`` queries (``slots`` is ignored: one sequence)."""
        return torch.arange(self.written, self.written + steps, device=self.device).view(1, -1)

    def advance(self, slots: torch.Tensor, steps: int) -> None:
        self.written += steps

    def attend(self, layer: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        """Store ``k, v`` [1, H, T, D] of the next T positions, then attend with ``q`` over every
        stored key from ``lo`` [1, T] (lowest visible position per query) to the query's own."""
        T = k.shape[2]
        start, end = self.written, self.written + T
        if T > self.size - min(self.capacity - 1, start):
            raise ValueError(f"a call of {T} positions after {start} does not fit a prompt cache of {self.size}")
        if end <= self.size:
            self.keys[layer, 0, :, start:end] = k[0]
            self.values[layer, 0, :, start:end] = v[0]
        else:
            index = torch.arange(start, end, device=self.device) % self.size
            self.keys[layer, 0][:, index] = k[0]
            self.values[layer, 0][:, index] = v[0]
        first = max(0, start - self.capacity + 1)  # the lowest key any query of this call may see
        if end <= self.size:  # not wrapped: the visible keys are one slice, in position order
            keys, values = self.keys[layer, :, :, first:end], self.values[layer, :, :, first:end]
            key_pos = torch.arange(first, end, device=self.device)
        else:  # every entry holds one of the newest ``size`` positions: mask by position
            keys, values = self.keys[layer], self.values[layer]
            last = end - 1
            key_pos = last - torch.remainder(last - torch.arange(self.size, device=self.device), self.size)
        qp = positions.view(1, T, 1)
        kp = key_pos.view(1, 1, -1)
        mask = (kp <= qp) & (kp >= lo.reshape(1, -1, 1))
        return F.scaled_dot_product_attention(q, keys, values, mask.unsqueeze(1))

    def export(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, H, end-start, D] of positions ``start..end-1`` (still held)."""
        if not (max(0, self.written - self.size) <= start <= end <= self.written):
            raise ValueError(f"positions {start}..{end} are not held (written {self.written}, size {self.size})")
        index = torch.arange(start, end, device=self.device) % self.size
        return self.keys[:, 0][:, :, index], self.values[:, 0][:, :, index]
