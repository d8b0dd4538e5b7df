"""The Moshi/PersonaPlex language model: token embeddings, the temporal transformer, the
text head and the depformer, batched over session slots.

This module is pure compute.  Streaming state lives outside it: the temporal KV cache is a
``SlotKVRing`` passed in by the caller, and the depformer's state lives for one frame only.
Weights use our own canonical names (see ``engines.checkpoints.loader`` for the mapping from the
official file).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.fastpath.compiled import compile_dynamic, static_shapes
from engines.config import LMConfig
from engines.state.kv_ring import SlotKVRing, WindowMode, window_start
from engines.state.prompt_kv import PromptKV
from engines.model.layers import embed, gated_ffn, linear, rms_norm
from engines.model.rope import rope_tables, rotate


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


# The two halves of a transformer layer around its attention, as free functions of their
# weights so one compiled version serves every layer (see ``MoshiLM.compile_blocks``).
def attention_input(x: torch.Tensor, norm: torch.Tensor, in_proj: torch.Tensor, heads: int, eps: float,
                    tables: tuple[torch.Tensor, torch.Tensor] | None, in_scale: torch.Tensor | None = None,
                    matmul: str = "w8a16"):
    """Pre-norm and the fused q/k/v projection of ``x`` [B, T, D]; RoPE when ``tables``.
    ``in_scale``, ``matmul``: an fp8 ``in_proj``'s scales and product (``layers.linear``).
    Returns q, k, v [B, H, T, Dh]."""
    B, T, D = x.shape
    h = rms_norm(x, norm, eps)
    q, k, v = linear(h, in_proj, in_scale, matmul).view(B, T, 3, heads, D // heads).permute(2, 0, 3, 1, 4)
    if tables is not None:
        q, k = rotate(q, tables), rotate(k, tables)
    return q, k, v


def embed_streams(audio_tables: torch.Tensor, text_table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed input embedding [B, T, D] of ``tokens`` [B, T, 1 + n_q].

    Summed audio streams first, in stream order, then text: the reference's order.
    """
    x = None
    for i in range(audio_tables.shape[0]):
        e = embed(audio_tables[i], tokens[..., 1 + i])
        x = e if x is None else x + e
    return x + embed(text_table, tokens[..., 0])


def attention_output_ffn(x: torch.Tensor, attn: torch.Tensor, out_proj: torch.Tensor, norm: torch.Tensor,
                         ffn_in: torch.Tensor, ffn_out: torch.Tensor, eps: float,
                         scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         matmul: str = "w8a16") -> torch.Tensor:
    """Residual add of the attention output ``attn`` [B, H, T, Dh], then the gated FFN block.
    ``scales``: of fp8 ``out_proj``, ``ffn_in``, ``ffn_out`` (``layers.linear``)."""
    B, T, D = x.shape
    s_out, s_in, s_ffn_out = scales if scales is not None else (None, None, None)
    x = x + linear(attn.transpose(1, 2).reshape(B, T, D), out_proj, s_out, matmul)
    return x + gated_ffn(rms_norm(x, norm, eps), ffn_in, ffn_out, s_in, s_ffn_out, matmul)


def depformer_first_visible(step: int, dep_q: int, window: str) -> int:
    """Lowest depformer step that step ``step`` attends to.  The reference's per-frame ring
    holds ``dep_q`` entries (of the model, not of the steps we run), so with all 16 steps the
    last one cannot see step 0 in reference window mode."""
    return max(int(window_start(step, step + 1, dep_q, window)), 0)


def _add_fp8_scales(module: nn.Module, fp8: bool, names: tuple[str, ...]) -> None:
    """``NAME_scale`` beside each weight of ``names``: its per-output-channel fp8 scales
    (``model.fp8_weights``) when ``fp8``, else None."""
    for name in names:
        shape = getattr(module, name).shape[:-1]
        setattr(module, f"{name}_scale", _param(*shape) if fp8 else None)


# A layer's weights that may be fp8 (``model.fp8_weights.is_quantized`` names them too).
LAYER_LINEARS = ("in_proj", "out_proj", "ffn_in", "ffn_out")


def _output_scales(layer: nn.Module, step: int | None = None) -> tuple[torch.Tensor, ...] | None:
    """``attention_output_ffn``'s ``scales`` of ``layer`` (of one depformer ``step``)."""
    if layer.out_proj_scale is None:
        return None
    scales = (layer.out_proj_scale, layer.ffn_in_scale, layer.ffn_out_scale)
    return scales if step is None else tuple(s[step] for s in scales)


class TemporalLayer(nn.Module):
    def __init__(self, cfg: LMConfig, fp8: bool = False) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.ffn_hidden
        self.in_proj = _param(3 * d, d)  # rows: q, k, v; each head-major
        self.out_proj = _param(d, d)
        self.norm1 = _param(d)
        self.norm2 = _param(d)
        self.ffn_in = _param(2 * h, d)  # rows: gate, up
        self.ffn_out = _param(d, h)
        _add_fp8_scales(self, fp8, LAYER_LINEARS)


class DepformerLayer(nn.Module):
    """One depformer layer with a separate weight set per codebook step."""

    def __init__(self, cfg: LMConfig, steps: int, fp8: bool = False) -> None:
        super().__init__()
        d, h = cfg.depformer_dim, cfg.depformer_ffn_hidden
        self.in_proj = _param(steps, 3 * d, d)
        self.out_proj = _param(steps, d, d)
        self.norm1 = _param(d)  # norms are shared by all steps
        self.norm2 = _param(d)
        self.ffn_in = _param(steps, 2 * h, d)
        self.ffn_out = _param(steps, d, h)
        _add_fp8_scales(self, fp8, LAYER_LINEARS)


class MoshiLM(nn.Module):
    """``fp8_matmul``: None keeps every weight in the model dtype; otherwise the layers'
    projections and FFNs and ``depformer_in`` are fp8 with ``NAME_scale`` parameters beside
    them (``model.fp8_weights``), multiplied as ``layers.linear`` says for that value."""

    def __init__(self, cfg: LMConfig, depformer_steps: int, fp8_matmul: str | None = None) -> None:
        super().__init__()
        if not 1 <= depformer_steps <= cfg.dep_q:
            raise ValueError(f"depformer_steps={depformer_steps} must be in [1, dep_q={cfg.dep_q}]")
        self.cfg = cfg
        self.depformer_steps = depformer_steps
        d, dd, steps = cfg.dim, cfg.depformer_dim, depformer_steps
        self.emb = _param(cfg.n_q, cfg.card + 1, d)
        self.text_emb = _param(cfg.text_card + 1, d)
        self.fp8_matmul = fp8_matmul
        fp8 = fp8_matmul is not None
        self.layers = nn.ModuleList(TemporalLayer(cfg, fp8) for _ in range(cfg.num_layers))
        self.out_norm = _param(d)
        self.text_linear = _param(cfg.text_card, d)
        self.depformer_in = _param(steps, dd, d)
        _add_fp8_scales(self, fp8, ("depformer_in",))
        self.depformer_text_emb = _param(cfg.text_card + 1, dd)
        self.depformer_emb = _param(max(steps - 1, 0), cfg.card + 1, dd)
        self.depformer_layers = nn.ModuleList(DepformerLayer(cfg, steps, fp8) for _ in range(cfg.depformer_num_layers))
        self.linears = _param(steps, cfg.card, dd)
        self._attention_input = attention_input
        self._attention_output_ffn = attention_output_ffn
        self._embed_streams = embed_streams
        self._depformer_step = depformer_step
        # Each codebook step's weights (without its token table) and its write and visibility
        # masks, built once and marked static, once compiled (``compile_blocks``); None: the
        # eager path, which builds the weights per call.
        self._step_weights: list[tuple] | None = None
        self._step_masks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._window = WindowMode.REFERENCE  # what compile_blocks built the masks for

    def compile_blocks(self, window: str = WindowMode.REFERENCE) -> None:
        """Replace the layer halves with ``torch.compile``d versions (GPU fast path).

        Inductor fuses each half's norms, RoPE, casts, SiLU gate and residual adds into a
        few kernels around the GEMMs (the eager tick launches thousands of tiny kernels).
        Shapes are dynamic so one compilation serves every batch bucket (and, with the
        steps' keys in fixed-size buffers, every depformer step).  ``window``: the one
        ``depformer`` will be called with (its steps' visibility masks are built here).
        Changes rounding only (float32 statistics are kept); the CPU reference path never
        calls this.
        """
        self._attention_input = compile_dynamic(attention_input)
        self._attention_output_ffn = compile_dynamic(attention_output_ffn)
        self._embed_streams = compile_dynamic(embed_streams)
        # A whole codebook step (its 6 layers, input and head) is one compiled piece: the
        # depformer runs 8 of them per tick at a few rows, where each kernel's launch on the
        # GPU costs more than its work.
        # Its shape-stable form (``depformer_step_fixed``): the steps' keys in buffers of a
        # fixed size, so one compilation serves every step; the concatenating form made three
        # (0, 1, then 2 or more steps so far: ~25 s of a first start on the H200 and ~6 s of
        # every restart, docs/PERFORMANCE.md, "Start-up budgets").
        self._depformer_step = compile_dynamic(depformer_step_fixed)
        # The step's weights are slices of parameters: plain tensors, so without the static
        # mark every dimension of each would be symbolic (``fastpath.compiled.static_shapes``).
        # Views: they follow the parameters' storage, which is loaded before this is called
        # and never replaced after.  The token table stays out (step 0's is the text table,
        # of another size: a second compilation), as do the steps' masks, built once here.
        steps = self.depformer_steps
        self._window = window
        self._step_weights = [static_shapes(_without_table(self.depformer_step_weights(k))) for k in range(steps)]
        position = torch.arange(steps, device=self.device)
        self._step_masks = [static_shapes((position == k, (position <= k) & (position >= first)))
                            for k, first in enumerate(self._first_visible_steps(steps))]

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.dtype

    @property
    def device(self) -> torch.device:
        return self.text_emb.device

    def weight_bytes(self) -> int:
        """Bytes the weights take on their device (fp8 ones with their scales)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def describe_weights(self) -> str:
        """One line for logs: size and format, e.g. "8.22 GB, fp8 e4m3 (scaled_mm products)"."""
        kind = f"fp8 e4m3 ({self.fp8_matmul} products)" if self.fp8_matmul else str(self.dtype).replace("torch.", "")
        return f"{self.weight_bytes() / 1e9:.2f} GB, {kind}"

    # Temporal transformer ---------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Summed input embedding [B, T, D] of ``tokens`` [B, T, 17]."""
        return self._embed_streams(self.emb, self.text_emb, tokens)

    def temporal(
        self,
        slots: torch.Tensor,
        x: torch.Tensor,
        kv: SlotKVRing | PromptKV,
        window: str = WindowMode.REFERENCE,
    ) -> torch.Tensor:
        """Run input embeddings ``x`` [B, T, D] of ``slots`` at their next positions.

        ``kv``: the sessions' ring, or the ``PromptKV`` of one prefill under way.

        Returns the normed hidden state [B, T, D] (what feeds the text head and the depformer)
        and advances the slots' KV cache by T.  Each token is one reference call, so in
        reference window mode a query at p sees keys down to p - (context - 2).
        """
        cfg = self.cfg
        T = x.shape[1]
        positions = kv.positions(slots, T)
        lo = window_start(positions, positions + 1, kv.capacity, window)
        tables = rope_tables(positions, cfg.head_dim, cfg.max_period)  # shared by all layers
        eps = cfg.norm_eps
        matmul = self.fp8_matmul or "w8a16"
        for i, layer in enumerate(self.layers):
            q, k, v = self._attention_input(x, layer.norm1, layer.in_proj, cfg.num_heads, eps, tables,
                                            layer.in_proj_scale, matmul)
            a = kv.attend(i, slots, q, k, v, positions, lo)
            x = self._attention_output_ffn(x, a, layer.out_proj, layer.norm2, layer.ffn_in, layer.ffn_out, eps,
                                           _output_scales(layer), matmul)
        kv.advance(slots, T)
        return rms_norm(x, self.out_norm, cfg.norm_eps)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.text_linear).float()

    # Depformer ----------------------------------------------------------------------------
    def depformer(
        self,
        hidden: torch.Tensor,
        first_token: torch.Tensor,
        forced: torch.Tensor,
        forced_mask: torch.Tensor,
        sample: Callable[[int, torch.Tensor], torch.Tensor],
        window: str = WindowMode.REFERENCE,
    ) -> torch.Tensor:
        """Autoregress over the codebooks of one frame.

        ``hidden`` [B, D] is the normed temporal output, ``first_token`` [B] the (forced or
        sampled) text token.  Step k's sample is replaced by ``forced[:, k]`` where
        ``forced_mask[:, k]`` before it feeds step k+1 (teacher forcing).  ``sample(k, logits)``
        draws step k's token from float32 logits [B, card].  Returns the samples [B, steps].
        """
        cfg = self.cfg
        B = hidden.shape[0]
        if self._step_weights is not None:
            return self._depformer_fixed(hidden, first_token, forced, forced_mask, sample, window)
        # The keys and values of the steps so far, per layer: [layers, B, H, steps so far, Dh].
        keys = hidden.new_zeros(cfg.depformer_num_layers, B, cfg.depformer_num_heads, 0, cfg.depformer_head_dim)
        values = keys
        samples = []
        prev = first_token
        for k in range(self.depformer_steps):
            logits, keys, values = self._depformer_step(hidden, prev, keys, values,
                                                        depformer_first_visible(k, cfg.dep_q, window),
                                                        self.depformer_step_weights(k), cfg.depformer_num_heads,
                                                        cfg.norm_eps, self.fp8_matmul or "w8a16")
            token = sample(k, logits)
            samples.append(token)
            prev = torch.where(forced_mask[:, k], forced[:, k], token)
        return torch.stack(samples, dim=1)

    def _depformer_fixed(self, hidden, first_token, forced, forced_mask, sample, window) -> torch.Tensor:
        """``depformer`` on the compiled path: ``depformer_step_fixed`` over key buffers of
        every step (zeros where a step has not written yet: masked out, and never NaN)."""
        cfg = self.cfg
        if window != self._window:
            raise ValueError(f"the compiled depformer was built for window {self._window!r}, not {window!r}")
        steps = self.depformer_steps
        shape = (cfg.depformer_num_layers, hidden.shape[0], cfg.depformer_num_heads, steps, cfg.depformer_head_dim)
        # Two tensors, not one twice: the compiled step guards on its inputs' aliasing, and
        # from step 1 on they are two.  Every dimension but the batch is the model's: static.
        keys, values = hidden.new_zeros(shape), hidden.new_zeros(shape)
        for buffer in (keys, values):
            for dim in (0, 2, 3, 4):
                torch._dynamo.mark_static(buffer, dim)
        samples = []
        prev = first_token
        for k in range(steps):
            table = self.depformer_text_emb if k == 0 else self.depformer_emb[k - 1]
            write, visible = self._step_masks[k]
            logits, keys, values = self._depformer_step(hidden, embed(table, prev), keys, values, write, visible,
                                                        self._step_weights[k], cfg.depformer_num_heads, cfg.norm_eps,
                                                        self.fp8_matmul or "w8a16")
            token = sample(k, logits)
            samples.append(token)
            prev = torch.where(forced_mask[:, k], forced[:, k], token)
        return torch.stack(samples, dim=1)

    def _first_visible_steps(self, steps: int) -> list[int]:
        return [depformer_first_visible(k, self.cfg.dep_q, self._window) for k in range(steps)]

    def depformer_step_weights(self, k: int) -> DepformerStepWeights:
        """``depformer_step``'s weights of codebook step ``k`` (views of the parameters)."""
        fp8 = self.fp8_matmul is not None
        layers = tuple(
            (layer.norm1, layer.in_proj[k], layer.in_proj_scale[k] if fp8 else None, layer.out_proj[k], layer.norm2,
             layer.ffn_in[k], layer.ffn_out[k], _output_scales(layer, k))
            for layer in self.depformer_layers)
        table = self.depformer_text_emb if k == 0 else self.depformer_emb[k - 1]
        return (self.depformer_in[k], self.depformer_in_scale[k] if fp8 else None, table, self.linears[k], layers)


# (input projection, its fp8 scales or None, token embedding table, output head, per layer:
# (norm1, in_proj, in_proj's scales, out_proj, norm2, ffn_in, ffn_out, the output scales)).
DepformerStepWeights = tuple


def _without_table(weights: DepformerStepWeights) -> tuple:
    in_proj, in_scale, _table, head, layers = weights
    return in_proj, in_scale, head, layers


def depformer_step_fixed(hidden: torch.Tensor, prev_embedding: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, write: torch.Tensor, visible: torch.Tensor, weights: tuple,
                         heads: int, eps: float, matmul: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``depformer_step`` with shapes that do not change from step to step (the compiled path):
    ``prev_embedding`` [B, Dd] is the previous token already embedded; ``keys``/``values``
    [layers, B, H, steps, Dh] hold every step's entry (those not written yet are zeros), this
    step writes its own where ``write`` [steps] is true and attends where ``visible`` [steps]
    is.  The same function as ``depformer_step`` up to rounding (masked entries weigh exactly
    zero; the sums run in another order): tests/test_depformer_step.py holds the two together.
    ``weights``: ``depformer_step``'s without the token table."""
    in_proj, in_scale, head, layers = weights
    x = (linear(hidden, in_proj, in_scale, matmul) + prev_embedding).unsqueeze(1)
    at_step = write.view(1, 1, -1, 1)
    mask = visible.view(1, 1, 1, -1)
    new_keys, new_values = [], []
    for i, (norm1, qkv, qkv_scale, out_proj, norm2, ffn_in, ffn_out, out_scales) in enumerate(layers):
        q, key, value = attention_input(x, norm1, qkv, heads, eps, None, qkv_scale, matmul)
        layer_keys = torch.where(at_step, key, keys[i])
        layer_values = torch.where(at_step, value, values[i])
        a = F.scaled_dot_product_attention(q, layer_keys, layer_values, attn_mask=mask)
        x = attention_output_ffn(x, a, out_proj, norm2, ffn_in, ffn_out, eps, out_scales, matmul)
        new_keys.append(layer_keys)
        new_values.append(layer_values)
    logits = linear(x[:, 0], head).float()
    return logits, torch.stack(new_keys), torch.stack(new_values)


def depformer_step(hidden: torch.Tensor, prev: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: int,
                   weights: DepformerStepWeights, heads: int, eps: float,
                   matmul: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One codebook step of the depformer, as one function of its weights so that one compiled
    version serves every step (``MoshiLM.compile_blocks``): the step's input (``hidden`` [B, D]
    projected, plus the embedding of the previous token ``prev`` [B]), its layers, and its
    head.  ``keys``/``values`` [layers, B, H, k, Dh] hold steps 0..k-1; the step attends to
    steps ``lo``..k.  Returns float32 logits [B, card] and the keys / values with step k
    appended (a new tensor, not a write into a buffer: the function stays pure, so the
    compiler is free to fuse the appends into the projections)."""
    in_proj, in_scale, table, head, layers = weights
    x = (linear(hidden, in_proj, in_scale, matmul) + embed(table, prev)).unsqueeze(1)
    new_keys, new_values = [], []
    for i, (norm1, qkv, qkv_scale, out_proj, norm2, ffn_in, ffn_out, out_scales) in enumerate(layers):
        q, key, value = attention_input(x, norm1, qkv, heads, eps, None, qkv_scale, matmul)
        visible_keys = torch.cat([keys[i], key], dim=2)[:, :, lo:]
        visible_values = torch.cat([values[i], value], dim=2)[:, :, lo:]
        a = F.scaled_dot_product_attention(q, visible_keys, visible_values)
        x = attention_output_ffn(x, a, out_proj, norm2, ffn_in, ffn_out, eps, out_scales, matmul)
        new_keys.append(key)
        new_values.append(value)
    logits = linear(x[:, 0], head).float()
    return logits, torch.cat([keys, torch.stack(new_keys)], dim=3), torch.cat([values, torch.stack(new_values)], dim=3)
