"""Per-slot ring KV cache with sliding-window causal attention.

One ``SlotKVRing`` holds the keys and values of every layer of one transformer for every
session slot: ``keys[layer, slot, head, ring_index, dim]``.  Position ``p`` of a slot lives
at ring index ``p % capacity``; ``length[slot]`` is the number of positions written so far
(= the absolute position of the next token; it grows without bound, only the window
slides).

Visibility is decided by absolute positions, never by ring order:
a query at position ``p`` sees the keys ``lo(p) <= pos_k <= p`` that are still held.  The
caller chooses ``lo`` (``window_start``): NVIDIA's reference streaming window drops the
oldest ring entry once the ring has wrapped (spec/model.md section 10), upstream Kyutai
moshi keeps the full ``capacity`` keys.

For ``T <= capacity`` new tokens are written into the ring first and attention runs over
the ring in ring order, which is exactly the reference's computation; longer chunks (a long
parallel prefill into a small tiny-model window) attend over old ring + new keys and then
keep the newest ``capacity`` keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu import attention as gpu_attention


class WindowMode:
    """How many past keys a streaming query sees once the ring has wrapped."""

    REFERENCE = "reference"  # NVIDIA's moshi fork: capacity - 1 keys for a 1-token call
    FULL = "full"  # upstream Kyutai moshi 0.2.13: capacity keys
    ALL = (REFERENCE, FULL)


def window_start(positions: torch.Tensor, call_end: torch.Tensor, capacity: int, mode: str) -> torch.Tensor:
    """Lowest visible key position for each query.

    ``positions`` [B, T] are the query positions, ``call_end`` [B, 1] (or [B, T]) the number of
    positions written once the *reference call* holding each query is done (its ``E``).
    """
    if mode == WindowMode.REFERENCE:
        return call_end - capacity + 1
    if mode == WindowMode.FULL:
        return positions - capacity + 1
    raise ValueError(f"unknown window mode {mode!r}")


class SlotKVRing:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.capacity = capacity
        shape = (num_layers, num_slots, num_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = torch.zeros(num_slots, device=device, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return self.length.shape[0]

    def reset(self, slots: torch.Tensor) -> None:
        # Stale keys are harmless: positions >= length are never visible.
        self.length[slots] = 0

    def positions(self, slots: torch.Tensor, steps: int) -> torch.Tensor:
        """Absolute positions [B, steps] of the next ``steps`` tokens of ``slots``."""
        base = self.length[slots].view(-1, 1)
        return base + torch.arange(steps, device=base.device).view(1, -1)

    def advance(self, slots: torch.Tensor, steps: int) -> None:
        self.length[slots] += steps

    def _ring_positions(self, end: torch.Tensor) -> torch.Tensor:
        """Position held at each ring index for slots that have written ``end`` [B] tokens."""
        idx = torch.arange(self.capacity, device=end.device).view(1, -1)
        last = end.view(-1, 1) - 1
        pos = last - torch.remainder(last - idx, self.capacity)
        return torch.where(pos >= 0, pos, torch.full_like(pos, -1))

    def attend(
        self,
        layer: int,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        lo: torch.Tensor,
    ) -> torch.Tensor:
        """Store ``k, v`` [B, H, T, D] at ``positions`` [B, T] and attend with ``q``.

        ``lo`` [B, T] is the lowest visible key position per query (see ``window_start``).
        Does not advance ``length``: call ``advance`` once after the last layer.
        """
        B, H, T, D = k.shape
        C = self.capacity
        lk, lv = self.keys[layer], self.values[layer]
        if T == 1 and gpu_attention.available(q.device):
            # Decode step on a GPU: read each slot's window in place instead of gathering it.
            ring_idx = torch.remainder(positions[:, 0], C)
            lk[slots, :, ring_idx] = k[:, :, 0]
            lv[slots, :, ring_idx] = v[:, :, 0]
            out = gpu_attention.decode_attention(q[:, :, 0], lk, lv, slots, positions[:, 0], lo.reshape(B, -1)[:, 0])
            return out.unsqueeze(2)
        if T <= C:
            ring_idx = torch.remainder(positions, C)  # [B, T]
            slot_idx = slots.view(-1, 1).expand(B, T)
            lk[slot_idx, :, ring_idx] = k.transpose(1, 2)
            lv[slot_idx, :, ring_idx] = v.transpose(1, 2)
            keys, values = lk[slots], lv[slots]
            key_pos = self._ring_positions(positions[:, -1] + 1)  # [B, C]
        else:
            old_pos = self._ring_positions(positions[:, 0])
            keys = torch.cat([lk[slots], k], dim=2)
            values = torch.cat([lv[slots], v], dim=2)
            key_pos = torch.cat([old_pos, positions], dim=1)
            keep = positions[:, -C:]
            ring_idx = torch.remainder(keep, C)
            slot_idx = slots.view(-1, 1).expand(B, C)
            lk[slot_idx, :, ring_idx] = k[:, :, -C:].transpose(1, 2)
            lv[slot_idx, :, ring_idx] = v[:, :, -C:].transpose(1, 2)
        qp = positions.view(B, T, 1)
        kp = key_pos.view(B, 1, -1)
        mask = (kp >= 0) & (kp <= qp) & (kp >= lo.reshape(B, -1, 1))
        return F.scaled_dot_product_attention(q, keys, values, mask.unsqueeze(1))

    def export(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, H, end-start, D] of positions ``start..end-1`` of one slot."""
        idx = torch.remainder(torch.arange(start, end, device=self.length.device), self.capacity)
        return self.keys[:, slot][:, :, idx].clone(), self.values[:, slot][:, :, idx].clone()

    def install(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write exported positions ``start..`` into ``slot`` and set its length after them."""
        n = keys.shape[2]
        keep = min(n, self.capacity)
        idx = torch.remainder(torch.arange(start + n - keep, start + n, device=self.length.device), self.capacity)
        ks = self.keys[:, slot]
        vs = self.values[:, slot]
        ks[:, :, idx] = keys[:, :, n - keep:].to(ks.dtype)
        vs[:, :, idx] = values[:, :, n - keep:].to(vs.dtype)
        self.length[slot] = start + n
