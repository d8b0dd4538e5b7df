"""Batched token sampling with per-session settings and a per-session counter-based RNG.

The reference samples with ``argmax(p_i / E_i)``, ``E_i ~ Exponential(1)`` over the top-k
probabilities of ``softmax(logits / temp)`` (an exact categorical draw without
renormalising).  We keep that rule, but draw the exponential noise from a stateless hash of
(session seed, frame counter, stream, vocabulary index): a session's samples then depend only
on its own seed and history, never on which other sessions share the batch or on the
order slots are stepped in.  The same integer arithmetic runs on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27, so products of 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (two xor-shift-multiply rounds) on int64 tensors."""
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    x = (((x >> 16) ^ x) * _MULT) & _MASK32
    return (x >> 16) ^ x


def stream_salt(stream: int) -> int:
    """The per-stream constant mixed into the hash (streams never share noise)."""
    return (stream * 0x9E3779B1) & _MASK32


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, stream: int | torch.Tensor,
                      vocab: int) -> torch.Tensor:
    """Exponential(1) noise [B, vocab] for sessions with ``seeds`` [B] at ``counters`` [B].

    ``stream`` is the stream index, or its ``stream_salt`` as a 0-d int64 tensor (what
    compiled callers pass: a Python int would become a symbolic size there).
    """
    device = seeds.device
    salt = stream_salt(stream) if isinstance(stream, int) else stream
    idx = torch.arange(vocab, device=device, dtype=torch.long).view(1, -1)
    h = _mix32(idx ^ salt)
    h = _mix32(h ^ (counters.view(-1, 1) & _MASK32))
    h = _mix32(h ^ ((counters.view(-1, 1) >> 32) & _MASK32))
    h = _mix32(h ^ (seeds.view(-1, 1) & _MASK32))
    h = _mix32(h ^ ((seeds.view(-1, 1) >> 32) & _MASK32))
    # 24 random bits fit a float32 mantissa exactly; u is in (0, 1).
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one stream kind (text or audio)."""

    temperature: torch.Tensor  # [B] float32; <= 0 means greedy
    top_k: torch.Tensor  # [B] int64
    greedy: torch.Tensor  # [B] bool


# Graph-captured ticks need a static top-k width: larger per-session values are clamped.
STATIC_TOP_K = 2048


def sample_tokens(logits: torch.Tensor, settings: SamplingBatch, noise: torch.Tensor | None,
                  k_max: int | None = None) -> torch.Tensor:
    """Draw one token per row of ``logits`` [B, V] (float32).

    ``k_max`` fixes the top-k width (no host synchronisation, as CUDA graphs need);
    ``None`` derives it from the rows' settings.
    """
    greedy_tokens = torch.argmax(logits, dim=-1)
    if noise is None:
        return greedy_tokens
    temp = settings.temperature.clamp(min=1e-6).view(-1, 1)
    probs = torch.softmax(logits / temp, dim=-1)
    if k_max is None:
        k_max = int(settings.top_k.max())
    k_max = min(k_max, logits.shape[-1])
    top_p, top_i = torch.topk(probs, k_max, dim=-1)
    rank = torch.arange(k_max, device=logits.device).view(1, -1)
    top_p = torch.where(rank < settings.top_k.view(-1, 1), top_p, torch.zeros_like(top_p))
    choice = torch.argmax(top_p / noise.gather(-1, top_i), dim=-1, keepdim=True)
    sampled = top_i.gather(-1, choice).squeeze(-1)
    use_greedy = settings.greedy | (settings.temperature <= 0)
    return torch.where(use_greedy, greedy_tokens, sampled)
