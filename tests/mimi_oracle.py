"""Tiny random Mimi models built with PyPI ``moshi`` 0.2.13, used as the conformance oracle.

Import this only from tests: it needs ``moshi`` installed (``--no-deps``) and
``NO_TORCH_COMPILE=1`` set before the import.
"""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402

from engines.config import MimiConfig, MimiTransformerConfig, QuantizerConfig, SeanetConfig  # noqa: E402

FRAME = 1920


def tiny_config(context: int = 8, num_codebooks: int = 8) -> MimiConfig:
    return MimiConfig(
        seanet=SeanetConfig(n_filters=4, dimension=32, ratios=(8, 6, 5, 4)),
        transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=2, dim_feedforward=64, context=context),
        quantizer=QuantizerConfig(dimension=16, n_q=32, bins=2048, input_dimension=32, output_dimension=32),
        num_codebooks=num_codebooks,
    )


def build_oracle(cfg: MimiConfig, calibration_pcm: torch.Tensor, seed: int = 0):
    """A random-init moshi ``MimiModel`` with usable codebooks and LayerScales.

    Every codebook gets random ``embedding_sum``/``cluster_usage`` BEFORE the first
    encode/decode (the normalised codebook is cached on first use).  Plain randn
    codebooks would map every frame of a random SEANet to the same code (its latents
    barely move over time), so the used codebooks are drawn around latents of
    ``calibration_pcm`` [T]: then codes vary from frame to frame and small numeric or
    attention-window changes show up in the codes.  LayerScale is raised from its 0.01
    init so the transformers matter.
    """
    from moshi.models import loaders

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mimi = loaders.get_mimi(None, cfg.to_moshi_config(), device="cpu", num_codebooks=cfg.num_codebooks)
    with torch.no_grad():
        for name, param in mimi.named_parameters():
            if "layer_scale" in name:
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.25)
        for name, buf in mimi.named_buffers():
            if name.endswith("_codebook.embedding_sum"):
                buf.copy_(torch.randn(buf.shape, generator=gen))
            elif name.endswith("_codebook.cluster_usage"):
                buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)
            elif name.endswith("_codebook._initialized"):
                buf.fill_(1)
        latent = mimi._encode_to_unquantized_latent(calibration_pcm.view(1, 1, -1))[0]  # [D, F]
        quantizer = mimi.quantizer
        _calibrate(quantizer.rvq_first, latent, quantizer.rvq_first.n_q, gen)
        _calibrate(quantizer.rvq_rest, latent, quantizer.rvq_rest.n_q, gen)
    return mimi.eval()


def _calibrate(rvq, latent: torch.Tensor, levels: int, gen: torch.Generator) -> None:
    """Draw each used level's centroids from the residuals that level will see."""
    residual = rvq.input_proj(latent[None])[0].T  # [F, dim]
    for layer in rvq.vq.layers[:levels]:
        book = layer._codebook
        picks = torch.randint(residual.shape[0], (book.codebook_size,), generator=gen)
        noise = torch.randn(book.codebook_size, residual.shape[1], generator=gen)
        centroids = residual[picks] + 0.5 * residual.std(0) * noise
        usage = torch.rand(book.codebook_size, generator=gen) + 0.5
        book.embedding_sum.copy_(centroids * usage[:, None])
        book.cluster_usage.copy_(usage)
        residual = residual - centroids[torch.cdist(residual, centroids).argmin(-1)]


def official_state_dict(mimi) -> dict[str, torch.Tensor]:
    """The oracle's weights under the names of the released safetensors file.

    moshi's ``state_dict()`` splits the attention projections per step
    (``in_projs.0.weight``); the file fuses them (``in_proj_weight``, ``out_proj.weight``).
    """
    out = {}
    for key, value in mimi.state_dict().items():
        key = key.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
        key = key.replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight")
        out[key] = value.detach().clone()
    return out


@torch.no_grad()
def oracle_stream_encode(mimi, pcm: torch.Tensor) -> torch.Tensor:
    """pcm [T] (T a multiple of 1920) -> codes [K, F], one frame per streaming call."""
    frames = pcm.view(-1, FRAME)
    with mimi.streaming(1):
        codes = [mimi.encode(frame.view(1, 1, FRAME))[0, :, 0] for frame in frames]
    return torch.stack(codes, dim=1)


@torch.no_grad()
def oracle_stream_decode(mimi, codes: torch.Tensor) -> torch.Tensor:
    """codes [K, F] -> pcm [F * 1920], one frame per streaming call."""
    with mimi.streaming(1):
        out = [mimi.decode(codes[None, :, f:f + 1])[0, 0] for f in range(codes.shape[1])]
    return torch.cat(out)


@torch.no_grad()
def naive_windowed_transformer(transformer, x: torch.Tensor, context: int, steps_per_call: int,
                               window: str) -> torch.Tensor:
    """A straightforward float64 re-computation of a moshi ``StreamingTransformer``.

    ``x`` [T, D] is a whole sequence fed ``steps_per_call`` steps per streaming call.  The
    query at position p, whose call has written ``E = (p // steps + 1) * steps`` positions,
    sees the keys k <= p with
      * ``reference``: k > E - context (NVIDIA's ring labels, spec/model.md section 10);
      * ``full``: k > p - context and k >= E - context (upstream: full window, but the
        ring of ``context`` entries no longer holds older keys);
      * ``none``: k > p - context (the non-streaming pass).
    Because attention is causal, one pass with these per-query masks equals running the
    reference call by call.
    """
    T, D = x.shape
    pos = torch.arange(T)
    call_end = (pos // steps_per_call + 1) * steps_per_call
    lo = {
        "reference": call_end - context + 1,
        "full": torch.maximum(pos - context + 1, call_end - context),
        "none": pos - context + 1,
    }[window]
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lo[:, None])
    h = x.double()
    for layer in transformer.layers:
        attn = layer.self_attn
        H = attn.num_heads
        y = torch.nn.functional.layer_norm(h, (D,), layer.norm1.weight.double(), layer.norm1.bias.double(), 1e-5)
        q, k, v = (y @ attn.in_projs[0].weight.double().T).view(T, 3, H, D // H).permute(1, 2, 0, 3)
        q, k = _rope64(q, attn.rope.max_period), _rope64(k, attn.rope.max_period)
        scores = (q @ k.transpose(-1, -2)) / (D // H) ** 0.5
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = (weights @ v).transpose(0, 1).reshape(T, D) @ attn.out_projs[0].weight.double().T
        h = h + layer.layer_scale_1.scale.double() * out
        y = torch.nn.functional.layer_norm(h, (D,), layer.norm2.weight.double(), layer.norm2.bias.double(), 1e-5)
        ff = torch.nn.functional.gelu(y @ layer.linear1.weight.double().T) @ layer.linear2.weight.double().T
        h = h + layer.layer_scale_2.scale.double() * ff
    return h


def _rope64(x: torch.Tensor, max_period: float) -> torch.Tensor:
    """Interleaved RoPE on [H, T, d] as a complex rotation by pos * max_period ** (-2i/d)."""
    H, T, d = x.shape
    freqs = max_period ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs
    pairs = torch.view_as_complex(x.reshape(H, T, d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).reshape(H, T, d)
