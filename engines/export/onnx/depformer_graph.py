"""The depformer of one frame as a single traceable network, sampling included.

``DepformerGraph`` unrolls the ``steps`` codebook steps of ``MoshiLM.depformer`` with each
step's own weights, attends over the steps written so far (a concat per step instead of a
preallocated per-frame KV buffer) and draws each token with ``engines.model.sampling``'s own
``sample_tokens``, so greedy and sampled tokens follow the engine's rule exactly.  The
random part of sampling is an input: ``noise`` [B, steps, card] holds the Exponential(1)
noise the engine draws for depformer step k (stream ``1 + k``); ``depformer_noise``
builds it from the sessions' seeds and frame counters, so the graph itself is
deterministic.

Inputs (B = sessions):  hidden [B, dim] float32 (normed temporal output),
text_token [B] int64 (text token of this frame after forcing), forced [B, steps] int64 and
forced_mask [B, steps] bool (teacher forcing, as ``MoshiLM.depformer``), temperature [B]
float32 (<= 0: greedy), top_k [B] int64, greedy [B] bool, noise [B, steps, card] float32.
Output: codes [B, steps] int64, the sampled tokens (before forcing, as ``MoshiLM.depformer``
returns them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.lm import MoshiLM, depformer_first_visible
from engines.state.kv_ring import WindowMode
from engines.model.layers import embed, rms_norm
from engines.export.onnx.state import GraphTensor, StepLayout
from engines.model.sampling import (
    STATIC_TOP_K,
    SamplingBatch,
    exponential_noise,
    sample_tokens,
)


def depformer_noise(seeds: torch.Tensor, counters: torch.Tensor, steps: int, card: int) -> torch.Tensor:
    """The ``noise`` input [B, steps, card]: the engine's noise for depformer steps 0..steps-1."""
    return torch.stack([exponential_noise(seeds, counters, 1 + k, card) for k in range(steps)], dim=1)


class DepformerGraph(nn.Module):
    """The first ``steps`` depformer steps of ``lm`` (float32 copies of its weights), ``layout`` names the I/O."""

    def __init__(self, lm: MoshiLM, steps: int, window: str = WindowMode.REFERENCE,
                 top_k_max: int = STATIC_TOP_K) -> None:
        super().__init__()
        cfg = lm.cfg
        if not 1 <= steps <= lm.depformer_steps:
            raise ValueError(f"steps={steps} must be in [1, {lm.depformer_steps}] (the steps loaded into the LM)")
        if window not in WindowMode.ALL:
            raise ValueError(f"unknown window mode {window!r}; expected one of {WindowMode.ALL}")
        if top_k_max < 1:
            raise ValueError(f"top_k_max={top_k_max} must be positive")
        self.steps, self.card, self.num_layers = steps, cfg.card, cfg.depformer_num_layers
        self.num_heads, self.head_dim, self.eps = cfg.depformer_num_heads, cfg.depformer_head_dim, cfg.norm_eps
        # TopK needs a static width; a session's larger top_k is clamped, as in the engine's graphed path.
        self.top_k_max = min(top_k_max, cfg.card)
        # A static lower bound per step (the graph has no per-frame ring).
        self.first_visible = [depformer_first_visible(k, cfg.dep_q, window) for k in range(steps)]

        def weight(t: torch.Tensor, transpose: bool = False) -> torch.Tensor:
            # float32 on CPU, matmul-ready ([in, out]) so the graph holds no Transpose/Gather of weights.
            t = t.detach().to(device="cpu", dtype=torch.float32)
            return t.t().contiguous() if transpose else t

        # One holder per step: its input projection, embedding table, head and layer weights.
        self.step_weights = nn.ModuleList()
        for k in range(steps):
            step = nn.Module()
            step.register_buffer("input", weight(lm.depformer_in[k], True), persistent=False)
            step.register_buffer("table", weight(lm.depformer_text_emb if k == 0 else lm.depformer_emb[k - 1]),
                                 persistent=False)
            step.register_buffer("head", weight(lm.linears[k], True), persistent=False)
            step.layers = nn.ModuleList()
            for layer in lm.depformer_layers:
                holder = nn.Module()
                for name in ("in_proj", "out_proj", "ffn_in", "ffn_out"):
                    holder.register_buffer(name, weight(getattr(layer, name)[k], True), persistent=False)
                for name in ("norm1", "norm2"):  # shared by all steps
                    holder.register_buffer(name, weight(getattr(layer, name)), persistent=False)
                step.layers.append(holder)
            self.step_weights.append(step)
        S, per_session = steps, ()  # shapes after the batch axis
        self.layout = StepLayout(
            inputs=(
                GraphTensor("hidden", (cfg.dim,), torch.float32),
                GraphTensor("text_token", per_session, torch.int64),
                GraphTensor("forced", (S,), torch.int64),
                GraphTensor("forced_mask", (S,), torch.bool),
                GraphTensor("temperature", per_session, torch.float32),
                GraphTensor("top_k", per_session, torch.int64),
                GraphTensor("greedy", per_session, torch.bool),
                GraphTensor("noise", (S, cfg.card), torch.float32),
            ),
            outputs=(GraphTensor("codes", (S,), torch.int64),),
        )

    def _layer(self, w: nn.Module, k: int, x: torch.Tensor, keys: list, values: list, i: int) -> torch.Tensor:
        """Layer ``i`` of step ``k`` on x [B, dim]; appends this step's key/value to the layer's cache."""
        B = x.shape[0]
        H, Dh = self.num_heads, self.head_dim
        qkv = torch.matmul(rms_norm(x, w.norm1, self.eps), w.in_proj).split(H * Dh, dim=-1)
        q, key, value = (t.view(B, H, 1, Dh) for t in qkv)
        keys[i] = key if keys[i] is None else torch.cat([keys[i], key], dim=2)
        values[i] = value if values[i] is None else torch.cat([values[i], value], dim=2)
        visible_keys, visible_values = keys[i], values[i]
        if self.first_visible[k]:
            visible_keys = visible_keys[:, :, self.first_visible[k]:]
            visible_values = visible_values[:, :, self.first_visible[k]:]
        attended = F.scaled_dot_product_attention(q, visible_keys, visible_values)
        x = x + torch.matmul(attended.reshape(B, H * Dh), w.out_proj)
        gate, up = torch.matmul(rms_norm(x, w.norm2, self.eps), w.ffn_in).chunk(2, dim=-1)
        return x + torch.matmul(F.silu(gate) * up, w.ffn_out)

    def forward(self, hidden: torch.Tensor, text_token: torch.Tensor, forced: torch.Tensor,
                forced_mask: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                greedy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        settings = SamplingBatch(temperature=temperature, top_k=top_k, greedy=greedy)
        keys: list = [None] * self.num_layers
        values: list = [None] * self.num_layers
        prev, samples = text_token, []
        for k, step in enumerate(self.step_weights):
            x = torch.matmul(hidden, step.input) + embed(step.table, prev)
            for i, w in enumerate(step.layers):
                x = self._layer(w, k, x, keys, values, i)
            logits = torch.matmul(x, step.head)
            token = sample_tokens(logits, settings, noise[:, k], k_max=self.top_k_max)
            samples.append(token)
            prev = torch.where(forced_mask[:, k], forced[:, k], token)
        return torch.stack(samples, dim=1)
