"""The Mimi codec batched over session slots: streaming 80 ms steps and whole-signal calls.

Encode: SEANet encoder -> encoder transformer -> downsample conv (25 -> 12.5 Hz) -> split
RVQ.  Decode: RVQ embeddings -> depthwise upsample convtr -> decoder transformer ->
SEANet decoder.  Every streaming state lives in per-slot tensors owned by the layers, so a
step call can advance any subset of slots, in any order, in one batch.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import MimiConfig
from engines.model.mimi.checkpoint import CheckpointTensors
from engines.model.mimi.conv import SlotConv1d, SlotConvTranspose1d
from engines.model.mimi.quantizer import SplitQuantizer
from engines.model.mimi.seanet import SeanetDecoder, SeanetEncoder
from engines.model.mimi.transformer import MimiTransformer
from engines.state.kv_ring import WindowMode

logger = logging.getLogger(__name__)

SlotsLike = torch.Tensor | Sequence[int]


class MimiCodec(nn.Module):
    """Mimi for ``num_slots`` concurrent sessions.

    ``encode_step``/``decode_step`` advance the given slots by one 80 ms frame each;
    ``encode``/``decode`` process whole signals without touching any slot.  Streaming
    results of a slot do not depend on which other slots share the call (bit for bit on
    CPU, see ``ops``).  ``window`` picks the streaming attention window of both
    transformers (``WindowMode``); whole-signal calls always use the full window.
    """

    def __init__(self, cfg: MimiConfig, num_slots: int, window: str = WindowMode.REFERENCE,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if cfg.seanet.channels != 1:
            raise ValueError(f"only mono Mimi is supported, config has {cfg.seanet.channels} channels")
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be at least 1")
        self.cfg = cfg
        self.num_slots = num_slots
        self.window = window
        self.frame_samples = cfg.frame_samples
        self.num_codebooks = cfg.num_codebooks
        self.cardinality = cfg.quantizer.bins
        self.device = torch.device(device)
        self.dtype = dtype
        kw = dict(device=device, dtype=dtype)
        dim = cfg.seanet.dimension
        steps = cfg.latent_steps_per_frame  # encoder-rate latent steps per code frame

        self.encoder = SeanetEncoder(cfg.seanet, num_slots, **kw)
        self.encoder_transformer = MimiTransformer(cfg.transformer, num_slots, window, "encoder_transformer", **kw)
        self.downsample = self.upsample = None
        if steps > 1:
            # The conv's first window must not see zeros before a fresh stream: replicate.
            self.downsample = SlotConv1d(dim, dim, 2 * steps, num_slots, stride=steps, bias=False,
                                         replicate_pad=True, **kw)
            # Depthwise, as in the released model (moshi's "upsample_channel_wise_bug").
            self.upsample = SlotConvTranspose1d(dim, dim, 2 * steps, steps, num_slots, groups=dim, bias=False, **kw)
        self.quantizer = SplitQuantizer(cfg.quantizer, cfg.num_codebooks, **kw)
        self.decoder_transformer = MimiTransformer(cfg.transformer, num_slots, window, "decoder_transformer", **kw)
        self.decoder = SeanetDecoder(cfg.seanet, num_slots, **kw)

    def compile_steps(self) -> None:
        """``torch.compile`` the pieces of the streaming steps (GPU fast path).

        Eagerly a step is hundreds of small kernels (state gathers and scatters, layout
        changes, norms, ELUs around each convolution); compiled, inductor fuses them around
        the convolutions and GEMMs.  The transformers' KV-ring writes and attention stay
        eager between compiled layer halves: compiling each whole step, rings included,
        made the B=1 tick slower on the H200 (docs/PERFORMANCE.md, "GPU: lockstep tick at
        PersonaPlex-7B shapes"; the cause was not profiled), while compiling these pieces
        made it faster.
        Dynamic shapes: one compilation serves every batch bucket.  The CPU reference
        path never calls this (its batch-invariant kernels are not traceable).
        """
        for part in (self.encoder, self.decoder):
            part.compile_streaming()
        for part in (self.encoder_transformer, self.decoder_transformer):
            part.compile_layers()
        self.quantizer.compile_streaming()

    # Loading ---------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, cfg: MimiConfig, state_dict: Mapping[str, torch.Tensor], num_slots: int,
                        window: str = WindowMode.REFERENCE, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> "MimiCodec":
        """Build from tensors in the official ``tokenizer-*.safetensors`` layout.

        Raises ``CheckpointError`` naming any missing or mis-shaped tensor; other keys
        (e.g. the unused quantizer levels) are ignored.
        """
        codec = cls(cfg, num_slots, window, device, dtype)
        ckpt = CheckpointTensors(state_dict)
        codec.encoder.load(ckpt)
        codec.decoder.load(ckpt)
        codec.encoder_transformer.load(ckpt)
        codec.decoder_transformer.load(ckpt)
        if codec.downsample is not None:
            codec.downsample.load(ckpt, "downsample.conv.conv.conv")
            codec.upsample.load(ckpt, "upsample.convtr.convtr.convtr")
        codec.quantizer.load(ckpt)
        logger.debug("Mimi: loaded %d tensors, ignored %d", len(ckpt.used), len(ckpt.unused()))
        return codec

    # Streaming state -------------------------------------------------------------------
    def _encoder_parts(self) -> list[nn.Module]:
        return [self.encoder, self.encoder_transformer] + ([self.downsample] if self.downsample else [])

    def _decoder_parts(self) -> list[nn.Module]:
        return [self.decoder, self.decoder_transformer] + ([self.upsample] if self.upsample else [])

    @staticmethod
    def _reset_parts(parts: list[nn.Module], slots: torch.Tensor) -> None:
        for part in parts:
            for module in part.modules():
                if isinstance(module, (SlotConv1d, SlotConvTranspose1d, MimiTransformer)):
                    module.reset(slots)

    @torch.no_grad()
    def reset(self, slots: SlotsLike) -> None:
        """Make ``slots`` start a fresh stream (encoder and decoder); other slots are untouched."""
        slots = self._check_slots(slots)
        self._reset_parts(self._encoder_parts() + self._decoder_parts(), slots)

    @torch.no_grad()
    def reset_encoder(self, slots: SlotsLike) -> None:
        self._reset_parts(self._encoder_parts(), self._check_slots(slots))

    @torch.no_grad()
    def reset_decoder(self, slots: SlotsLike) -> None:
        self._reset_parts(self._decoder_parts(), self._check_slots(slots))

    def slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of every streaming-state tensor of one slot (for tests and debugging)."""
        state = {name: buf[slot].clone() for name, buf in self.named_buffers()}
        for name, tr in (("encoder_transformer", self.encoder_transformer),
                         ("decoder_transformer", self.decoder_transformer)):
            state[f"{name}.ring.keys"] = tr.ring.keys[:, slot].clone()
            state[f"{name}.ring.values"] = tr.ring.values[:, slot].clone()
            state[f"{name}.ring.length"] = tr.ring.length[slot].clone()
        return state

    # Streaming -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_step(self, slots: SlotsLike, pcm: torch.Tensor) -> torch.Tensor:
        """One 80 ms frame per slot: pcm [B, frame_samples] -> codes [B, num_codebooks]."""
        slots = self._check_slots(slots)
        self._check_pcm(pcm, frames_for=slots.numel())
        if slots.numel() == 0:
            return torch.zeros(0, self.num_codebooks, dtype=torch.long, device=self.device)
        return self.encode_step_unchecked(slots, pcm)

    def encode_step_unchecked(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor:
        """``encode_step`` without validation (no host synchronisation: CUDA-graph safe).

        ``slots`` must be a device LongTensor; a slot may repeat only if its state is scratch.
        """
        return self.quantizer.encode(self._latent_step(slots, pcm))[:, :, 0]

    def _latent_step(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor:
        """Unquantized latent [B, D, 1] of one frame per slot (advances the encoder state)."""
        x = pcm.to(device=self.device, dtype=self.dtype).unsqueeze(1)
        latent = self.encoder(x, slots)
        latent = self.encoder_transformer.step(latent.transpose(1, 2), slots).transpose(1, 2)
        return latent if self.downsample is None else self.downsample(latent, slots)

    @torch.no_grad()
    def decode_step(self, slots: SlotsLike, codes: torch.Tensor) -> torch.Tensor:
        """One code frame per slot: codes [B, num_codebooks] -> pcm [B, frame_samples]."""
        slots = self._check_slots(slots)
        self._check_codes(codes, (slots.numel(), self.num_codebooks))
        if slots.numel() == 0:
            return torch.zeros(0, self.frame_samples, dtype=self.dtype, device=self.device)
        return self.decode_step_unchecked(slots, codes)

    def decode_step_unchecked(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``decode_step`` without validation (CUDA-graph safe); codes must be in range."""
        latent = self.quantizer.decode(codes.to(self.device, torch.long).unsqueeze(-1))
        if self.upsample is not None:
            latent = self.upsample(latent, slots)
        latent = self.decoder_transformer.step(latent.transpose(1, 2), slots).transpose(1, 2)
        return self.decoder(latent, slots)[:, 0]

    # Whole signal ----------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, pcm: torch.Tensor) -> torch.Tensor:
        """pcm [B, T] -> codes [B, num_codebooks, ceil(T / frame_samples)]; zero-pads the last frame."""
        self._check_pcm(pcm, frames_for=None)
        return self.quantizer.encode(self._latent(pcm), batch_invariant=False)

    def _latent(self, pcm: torch.Tensor) -> torch.Tensor:
        """Unquantized latent [B, D, F] of a whole signal, zero-padded to whole frames.

        Without slots the layers use PyTorch's default kernels, as moshi's non-streaming
        path does; those may differ from the streaming kernels in the last bits, so a
        near-tie code can come out differently than in streaming (moshi has the same).
        """
        x = pcm.to(device=self.device, dtype=self.dtype).unsqueeze(1)
        x = F.pad(x, (0, -x.shape[-1] % self.frame_samples))
        latent = self.encoder(x)
        latent = self.encoder_transformer(latent.transpose(1, 2)).transpose(1, 2)
        return latent if self.downsample is None else self.downsample(latent)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, num_codebooks, F] -> pcm [B, F * frame_samples]."""
        if codes.dim() != 3:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, F], got shape {tuple(codes.shape)}")
        self._check_codes(codes, (codes.shape[0], self.num_codebooks, codes.shape[2]))
        if codes.shape[2] == 0:
            raise ValueError("codes must hold at least one frame")
        latent = self.quantizer.decode(codes.to(self.device, torch.long), batch_invariant=False)
        if self.upsample is not None:
            latent = self.upsample(latent)
        latent = self.decoder_transformer(latent.transpose(1, 2)).transpose(1, 2)
        return self.decoder(latent)[:, 0]

    # Validation ------------------------------------------------------------------------
    def _check_slots(self, slots: SlotsLike) -> torch.Tensor:
        slots = torch.as_tensor(slots, device=self.device)
        if slots.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"slots must be a 1-D integer tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
        slots = slots.long()
        if bool((slots < 0).any()) or bool((slots >= self.num_slots).any()):
            raise ValueError(f"slots {slots.tolist()} outside [0, {self.num_slots})")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError(f"slots {slots.tolist()} contain duplicates")
        return slots

    def _check_pcm(self, pcm: torch.Tensor, frames_for: int | None) -> None:
        """``frames_for`` slots: one frame each, [frames_for, frame_samples]; None: [B, T > 0]."""
        if not isinstance(pcm, torch.Tensor) or not pcm.is_floating_point():
            raise ValueError("pcm must be a floating-point tensor")
        if frames_for is not None:
            if tuple(pcm.shape) != (frames_for, self.frame_samples):
                raise ValueError(f"pcm must have shape ({frames_for}, {self.frame_samples}), got {tuple(pcm.shape)}")
        elif pcm.dim() != 2 or pcm.shape[0] == 0 or pcm.shape[1] == 0:
            raise ValueError(f"pcm must have shape [B, T] with B, T > 0, got {tuple(pcm.shape)}")

    def _check_codes(self, codes: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex():
            raise ValueError("codes must be an integer tensor")
        if tuple(codes.shape) != shape:
            raise ValueError(f"codes must have shape {shape}, got {tuple(codes.shape)}")
        if codes.numel() and (bool((codes < 0).any()) or bool((codes >= self.cardinality).any())):
            bad = codes[(codes < 0) | (codes >= self.cardinality)]
            raise ValueError(f"codes outside [0, {self.cardinality}): e.g. {bad[:4].tolist()}")
