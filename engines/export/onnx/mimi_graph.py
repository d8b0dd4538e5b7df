"""Mimi's streaming encode and decode steps as pure functions of (input, *states).

``MimiEncoderGraph``: pcm [B, frame_samples] float32 + encoder states -> codes
[B, num_codebooks] int64 + updated states.  ``MimiDecoderGraph``: codes + decoder states ->
pcm [B, frame_samples] + updated states.  Each equals ``MimiCodec.encode_step`` /
``decode_step`` of one frame for sessions whose codec state is the graph state; ``layout``
names every tensor and gives the zero initial state.

The downsample conv's "fresh stream" flag (replicate its first input instead of zero
padding) is not a state of its own: a session is fresh exactly when its encoder
transformer has seen no step yet (``position == 0``), because the codec resets the whole
encoder side together.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.model.mimi import MimiCodec
from engines.export.onnx.mimi_layers import (
    ConvStep,
    ConvTransposeStep,
    QuantizerStep,
    SeanetStep,
    TransformerStep,
)
from engines.export.onnx.state import GraphTensor, StateIO, StepLayout


def _check_codec(codec: MimiCodec) -> None:
    steps = codec.cfg.latent_steps_per_frame
    if codec.cfg.transformer.context < steps:
        raise ValueError(f"transformer context {codec.cfg.transformer.context} is shorter than the "
                         f"{steps} latent steps of one frame")
    if codec.dtype != torch.float32:
        raise ValueError(f"export Mimi in float32 (got {codec.dtype}); TensorRT picks precisions at build time")


def _pcm(codec: MimiCodec) -> GraphTensor:
    return GraphTensor("pcm", (codec.frame_samples,), torch.float32)


def _codes(codec: MimiCodec) -> GraphTensor:
    return GraphTensor("codes", (codec.num_codebooks,), torch.int64)


class MimiEncoderGraph(nn.Module):
    def __init__(self, codec: MimiCodec) -> None:
        super().__init__()
        _check_codec(codec)
        self.seanet = SeanetStep(codec.encoder, "encoder")
        self.transformer = TransformerStep(codec.encoder_transformer, "encoder_transformer")
        self.downsample = None if codec.downsample is None else ConvStep(codec.downsample, "downsample")
        self.quantizer = QuantizerStep(codec.quantizer)
        states = self.seanet.states() + self.transformer.states()
        if self.downsample is not None:
            states += self.downsample.states()
        self.layout = StepLayout(inputs=(_pcm(codec),), outputs=(_codes(codec),), states=tuple(states))

    def forward(self, pcm: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        io = StateIO(self.layout.states, states)
        fresh = io.take(self.transformer.position.name) == 0
        latent = self.seanet(pcm.unsqueeze(1), io)
        latent = self.transformer(latent.transpose(1, 2), io).transpose(1, 2)
        if self.downsample is not None:
            latent = self.downsample(latent, io, fresh)
        return (self.quantizer.encode(latent[:, :, 0]), *io.updated())


class MimiDecoderGraph(nn.Module):
    def __init__(self, codec: MimiCodec) -> None:
        super().__init__()
        _check_codec(codec)
        self.quantizer = QuantizerStep(codec.quantizer)
        self.upsample = None if codec.upsample is None else ConvTransposeStep(codec.upsample, "upsample")
        self.transformer = TransformerStep(codec.decoder_transformer, "decoder_transformer")
        self.seanet = SeanetStep(codec.decoder, "decoder")
        states = [] if self.upsample is None else self.upsample.states()
        states += self.transformer.states() + self.seanet.states()
        self.layout = StepLayout(inputs=(_codes(codec),), outputs=(_pcm(codec),), states=tuple(states))

    def forward(self, codes: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        io = StateIO(self.layout.states, states)
        latent = self.quantizer.decode(codes).unsqueeze(-1)
        if self.upsample is not None:
            latent = self.upsample(latent, io)
        latent = self.transformer(latent.transpose(1, 2), io).transpose(1, 2)
        return (self.seanet(latent, io)[:, 0], *io.updated())
