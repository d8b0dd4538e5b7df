"""Mimi's split residual vector quantizer, inference only.

Codebook 0 ("semantic") quantizes ``rvq_first.input_proj(x)``; codebooks 1.. form a
residual VQ over ``rvq_rest.input_proj(x)`` of the SAME latent ``x``.  Nearest codes use
L2 distances from ``torch.cdist`` then argmin, exactly like the oracle, so ties and
near-ties resolve the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.fastpath.compiled import compile_dynamic
from engines.config import QuantizerConfig
from engines.model.mimi import ops
from engines.model.mimi.checkpoint import CheckpointTensors, copy_into

CLUSTER_USAGE_EPS = 1e-5  # EuclideanCodebook.epsilon


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: QuantizerConfig, num_codebooks: int, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.num_codebooks = num_codebooks
        self.bins = cfg.bins
        self.n_q = cfg.n_q

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, device=device, dtype=dtype), requires_grad=False)

        self.first_in_proj = param(cfg.dimension, cfg.input_dimension, 1)
        self.first_out_proj = param(cfg.output_dimension, cfg.dimension, 1)
        self.rest_in_proj = param(cfg.dimension, cfg.input_dimension, 1)
        self.rest_out_proj = param(cfg.output_dimension, cfg.dimension, 1)
        # codebooks[0] is the semantic one, codebooks[k] the acoustic level k.
        self.codebooks = param(num_codebooks, cfg.bins, cfg.dimension)
        self._encode_streaming = self._encode
        self._decode_streaming = self._decode

    def compile_streaming(self) -> None:
        """Compile the streaming (batch-invariant) encode and decode (GPU fast path)."""
        self._encode_streaming = compile_dynamic(self._encode)
        self._decode_streaming = compile_dynamic(self._decode)

    def load(self, ckpt: CheckpointTensors, prefix: str = "quantizer") -> None:
        for half in ("first", "rest"):
            for attr, name in (("in_proj", "input_proj"), ("out_proj", "output_proj")):
                param = getattr(self, f"{half}_{attr}")
                copy_into(param, ckpt.take(f"{prefix}.rvq_{half}.{name}.weight", param.shape))
        bins, dim = self.codebooks.shape[1:]
        for k in range(self.num_codebooks):
            half, level = ("first", 0) if k == 0 else ("rest", k - 1)
            base = f"{prefix}.rvq_{half}.vq.layers.{level}._codebook."
            embedding_sum = ckpt.take(base + "embedding_sum", (bins, dim)).float()
            usage = ckpt.take(base + "cluster_usage", (bins,)).float()
            copy_into(self.codebooks[k], embedding_sum / usage.clamp(min=CLUSTER_USAGE_EPS)[:, None])

    def encode(self, latent: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        """[B, input_dimension, T] -> codes [B, num_codebooks, T]."""
        return self._encode_streaming(latent) if batch_invariant else self._encode(latent, False)

    def _encode(self, latent: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        def project(weight: torch.Tensor) -> torch.Tensor:  # -> [B, T, dim]
            return ops.conv1d(latent, weight, None, batch_invariant=batch_invariant).transpose(1, 2)

        semantic = project(self.first_in_proj)
        codes = [ops.nearest_code(semantic, self.codebooks[0])]
        residual = project(self.rest_in_proj)
        for k in range(1, self.num_codebooks):
            level_codes = ops.nearest_code(residual, self.codebooks[k])
            residual = residual - F.embedding(level_codes, self.codebooks[k])
            codes.append(level_codes)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        """codes [B, num_codebooks, T] -> [B, output_dimension, T]."""
        return self._decode_streaming(codes) if batch_invariant else self._decode(codes, False)

    def _decode(self, codes: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
        def project(vectors: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [B, T, dim] -> [B, D, T]
            return ops.conv1d(vectors.transpose(1, 2), weight, None, batch_invariant=batch_invariant)

        out = project(F.embedding(codes[:, 0], self.codebooks[0]), self.first_out_proj)
        if self.num_codebooks > 1:
            # Same summation order as moshi: levels 1, 2, ... then one projection.
            acoustic = F.embedding(codes[:, 1], self.codebooks[1])
            for k in range(2, self.num_codebooks):
                acoustic = acoustic + F.embedding(codes[:, k], self.codebooks[k])
            out = out + project(acoustic, self.rest_out_proj)
        return out
