"""Mimi's encoder/decoder transformers: pre-norm LayerNorm, RoPE attention, GELU FFN,
LayerScale; no input/output projections (d_model equals the SEANet dimension).

Streaming keeps every slot's keys/values in one ``SlotKVRing`` (capacity = ``context``)
and picks the visible window with ``window_start``: in ``reference`` mode a query of a
call that ends at position ``E`` sees keys ``> E - context`` (NVIDIA's ring quirk), in
``full`` mode keys ``> q - context`` that the ring still holds (upstream moshi).  The
non-streaming pass attends over the whole sequence with the full window, as the oracle's
non-streaming path does.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.fastpath.compiled import compile_dynamic
from engines.config import MimiTransformerConfig
from engines.model.mimi import ops
from engines.model.mimi.checkpoint import CheckpointTensors, copy_into
from engines.state.kv_ring import SlotKVRing, WindowMode, window_start
from engines.model.rope import rope_tables, rotate

LAYER_NORM_EPS = 1e-5

# attend(q, k, v) -> attention output, all [B, heads, T, head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TransformerLayer(nn.Module):
    def __init__(self, cfg: MimiTransformerConfig, device=None, dtype=torch.float32) -> None:
        super().__init__()
        D, FF = cfg.d_model, cfg.dim_feedforward
        self.num_heads = cfg.num_heads
        self.max_period = cfg.max_period

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype), requires_grad=False)

        self.in_proj, self.out_proj = param(3 * D, D), param(D, D)
        self.norm1_weight, self.norm1_bias = param(D), param(D)
        self.norm2_weight, self.norm2_bias = param(D), param(D)
        self.linear1, self.linear2 = param(FF, D), param(D, FF)
        self.layer_scale_1, self.layer_scale_2 = param(D), param(D)

    def load(self, ckpt: CheckpointTensors, prefix: str) -> None:
        attn = prefix + ".self_attn."
        # Official files fuse the projections; moshi's own state_dict() splits them per step.
        names = {
            "in_proj": (attn + "in_proj_weight", (attn + "in_projs.0.weight",)),
            "out_proj": (attn + "out_proj.weight", (attn + "out_projs.0.weight",)),
            "norm1_weight": (prefix + ".norm1.weight", ()),
            "norm1_bias": (prefix + ".norm1.bias", ()),
            "norm2_weight": (prefix + ".norm2.weight", ()),
            "norm2_bias": (prefix + ".norm2.bias", ()),
            "linear1": (prefix + ".linear1.weight", ()),
            "linear2": (prefix + ".linear2.weight", ()),
            "layer_scale_1": (prefix + ".layer_scale_1.scale", ()),
            "layer_scale_2": (prefix + ".layer_scale_2.scale", ()),
        }
        for attr, (key, aliases) in names.items():
            param = getattr(self, attr)
            copy_into(param, ckpt.take(key, param.shape, aliases))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend,
                halves: "LayerHalves | None" = None) -> torch.Tensor:
        attention_input, attention_output_ffn = halves or (_attention_input, _attention_output_ffn)
        q, k, v = attention_input(x, self.norm1_weight, self.norm1_bias, self.in_proj, self.num_heads, rope)
        return attention_output_ffn(x, attend(q, k, v), self.out_proj, self.layer_scale_1, self.norm2_weight,
                                    self.norm2_bias, self.linear1, self.linear2, self.layer_scale_2)


# A layer's two halves around its attention, as free functions of their weights so one
# compiled version serves every layer (``MimiTransformer.compile_layers``).
def _attention_input(x, norm_w, norm_b, in_proj, heads: int, rope):
    B, T, D = x.shape
    h = F.layer_norm(x, (D,), norm_w, norm_b, LAYER_NORM_EPS)
    q, k, v = ops.linear(h, in_proj).view(B, T, 3, heads, D // heads).permute(2, 0, 3, 1, 4)
    return rotate(q, rope), rotate(k, rope), v


def _attention_output_ffn(x, attended, out_proj, scale_1, norm_w, norm_b, linear1, linear2, scale_2):
    B, T, D = x.shape
    x = x + scale_1 * ops.linear(attended.transpose(1, 2).reshape(B, T, D), out_proj)
    h = F.layer_norm(x, (D,), norm_w, norm_b, LAYER_NORM_EPS)
    return x + scale_2 * ops.linear(F.gelu(ops.linear(h, linear1)), linear2)


LayerHalves = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]


class MimiTransformer(nn.Module):
    """Operates on [B, T, d_model]; ``step`` streams for ``slots``, ``forward`` is whole-signal."""

    def __init__(self, cfg: MimiTransformerConfig, num_slots: int, window: str, root: str,
                 device=None, dtype=torch.float32) -> None:
        super().__init__()
        if window not in WindowMode.ALL:
            raise ValueError(f"unknown window mode {window!r}; expected one of {WindowMode.ALL}")
        self.root = root
        self.window = window
        self.context = cfg.context
        self.layers = nn.ModuleList(TransformerLayer(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.ring = SlotKVRing(cfg.num_layers, num_slots, cfg.num_heads, cfg.context,
                               cfg.d_model // cfg.num_heads, device=device, dtype=dtype)
        self._streaming_halves: LayerHalves | None = None

    def compile_layers(self) -> None:
        """Compile the layer halves of the streaming step (GPU fast path; the KV ring's
        writes and the attention between them stay eager, see ``MimiCodec.compile_steps``)."""
        self._streaming_halves = (compile_dynamic(_attention_input), compile_dynamic(_attention_output_ffn))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for ``positions``, computed once and shared by every layer."""
        layer = self.layers[0]
        return rope_tables(positions, layer.in_proj.shape[1] // layer.num_heads, layer.max_period)

    def load(self, ckpt: CheckpointTensors) -> None:
        for i, layer in enumerate(self.layers):
            layer.load(ckpt, f"{self.root}.transformer.layers.{i}")

    def reset(self, slots: torch.Tensor) -> None:
        self.ring.reset(slots)

    def step(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One streaming call: the T steps of ``x`` continue each slot's sequence."""
        # The encoder's and the decoder's transformers share the compiled layer halves' code,
        # and dynamo guards on their inputs' strides: the two callers' inputs (transposes of
        # convolution outputs of 1 and 2 steps) laid out alike spare the halves a second
        # compilation each (docs/PERFORMANCE.md, "Start-up budgets": 4/1 and 5/1).
        x = x.contiguous()
        T = x.shape[1]
        positions = self.ring.positions(slots, T)
        # The reference labels ring slots by the end of the whole call, not per query.
        call_end = (positions[:, -1:] + 1).expand_as(positions)
        lo = window_start(positions, call_end, self.context, self.window)
        rope = self._rope(positions)
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return self.ring.attend(i, slots, q, k, v, positions, lo)
            x = layer(x, rope, attend, self._streaming_halves)
        self.ring.advance(slots, T)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence from position 0, full window, no slot state touched."""
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device)
        positions = pos.view(1, T).expand(B, T)
        delta = pos.view(T, 1) - pos.view(1, T)  # query - key
        mask = ((delta >= 0) & (delta < self.context)).expand(B, 1, T, T)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, mask)

        rope = self._rope(positions)
        for layer in self.layers:
            x = layer(x, rope, attend)
        return x
