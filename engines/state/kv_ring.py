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
the ring in ring order, which is exactly the reference's computation; longer calls attend
over old ring + new keys and then keep the newest ``capacity`` keys.  (A prefill does not
run here: it has its own ``PromptKV``.)

``kv_cache="fp8"`` stores keys and values as float8 e4m3 with one float32 scale per
(position, head): each head's 128-vector is scaled by its own absolute maximum when written,
so no calibration is needed and one outlier head or token cannot crush the others' precision.
That halves the bytes every decode step reads (the cost that bounds large batches) for
~3 % of scale storage; readers dequantise on the fly.  ``kv_cache="int8"`` is the same with
symmetric int8 values (absmax / 127, ``model.int8``): the same bytes, for GPUs without e4m3
(the A100); the write kernel and the decode kernel serve both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.config import KV_CACHE_MODES, WindowMode, kv_window_bytes
from engines.fastpath.compiled import compile_dynamic
from engines.fastpath import attention as gpu_attention
from engines.fastpath import kv_write
from engines.model.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from engines.model.int8 import dequantize_int8, quantize_int8

# The 8-bit storage kinds: element dtype, quantizer, dequantizer ("auto" stores the compute
# dtype as it is).
SCALED_STORAGE = {
    "fp8": (FP8_DTYPE, quantize_fp8, dequantize_fp8),
    "int8": (torch.int8, quantize_int8, dequantize_int8),
}


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


# Streaming calls of up to this many tokens attend with the GPU decode kernel (one kernel
# row per query); longer ones (prefill chunks) gather the window once instead.
DECODE_MAX_TOKENS = 4

def ring_positions(end: torch.Tensor, size: int) -> torch.Tensor:
    """Position held at each index [B, size] of rings of ``size`` entries that have had
    ``end`` [B] positions written in order (position p at index p % size); -1 where none."""
    idx = torch.arange(size, device=end.device).view(1, -1)
    last = end.view(-1, 1) - 1
    pos = last - torch.remainder(last - idx, size)
    return torch.where(pos >= 0, pos, torch.full_like(pos, -1))


def kv_bytes_per_slot(num_layers: int, num_heads: int, capacity: int, head_dim: int,
                      dtype: torch.dtype, kv_cache: str) -> int:
    """Device bytes one slot's keys + values (+ their scales, for an 8-bit ``kv_cache``) take."""
    return kv_window_bytes(num_layers, num_heads, capacity, head_dim, torch.empty((), dtype=dtype).element_size(),
                           kv_cache)


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
        kv_cache: str = "auto",
    ) -> None:
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_MODES)}, got {kv_cache!r}")
        self.capacity = capacity
        self.dtype = dtype  # what attention computes in and ``export`` returns
        self.kv_cache = kv_cache
        self.scaled = kv_cache in SCALED_STORAGE  # 8-bit values with a scale per (position, head)
        self.fp8 = kv_cache == "fp8"  # its kernels need e4m3 (gpu_arch): not below compute capability 8.9
        store, quantize, dequantize = SCALED_STORAGE.get(kv_cache, (dtype, None, None))
        shape = (num_layers, num_slots, num_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=store)
        self.values = torch.zeros(shape, device=device, dtype=store)
        # Per (layer, slot, head, ring index) scales; empty placeholders keep one code path.
        scale_shape = shape[:-1] if self.scaled else (num_layers, 0)
        self.key_scales = torch.ones(scale_shape, device=device, dtype=torch.float32)
        self.value_scales = torch.ones(scale_shape, device=device, dtype=torch.float32)
        self.length = torch.zeros(num_slots, device=device, dtype=torch.long)
        self._quantize_eager = self._quantize = quantize
        self._dequantize = dequantize
        self._plan: _CallPlan | None = None

    def compile_quantizer(self) -> None:
        """Fuse the 8-bit write path (amax, scale, cast) into one kernel (GPU fast path)."""
        if self.scaled:
            self._quantize = compile_dynamic(self._quantize_eager)

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
        Does not advance ``length``: call ``advance`` once after the last layer.  Every layer
        of one call passes the same ``slots``, ``positions`` and ``lo``: what depends on them
        only is computed at the first layer (``_call_plan``).
        """
        B, H, T, D = k.shape
        plan = self._call_plan(slots, positions, lo, q.device)
        keep = plan.ring_idx.shape[1]
        if plan.rows is not None:
            # Streaming step on a GPU (the LM's 1 token, Mimi's 2): write the keys, then
            # read each slot's window in place instead of gathering it; each query is one
            # row of the kernel.
            if self.scaled and kv_write.available(q.device, D, fp8=self.fp8):  # one kernel for the whole write
                kv_write.write_scaled(k.transpose(1, 2).reshape(B * T, H, D), v.transpose(1, 2).reshape(B * T, H, D),
                                      self.keys[layer], self.values[layer], self.key_scales[layer],
                                      self.value_scales[layer], plan.rows, plan.ring_idx.reshape(-1))
            else:
                self._store(layer, plan.slot_idx, plan.ring_idx, k.transpose(1, 2), v.transpose(1, 2))
            k_scale, v_scale = (self.key_scales[layer], self.value_scales[layer]) if self.scaled else (None, None)
            out = gpu_attention.decode_attention_op(q.transpose(1, 2).reshape(B * T, H, D), self.keys[layer],
                                                    self.values[layer], plan.rows, plan.query_positions,
                                                    plan.query_lo, k_scale, v_scale)
            return out.view(B, T, H, D).transpose(1, 2)
        if T <= self.capacity:
            # Write first, then attend over the ring in ring order, as the reference does.
            self._store(layer, plan.slot_idx, plan.ring_idx, k.transpose(1, 2), v.transpose(1, 2))
            keys, values = self._load(layer, slots)
        else:
            old_keys, old_values = self._load(layer, slots)
            keys = torch.cat([old_keys, k], dim=2)
            values = torch.cat([old_values, v], dim=2)
            # Keep the newest ``capacity`` of the call's keys in the ring.
            self._store(layer, plan.slot_idx, plan.ring_idx, k[:, :, T - keep:].transpose(1, 2),
                        v[:, :, T - keep:].transpose(1, 2))
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), plan.mask)

    def _call_plan(self, slots: torch.Tensor, positions: torch.Tensor, lo: torch.Tensor,
                   device: torch.device) -> "_CallPlan":
        """The ring indices, visibility mask or kernel rows of one call, shared by its layers.
        Recognised by the identity of the call's tensors (each call makes new ``positions``);
        per layer they cost ~4 small kernels, x 32 layers in every tick."""
        plan = self._plan
        if plan is not None and plan.slots is slots and plan.positions is positions and plan.lo is lo:
            return plan
        decode = positions.shape[1] <= DECODE_MAX_TOKENS and gpu_attention.available(device, fp8=self.fp8)
        self._plan = plan = _CallPlan(slots, positions, lo, self.capacity, decode)
        return plan

    def _store(self, layer: int, slot_idx: torch.Tensor, ring_idx: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows ``k, v`` [..., H, D] at (``slot_idx``, ``ring_idx``) [...] of ``layer``."""
        if not self.scaled:
            self.keys[layer][slot_idx, :, ring_idx] = k
            self.values[layer][slot_idx, :, ring_idx] = v
            return
        for data, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            q, scale = self._quantize(x)
            data[layer][slot_idx, :, ring_idx] = q
            scales[layer][slot_idx, :, ring_idx] = scale

    def _load(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole rings [B, H, C, D] of ``slots`` in the compute dtype."""
        if not self.scaled:
            return self.keys[layer][slots], self.values[layer][slots]
        return (self._dequantize(self.keys[layer][slots], self.key_scales[layer][slots], self.dtype),
                self._dequantize(self.values[layer][slots], self.value_scales[layer][slots], self.dtype))

    def export(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, H, end-start, D] of positions ``start..end-1`` of one slot,
        in the compute dtype."""
        idx = torch.remainder(torch.arange(start, end, device=self.length.device), self.capacity)
        keys, values = self.keys[:, slot][:, :, idx], self.values[:, slot][:, :, idx]
        if not self.scaled:
            return keys.clone(), values.clone()
        return (self._dequantize(keys, self.key_scales[:, slot][:, :, idx], self.dtype),
                self._dequantize(values, self.value_scales[:, slot][:, :, idx], self.dtype))

    def install(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write exported positions ``start..`` into ``slot`` and set its length after them."""
        n = keys.shape[2]
        keep = min(n, self.capacity)
        idx = torch.remainder(torch.arange(start + n - keep, start + n, device=self.length.device), self.capacity)
        # A layer at a time: the temporaries (the 8-bit quantisation's) are one layer's, not
        # the whole prompt's, so a join's peak stays what the memory plan reserved for it.
        for layer in range(self.keys.shape[0]):
            for data, scales, x in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
                x = x[layer, :, n - keep:].to(device=data.device, dtype=self.dtype)
                rows = data[layer, slot]
                if self.scaled:
                    q, scale = self._quantize_eager(x)
                    rows[:, idx] = q
                    scales[layer, slot][:, idx] = scale
                else:
                    rows[:, idx] = x
        self.length[slot] = start + n


class _CallPlan:
    """What one ``SlotKVRing.attend`` call's layers share: where the call's newest
    ``capacity`` keys go, and either the GPU kernel's per-query rows (``decode``) or the
    visibility mask of the gather path."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, lo: torch.Tensor, capacity: int,
                 decode: bool) -> None:
        self.slots, self.positions, self.lo = slots, positions, lo  # held: the identity check
        B, T = positions.shape
        C = capacity
        keep = min(T, C)
        self.ring_idx = torch.remainder(positions[:, T - keep:], C)
        self.slot_idx = slots.view(-1, 1).expand(B, keep)
        self.rows = self.query_positions = self.query_lo = self.mask = None
        if decode and T <= C:
            # Ring entries older than the call's first write still hold positions >= end - C
            # only, so no query may reach below that.
            floor = positions[:, -1:] + 1 - C
            self.query_lo = torch.maximum(lo.reshape(B, -1).expand(B, T), floor).reshape(-1)
            self.rows = slots.repeat_interleave(T)
            self.query_positions = positions.reshape(-1)
            return
        if T <= C:
            key_pos = ring_positions(positions[:, -1] + 1, C)  # [B, C]: the ring after the write
        else:
            key_pos = torch.cat([ring_positions(positions[:, 0], C), positions], dim=1)
        kp = key_pos.view(B, 1, -1)
        mask = (kp >= 0) & (kp <= positions.view(B, T, 1)) & (kp >= lo.reshape(B, -1, 1))
        self.mask = mask.unsqueeze(1)
