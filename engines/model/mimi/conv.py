"""Causal convolutions with per-slot streaming state.

Each layer owns its weights and the streaming state of every session slot
(``[num_slots, ...]``, allocated once).  ``forward(x, slots)`` gathers the state of
``slots``, computes the batch with batch-invariant kernels and scatters the new state
back; ``slots=None`` runs the layer non-streaming, i.e. from a fresh state over the whole
input with PyTorch's default kernels, without touching any slot: exactly what moshi's
non-streaming path computes.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.model.mimi import ops
from engines.model.mimi.checkpoint import CheckpointTensors, copy_into


def _frozen(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype), requires_grad=False)


def _load_weight_and_bias(layer: nn.Module, ckpt: CheckpointTensors, prefix: str) -> None:
    copy_into(layer.weight, ckpt.take(prefix + ".weight", layer.weight.shape))
    if layer.bias is not None:
        copy_into(layer.bias, ckpt.take(prefix + ".bias", layer.bias.shape))


class SlotConv1d(nn.Module):
    """Causal Conv1d that keeps the last ``(k-1)*d+1-s`` input samples of each slot.

    ``replicate_pad`` makes a fresh slot's left context a copy of its first input sample
    instead of zeros (Mimi's 25 -> 12.5 Hz downsample conv).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, num_slots: int, *,
                 stride: int = 1, dilation: int = 1, groups: int = 1, bias: bool = True,
                 replicate_pad: bool = False, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self.context = (kernel_size - 1) * dilation + 1 - stride
        if self.context < 0:
            raise ValueError(f"kernel {kernel_size} (dilation {dilation}) shorter than stride {stride}")
        self.replicate_pad = replicate_pad
        self.weight = _frozen((out_channels, in_channels // groups, kernel_size), device, dtype)
        self.bias = _frozen((out_channels,), device, dtype) if bias else None
        self.register_buffer("history", torch.zeros(num_slots, in_channels, self.context, device=device, dtype=dtype),
                             persistent=False)
        # True while a slot has not consumed any input yet (only used with replicate_pad).
        self.register_buffer("fresh", torch.ones(num_slots, device=device, dtype=torch.bool), persistent=False)

    def load(self, ckpt: CheckpointTensors, prefix: str) -> None:
        _load_weight_and_bias(self, ckpt, prefix)

    def reset(self, slots: torch.Tensor) -> None:
        self.history[slots] = 0
        self.fresh[slots] = True

    def _left_context(self, x: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        B, C, _ = x.shape
        first = x[..., :1].expand(B, C, self.context)
        if slots is None:
            return first if self.replicate_pad else x.new_zeros(B, C, self.context)
        history = self.history[slots]
        if self.replicate_pad:
            history = torch.where(self.fresh[slots].view(-1, 1, 1), first, history)
        return history

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] % self.stride:
            raise ValueError(f"input length {x.shape[-1]} is not a multiple of the stride {self.stride}")
        if self.context:
            x = torch.cat([self._left_context(x, slots), x], dim=-1)
            if slots is not None:
                self.history[slots] = x[..., -self.context:]
                self.fresh.index_fill_(0, slots, False)  # no host tensor: CUDA-graph safe
        return ops.conv1d(x, self.weight, self.bias, self.stride, self.dilation, self.groups,
                          batch_invariant=slots is not None)


class SlotConvTranspose1d(nn.Module):
    """Causal ConvTranspose1d that carries its last ``k-s`` outputs (minus bias) per slot.

    The carried tail overlaps the first ``k-s`` outputs of the next call, so streaming
    output equals a whole-signal transposed conv trimmed by ``k-s`` on the right.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, num_slots: int, *,
                 groups: int = 1, bias: bool = True, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.stride, self.groups = stride, groups
        self.tail = kernel_size - stride
        if self.tail < 0:
            raise ValueError(f"kernel {kernel_size} shorter than stride {stride}")
        self.weight = _frozen((in_channels, out_channels // groups, kernel_size), device, dtype)
        self.bias = _frozen((out_channels,), device, dtype) if bias else None
        self.register_buffer("partial", torch.zeros(num_slots, out_channels, self.tail, device=device, dtype=dtype),
                             persistent=False)

    def load(self, ckpt: CheckpointTensors, prefix: str) -> None:
        _load_weight_and_bias(self, ckpt, prefix)

    def reset(self, slots: torch.Tensor) -> None:
        self.partial[slots] = 0

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        y = ops.conv_transpose1d(x, self.weight, self.bias, self.stride, self.groups, batch_invariant=slots is not None)
        if not self.tail:
            return y
        if slots is not None:
            y[..., :self.tail] += self.partial[slots]
            # The bias is added again by the next call's own output, so keep the tail without it.
            carried = y[..., -self.tail:]
            if self.bias is not None:
                carried = carried - self.bias[:, None]
            self.partial[slots] = carried
        return y[..., :-self.tail]
