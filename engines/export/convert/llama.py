"""Moshi's temporal transformer as a TensorRT-LLM ``LlamaForCausalLM`` checkpoint.

The mapping (spec/trtllm.md 2.3-2.4, checked against the TRT-LLM Llama layer semantics by
``tests/test_convert_checkpoint.py``, which re-implements them independently):

- ``norm1/norm2.alpha`` -> ``input_layernorm`` / ``post_layernorm`` (RMSNorm, eps 1e-8);
- ``self_attn.in_proj_weight`` [q; k; v] -> ``attention.qkv``, with the q and k rows of
  every head reordered even dims first: Moshi rotates interleaved pairs (2i, 2i+1), the
  Llama kernels ("rope_gpt_neox") rotate half-split pairs (i, i + D/2), and the same
  permutation on q and k leaves every q.k dot product unchanged;
- ``gating.linear_in`` rows [0, H) are the SiLU branch -> ``mlp.fc`` (TRT-LLM applies the
  activation to ``fc`` and multiplies by ``gate``), rows [H, 2H) -> ``mlp.gate``;
  ``gating.linear_out`` -> ``mlp.proj``;
- ``out_norm`` -> ``ln_f``; ``text_linear`` -> the first ``text_card`` rows of ``lm_head``.

``lm_head`` gets ``dim`` more rows, an identity: logits ``[text_card, text_card + dim)``
are the normed hidden state, which the depformer consumes (no hidden-state output exists on
a stock Llama engine).  ``vocab_embedding`` is never read: every input id is the fake id
``vocab_size``, so each position's embedding comes from the prompt table (the 17-stream sum
computed outside the engine).  It holds the text table rows for completeness.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engines.checkpoints.loader import SafetensorsReader, lm_io_tensors, temporal_layer_tensors
from engines.config import BUILD_DTYPES, BUILD_KV_CACHE_DTYPES, LMConfig
from engines.export.convert.safetensors_stream import TensorSpec

ARCHITECTURE = "LlamaForCausalLM"
DTYPES = {name: getattr(torch, name) for name in BUILD_DTYPES}
KV_CACHE_DTYPES = BUILD_KV_CACHE_DTYPES


def half_split_order(head_dim: int) -> torch.Tensor:
    """Row order turning interleaved RoPE pairs into half-split ones: [0, 2, ..., 1, 3, ...]."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_qk_rows(in_proj: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the q and k rows of a fused [q; k; v] projection per head (v untouched)."""
    dim = num_heads * head_dim
    if in_proj.shape[0] != 3 * dim:
        raise ValueError(f"in_proj has {in_proj.shape[0]} rows, expected {3 * dim}")
    order = half_split_order(head_dim)
    q, k, v = in_proj.split(dim)

    def per_head(w: torch.Tensor) -> torch.Tensor:
        return w.view(num_heads, head_dim, -1)[:, order].reshape(dim, -1)

    return torch.cat([per_head(q), per_head(k), v])


def vocab_layout(cfg: LMConfig) -> tuple[int, int]:
    """(text rows, hidden rows) of the engine's output vocabulary."""
    return cfg.text_card, cfg.dim


def llama_config(cfg: LMConfig, *, dtype: str, kv_cache_dtype: str, max_positions: int) -> dict:
    """The checkpoint's ``config.json`` (PretrainedConfig / LLaMAConfig fields)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    text_rows, hidden_rows = vocab_layout(cfg)
    return {
        "architecture": ARCHITECTURE,
        "dtype": dtype,
        # The hidden-state rows must not be rounded to float16 on their way out.
        "logits_dtype": "float32",
        "vocab_size": text_rows + hidden_rows,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden,
        "hidden_act": "silu",
        "norm_epsilon": cfg.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": float(cfg.max_period),
        "rotary_scaling": None,
        "max_position_embeddings": max_positions,
        "mlp_bias": False,
        "attn_bias": False,
        "tie_word_embeddings": False,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {
            "quant_algo": None,
            "kv_cache_quant_algo": "FP8" if kv_cache_dtype == "fp8" else None,
        },
        # Unknown keys are kept by PretrainedConfig; ours document the non-Llama parts.
        "personaplex": {
            "source": "Moshi/PersonaPlex temporal transformer",
            "rope": "interleaved pairs mapped to rotate-half by permuting q/k rows per head",
            "text_vocab": text_rows,
            "hidden_rows": hidden_rows,
            "input_ids": "every id is vocab_size: input embeddings come from the prompt table",
            "context": cfg.context,
        },
    }


def tensor_specs(cfg: LMConfig, dtype: str, kv_cache_dtype: str) -> list[TensorSpec]:
    """Names, shapes and dtypes of ``rank0.safetensors``, in file order."""
    t = DTYPES[dtype]
    d, h = cfg.dim, cfg.ffn_hidden
    vocab = sum(vocab_layout(cfg))
    specs = [TensorSpec("transformer.vocab_embedding.weight", (vocab, d), t)]
    for i in range(cfg.num_layers):
        p = f"transformer.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), t),
            TensorSpec(p + "attention.qkv.weight", (3 * d, d), t),
            TensorSpec(p + "attention.dense.weight", (d, d), t),
            TensorSpec(p + "post_layernorm.weight", (d,), t),
            TensorSpec(p + "mlp.fc.weight", (h, d), t),
            TensorSpec(p + "mlp.gate.weight", (h, d), t),
            TensorSpec(p + "mlp.proj.weight", (d, h), t),
        ]
        if kv_cache_dtype == "fp8":
            specs.append(TensorSpec(p + "attention.kv_cache_scaling_factor", (1,), torch.float32))
    specs += [TensorSpec("transformer.ln_f.weight", (d,), t), TensorSpec("lm_head.weight", (vocab, d), t)]
    return specs


def llama_tensors(reader: SafetensorsReader, cfg: LMConfig, dtype: str, kv_cache_dtype: str,
                  kv_cache_scale: float = 1.0, on_layer=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Produce the checkpoint tensors in ``tensor_specs`` order, one layer in memory at a time.

    ``kv_cache_scale`` is the FP8 KV scale of every layer (uncalibrated: K and V are stored
    as value / scale in e4m3, whose range is +-448).  ``on_layer()`` is called after each
    layer (progress reporting).
    """
    t = DTYPES[dtype]
    cast = lambda x: x.to(t).contiguous()
    d, h = cfg.dim, cfg.ffn_hidden
    io = lm_io_tensors(reader, cfg)
    text_rows, hidden_rows = vocab_layout(cfg)
    embedding = torch.cat([io["text_emb"][:text_rows].float(), torch.zeros(hidden_rows, d)])
    yield "transformer.vocab_embedding.weight", cast(embedding)
    del embedding
    for i in range(cfg.num_layers):
        w = temporal_layer_tensors(reader, cfg, i)
        p = f"transformer.layers.{i}."
        yield p + "input_layernorm.weight", cast(w["norm1"])
        yield p + "attention.qkv.weight", cast(permute_qk_rows(w["in_proj"], cfg.num_heads, cfg.head_dim))
        yield p + "attention.dense.weight", cast(w["out_proj"])
        yield p + "post_layernorm.weight", cast(w["norm2"])
        yield p + "mlp.fc.weight", cast(w["ffn_in"][:h])
        yield p + "mlp.gate.weight", cast(w["ffn_in"][h:])
        yield p + "mlp.proj.weight", cast(w["ffn_out"])
        if kv_cache_dtype == "fp8":
            yield p + "attention.kv_cache_scaling_factor", torch.tensor([kv_cache_scale], dtype=torch.float32)
        if on_layer is not None:
            on_layer()
    yield "transformer.ln_f.weight", cast(io["out_norm"])
    head = torch.cat([io["text_linear"].float(), torch.eye(hidden_rows, d)])
    yield "lm_head.weight", cast(head)
