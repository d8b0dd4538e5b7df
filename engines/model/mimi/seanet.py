"""SEANet encoder/decoder of Mimi (causal convs, ELU, identity-skip residual blocks).

Layers are numbered like the ``model.{i}`` entries of the official checkpoint (ELUs take
an index too), so each layer knows its own checkpoint prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.fastpath.compiled import compile_dynamic
from engines.config import SeanetConfig
from engines.model.mimi.checkpoint import CheckpointTensors
from engines.model.mimi.conv import SlotConv1d, SlotConvTranspose1d


class ResidualBlock(nn.Module):
    """``x + conv1x1(elu(conv_k(elu(x))))`` with a ``compress``-times narrower hidden width."""

    def __init__(self, dim: int, cfg: SeanetConfig, dilation: int, num_slots: int, device, dtype) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        self.conv_in = SlotConv1d(dim, hidden, cfg.residual_kernel_size, num_slots, dilation=dilation,
                                  device=device, dtype=dtype)
        self.conv_out = SlotConv1d(hidden, dim, 1, num_slots, device=device, dtype=dtype)

    def load(self, ckpt: CheckpointTensors, prefix: str) -> None:
        self.conv_in.load(ckpt, prefix + ".block.1.conv.conv")
        self.conv_out.load(ckpt, prefix + ".block.3.conv.conv")

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        return x + self.conv_out(F.elu(self.conv_in(F.elu(x), slots)), slots)


class _Stack(nn.Module):
    """An ordered list of slot-stateful layers, each optionally preceded by an ELU."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.layers = nn.ModuleList()
        self.elu_first: list[bool] = []
        self.ckpt_index: list[int] = []
        self._next_index = 0
        self._streaming = self._run

    def compile_streaming(self) -> None:
        """Compile the streaming pass (GPU fast path; see ``MimiCodec.compile_steps``)."""
        self._streaming = compile_dynamic(self._run)

    def _add(self, layer: nn.Module, elu_first: bool = False) -> None:
        if elu_first:
            self._next_index += 1  # the ELU occupies its own model.{i} index
        self.layers.append(layer)
        self.elu_first.append(elu_first)
        self.ckpt_index.append(self._next_index)
        self._next_index += 1

    def load(self, ckpt: CheckpointTensors) -> None:
        for layer, index in zip(self.layers, self.ckpt_index):
            prefix = f"{self.root}.model.{index}"
            if isinstance(layer, SlotConv1d):
                layer.load(ckpt, prefix + ".conv.conv")
            elif isinstance(layer, SlotConvTranspose1d):
                layer.load(ckpt, prefix + ".convtr.convtr")
            else:
                layer.load(ckpt, prefix)

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(x) if slots is None else self._streaming(x, slots)

    def _run(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        for layer, elu_first in zip(self.layers, self.elu_first):
            x = layer(F.elu(x) if elu_first else x, slots)
        return x


class SeanetEncoder(_Stack):
    """[B, channels, T] audio -> [B, dimension, T / hop] latents."""

    def __init__(self, cfg: SeanetConfig, num_slots: int, device=None, dtype=torch.float32) -> None:
        super().__init__("encoder")
        kw = dict(device=device, dtype=dtype)
        width = cfg.n_filters
        self._add(SlotConv1d(cfg.channels, width, cfg.kernel_size, num_slots, **kw))
        for ratio in reversed(cfg.ratios):  # the config lists the decoder's (upsampling) order
            for j in range(cfg.n_residual_layers):
                self._add(ResidualBlock(width, cfg, cfg.dilation_base ** j, num_slots, **kw))
            self._add(SlotConv1d(width, 2 * width, 2 * ratio, num_slots, stride=ratio, **kw), elu_first=True)
            width *= 2
        self._add(SlotConv1d(width, cfg.dimension, cfg.last_kernel_size, num_slots, **kw), elu_first=True)


class SeanetDecoder(_Stack):
    """[B, dimension, F] latents -> [B, channels, F * hop] audio."""

    def __init__(self, cfg: SeanetConfig, num_slots: int, device=None, dtype=torch.float32) -> None:
        super().__init__("decoder")
        kw = dict(device=device, dtype=dtype)
        width = cfg.n_filters * 2 ** len(cfg.ratios)
        self._add(SlotConv1d(cfg.dimension, width, cfg.kernel_size, num_slots, **kw))
        for ratio in cfg.ratios:
            self._add(SlotConvTranspose1d(width, width // 2, 2 * ratio, ratio, num_slots, **kw), elu_first=True)
            width //= 2
            for j in range(cfg.n_residual_layers):
                self._add(ResidualBlock(width, cfg, cfg.dilation_base ** j, num_slots, **kw))
        self._add(SlotConv1d(width, cfg.channels, cfg.last_kernel_size, num_slots, **kw), elu_first=True)
