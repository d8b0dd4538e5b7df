"""Pure-function versions of Mimi's streaming layers, for tracing into ONNX.

Each ``*Step`` module takes the weights of one layer of a ``MimiCodec`` (conv weights
shared, linear weights stored transposed) and computes what that layer's slot-streaming
``forward`` computes for one frame, but reads its streaming state from a ``StateIO`` and
gives the new state back instead of indexing per-slot buffers.  They use plain kernels
(``F.conv1d``, ``matmul``): the codec's batch-invariant CPU kernels (``ops.linear`` expands
each weight over the batch for a ``bmm``) would export as per-call weight copies.

State names are the codec's own buffer names (``encoder.layers.0.history``, ...), so a
graph state can be compared with ``MimiCodec.slot_state`` directly; transformers add
``<root>.keys``, ``<root>.values`` and ``<root>.position``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.mimi.conv import SlotConv1d, SlotConvTranspose1d
from engines.model.mimi.quantizer import SplitQuantizer
from engines.model.mimi.seanet import ResidualBlock
from engines.model.mimi.transformer import LAYER_NORM_EPS, MimiTransformer
from engines.state.kv_ring import window_start
from engines.model.rope import rope_tables, rotate
from engines.export.onnx.state import GraphTensor, StateIO


def _borrow(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Register ``tensor`` as a non-persistent buffer of ``module``: shared storage on CPU.

    Export traces on CPU; a codec on another device is copied, never moved.
    """
    module.register_buffer(name, None if tensor is None else tensor.detach().to("cpu"), persistent=False)


def _borrow_matmul_weight(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    """Register a Linear weight [out, in] as the matmul right-hand side [in, out] (a copy).

    Exported as an initializer in that layout, the graph needs no Transpose of weights.
    """
    module.register_buffer(name, weight.detach().to("cpu").t().contiguous(), persistent=False)


class ConvStep(nn.Module):
    """``SlotConv1d`` for one frame: its last ``context`` input samples are the state."""

    def __init__(self, conv: SlotConv1d, name: str) -> None:
        super().__init__()
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.context, self.replicate_pad = conv.context, conv.replicate_pad
        _borrow(self, "weight", conv.weight)
        _borrow(self, "bias", conv.bias)
        self.state = GraphTensor(f"{name}.history", (conv.history.shape[1], conv.context), conv.history.dtype)

    def states(self) -> list[GraphTensor]:
        return [self.state] if self.context else []

    def forward(self, x: torch.Tensor, io: StateIO, fresh: torch.Tensor | None = None) -> torch.Tensor:
        """``fresh`` [B] bool marks sessions whose stream starts with this frame (replicate pad)."""
        if self.context:
            history = io.take(self.state.name)
            if self.replicate_pad:
                first = x[..., :1].expand(-1, -1, self.context)
                history = torch.where(fresh.view(-1, 1, 1), first, history)
            x = torch.cat([history, x], dim=-1)
            io.give(self.state.name, x[..., -self.context:])
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class ConvTransposeStep(nn.Module):
    """``SlotConvTranspose1d`` for one frame: its overlap-add tail (without bias) is the state."""

    def __init__(self, conv: SlotConvTranspose1d, name: str) -> None:
        super().__init__()
        self.stride, self.groups, self.tail = conv.stride, conv.groups, conv.tail
        _borrow(self, "weight", conv.weight)
        _borrow(self, "bias", conv.bias)
        self.state = GraphTensor(f"{name}.partial", (conv.partial.shape[1], conv.tail), conv.partial.dtype)

    def states(self) -> list[GraphTensor]:
        return [self.state] if self.tail else []

    def forward(self, x: torch.Tensor, io: StateIO) -> torch.Tensor:
        y = F.conv_transpose1d(x, self.weight, self.bias, self.stride, groups=self.groups)
        if not self.tail:
            return y
        y = torch.cat([y[..., :self.tail] + io.take(self.state.name), y[..., self.tail:]], dim=-1)
        carried = y[..., -self.tail:]
        if self.bias is not None:
            carried = carried - self.bias[:, None]  # the next frame's own output adds it again
        io.give(self.state.name, carried)
        return y[..., :-self.tail]


class ResidualStep(nn.Module):
    def __init__(self, block: ResidualBlock, name: str) -> None:
        super().__init__()
        self.conv_in = ConvStep(block.conv_in, f"{name}.conv_in")
        self.conv_out = ConvStep(block.conv_out, f"{name}.conv_out")

    def states(self) -> list[GraphTensor]:
        return self.conv_in.states() + self.conv_out.states()

    def forward(self, x: torch.Tensor, io: StateIO) -> torch.Tensor:
        return x + self.conv_out(F.elu(self.conv_in(F.elu(x), io)), io)


class SeanetStep(nn.Module):
    """A SEANet encoder or decoder stack (``engines.model.mimi.seanet._Stack``) for one frame."""

    def __init__(self, stack: nn.Module, name: str) -> None:
        super().__init__()
        steps = {SlotConv1d: ConvStep, SlotConvTranspose1d: ConvTransposeStep, ResidualBlock: ResidualStep}
        self.layers = nn.ModuleList(steps[type(layer)](layer, f"{name}.layers.{i}")
                                    for i, layer in enumerate(stack.layers))
        self.elu_first = list(stack.elu_first)

    def states(self) -> list[GraphTensor]:
        return [s for layer in self.layers for s in layer.states()]

    def forward(self, x: torch.Tensor, io: StateIO) -> torch.Tensor:
        for layer, elu_first in zip(self.layers, self.elu_first):
            x = layer(F.elu(x) if elu_first else x, io)
        return x


class TransformerStep(nn.Module):
    """``MimiTransformer.step`` with the KV ring replaced by a fixed-size shift buffer.

    State per session: ``keys``/``values`` [layers, heads, context, head_dim] holding the
    last ``context`` positions in position order (oldest first), and ``position`` (int64,
    positions written so far).  A call of T steps appends T keys and drops the oldest T,
    so the buffer holds exactly what the codec's ring holds after its write; visibility
    comes from positions alone (``window_start``), as in ``SlotKVRing.attend``.  Static
    shapes, no modulo and no scatter: only slices, concats and a mask.
    """

    def __init__(self, transformer: MimiTransformer, name: str) -> None:
        super().__init__()
        first = transformer.layers[0]
        self.window, self.context = transformer.window, transformer.context
        self.num_heads, self.max_period = first.num_heads, first.max_period
        d_model = first.in_proj.shape[1]
        self.head_dim = d_model // self.num_heads
        self.layers = nn.ModuleList()
        for layer in transformer.layers:
            holder = nn.Module()
            for attr in ("in_proj", "out_proj", "linear1", "linear2"):
                _borrow_matmul_weight(holder, attr, getattr(layer, attr))
            for attr in ("norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias", "layer_scale_1", "layer_scale_2"):
                _borrow(holder, attr, getattr(layer, attr))
            self.layers.append(holder)
        kv_shape = (len(transformer.layers), self.num_heads, self.context, self.head_dim)
        dtype = first.in_proj.dtype
        self.keys = GraphTensor(f"{name}.keys", kv_shape, dtype)
        self.values = GraphTensor(f"{name}.values", kv_shape, dtype)
        self.position = GraphTensor(f"{name}.position", (), torch.int64)

    def states(self) -> list[GraphTensor]:
        return [self.keys, self.values, self.position]

    def forward(self, x: torch.Tensor, io: StateIO) -> torch.Tensor:
        """x [B, T, d_model], T <= context."""
        B, T, D = x.shape
        H, Dh, C = self.num_heads, self.head_dim, self.context
        position = io.take(self.position.name).view(B, 1)
        q_pos = position + torch.arange(T, device=x.device).view(1, T)  # [B, T]
        k_pos = position + torch.arange(T - C, T, device=x.device).view(1, C)  # [B, C] after the write
        lo = window_start(q_pos, position + T, C, self.window)
        visible = (k_pos.view(B, 1, C) >= 0) & (k_pos.view(B, 1, C) <= q_pos.view(B, T, 1)) \
            & (k_pos.view(B, 1, C) >= lo.view(B, -1, 1))
        mask = visible.view(B, 1, T, C)
        rope = rope_tables(q_pos, Dh, self.max_period)
        keys_in, values_in = io.take(self.keys.name), io.take(self.values.name)
        new_keys, new_values = [], []
        for i, w in enumerate(self.layers):
            h = F.layer_norm(x, (D,), w.norm1_weight, w.norm1_bias, LAYER_NORM_EPS)
            q, k, v = torch.matmul(h, w.in_proj).view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4)
            q, k = rotate(q, rope), rotate(k, rope)
            keys = torch.cat([keys_in[:, i, :, T:], k], dim=2)
            values = torch.cat([values_in[:, i, :, T:], v], dim=2)
            new_keys.append(keys)
            new_values.append(values)
            attended = F.scaled_dot_product_attention(q, keys, values, mask).transpose(1, 2).reshape(B, T, D)
            x = x + w.layer_scale_1 * torch.matmul(attended, w.out_proj)
            h = F.layer_norm(x, (D,), w.norm2_weight, w.norm2_bias, LAYER_NORM_EPS)
            x = x + w.layer_scale_2 * torch.matmul(F.gelu(torch.matmul(h, w.linear1)), w.linear2)
        io.give(self.keys.name, torch.stack(new_keys, dim=1))
        io.give(self.values.name, torch.stack(new_values, dim=1))
        io.give(self.position.name, position.view(B) + T)
        return x


class QuantizerStep(nn.Module):
    """``SplitQuantizer`` encode/decode of one latent frame per session.

    Nearest codes use the matmul form of ``torch.cdist`` that PyTorch itself picks for a
    2048-entry codebook (``|x|^2 + |c|^2 - 2 x.c`` as one GEMM over padded vectors, clamped
    and square-rooted), with the codebook side precomputed; the same formula keeps
    near-ties resolving as in the PyTorch codec.
    """

    def __init__(self, quantizer: SplitQuantizer) -> None:
        super().__init__()
        self.num_codebooks = quantizer.num_codebooks
        for name in ("first_in_proj", "rest_in_proj", "first_out_proj", "rest_out_proj"):  # 1x1 convs
            _borrow_matmul_weight(self, name, getattr(quantizer, name)[:, :, 0])
        # One initializer per level (a stacked tensor would be sliced at run time).
        self.books = nn.Module()
        for k in range(self.num_codebooks):
            book = quantizer.codebooks[k].detach().to("cpu")
            norm = book.pow(2).sum(-1, keepdim=True)
            _borrow(self.books, f"level{k}", book)
            # [dim + 2, bins]: the codebook as the right-hand side of cdist's padded GEMM.
            padded = torch.cat([book, torch.ones_like(norm), norm], dim=-1).t().contiguous()
            self.books.register_buffer(f"padded{k}", padded, persistent=False)

    def _book(self, k: int) -> torch.Tensor:
        return getattr(self.books, f"level{k}")

    def _nearest(self, vectors: torch.Tensor, k: int) -> torch.Tensor:
        """vectors [B, dim] -> index [B] of the nearest entry of codebook ``k``."""
        norm = vectors.pow(2).sum(-1, keepdim=True)
        padded = torch.cat([vectors.mul(-2), norm, torch.ones_like(norm)], dim=-1)
        distances = torch.matmul(padded, getattr(self.books, f"padded{k}"))
        return distances.clamp_min(0).sqrt().argmin(dim=-1)

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [B, D] -> codes [B, num_codebooks] (int64)."""
        codes = [self._nearest(torch.matmul(latent, self.first_in_proj), 0)]
        residual = torch.matmul(latent, self.rest_in_proj)
        for k in range(1, self.num_codebooks):
            level = self._nearest(residual, k)
            residual = residual - F.embedding(level, self._book(k))
            codes.append(level)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, num_codebooks] -> latent [B, D]; levels summed in the codec's order."""
        out = torch.matmul(F.embedding(codes[:, 0], self._book(0)), self.first_out_proj)
        if self.num_codebooks > 1:
            acoustic = F.embedding(codes[:, 1], self._book(1))
            for k in range(2, self.num_codebooks):
                acoustic = acoustic + F.embedding(codes[:, k], self._book(k))
            out = out + torch.matmul(acoustic, self.rest_out_proj)
        return out
