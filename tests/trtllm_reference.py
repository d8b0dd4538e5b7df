"""A plain-PyTorch model of the TensorRT-LLM Llama engine the converter's checkpoint builds.

Written from TensorRT-LLM's documented checkpoint names and layer semantics only, never
from our model code (engines/model/lm.py), so it checks the conversion independently:

- embedding: ``PromptTuningEmbedding`` - ids >= vocab_size read row
  ``tasks * prompt_vocab_size + (id - vocab_size)`` of the prompt table;
- per layer: ``x + dense(attn(rope(qkv(RmsNorm(x)))))``, then
  ``x + proj(silu(fc(h)) * gate(h))`` with ``h = RmsNorm(x)`` (TRT-LLM's GatedMLP activates
  ``fc`` and multiplies by ``gate``);
- RmsNorm: ``x * rsqrt(mean(x^2) + norm_epsilon) * weight``;
- RoPE "rope_gpt_neox": rotate-half with ``inv_freq = rotary_base ** (-2i / head_size)``;
- attention: softmax(q k^T / sqrt(head_size)), causal, at most ``window`` keys (cyclic KV);
- ``ln_f`` then ``lm_head``.

``PagedExecutor`` runs ``EngineCall``s the way the engine does: KV in a paged pool addressed
through ``kv_cache_block_offsets``, a ring of ``window`` positions per sequence, per-token
tasks, context (type 0) and generation (type 1) requests, last-token logits per sequence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


class LlamaReference:
    def __init__(self, checkpoint_dir: Path) -> None:
        self.config = json.loads((checkpoint_dir / "config.json").read_text())
        assert self.config["architecture"] == "LlamaForCausalLM"
        assert self.config["position_embedding_type"] == "rope_gpt_neox"
        self.w = {k: v.float() for k, v in load_file(str(checkpoint_dir / "rank0.safetensors")).items()}
        c = self.config
        self.hidden = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c["num_key_value_heads"]
        self.head_size = c["head_size"]
        self.layers = c["num_hidden_layers"]
        self.vocab = c["vocab_size"]
        self.eps = c["norm_epsilon"]
        self.base = c["rotary_base"]

    # Layer pieces ---------------------------------------------------------------------------------
    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_size] at ``positions`` [T], rotate-half."""
        inv_freq = self.base ** (-torch.arange(0, self.head_size, 2, dtype=torch.float64) / self.head_size)
        angles = positions.double().view(-1, 1) * inv_freq.view(1, -1)
        cos = torch.cat([angles.cos(), angles.cos()], -1).float().unsqueeze(1)
        sin = torch.cat([angles.sin(), angles.sin()], -1).float().unsqueeze(1)
        x1, x2 = x[..., : self.head_size // 2], x[..., self.head_size // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor):
        p = f"transformer.layers.{i}."
        qkv = self.rms(x, p + "input_layernorm.weight") @ self.w[p + "attention.qkv.weight"].T
        q, k, v = qkv.split([self.heads * self.head_size, self.kv_heads * self.head_size,
                             self.kv_heads * self.head_size], -1)
        q = self.rope(q.view(-1, self.heads, self.head_size), positions)
        k = self.rope(k.view(-1, self.kv_heads, self.head_size), positions)
        return q, k, v.reshape(-1, self.kv_heads, self.head_size)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [T, H, d], keys/values [S, H, d], mask [T, S] (True = visible) -> [T, H*d]."""
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(self.head_size)
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(q.shape[0], -1)

    def finish_layer(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = f"transformer.layers.{i}."
        x = x + attn @ self.w[p + "attention.dense.weight"].T
        h = self.rms(x, p + "post_layernorm.weight")
        act = torch.nn.functional.silu(h @ self.w[p + "mlp.fc.weight"].T) * (h @ self.w[p + "mlp.gate.weight"].T)
        return x + act @ self.w[p + "mlp.proj.weight"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms(x, "transformer.ln_f.weight") @ self.w["lm_head.weight"].T

    def embed(self, input_ids, tasks, prompt_vocab_size, table) -> torch.Tensor:
        prompt = input_ids >= self.vocab
        rows = torch.where(prompt, tasks.long() * int(prompt_vocab_size[0]) + (input_ids.long() - self.vocab), 0)
        normal = self.w["transformer.vocab_embedding.weight"][torch.where(prompt, 0, input_ids.long())]
        return torch.where(prompt.unsqueeze(-1), table.float()[rows], normal)

    # Whole sequence, full causal attention -----------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input embeddings x [T, hidden] at positions 0..T-1 -> logits [T, vocab]."""
        T = x.shape[0]
        positions = torch.arange(T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(self.layers):
            q, k, v = self.qkv(i, x, positions)
            x = self.finish_layer(i, x, self.attend(q, k, v, causal))
        return self.logits(x)


class PagedExecutor:
    """Executes ``EngineCall``s like the engine: paged cyclic KV, prompt table, packed tokens."""

    def __init__(self, ref: LlamaReference, num_blocks: int, tokens_per_block: int, window: int) -> None:
        self.ref = ref
        self.tokens_per_block = tokens_per_block
        self.window = window
        self.pool = torch.zeros(num_blocks, ref.layers, 2, ref.kv_heads, tokens_per_block, ref.head_size)
        self.calls = []

    def _address(self, offsets: torch.Tensor, field: int, position: int) -> tuple[int, int]:
        """(block, row) of ``position`` for one sequence's offsets [2, blocks]: a ring of ``window``."""
        ring = position % self.window
        entry = int(offsets[field, ring // self.tokens_per_block])
        assert entry % 2 == field, "K entries are even, V entries odd"
        return entry // (2 * self.ref.layers), ring % self.tokens_per_block

    def _read(self, offsets: torch.Tensor, layer: int, field: int, position: int) -> torch.Tensor:
        block, row = self._address(offsets, field, position)
        return self.pool[block, layer, field, :, row]

    def run(self, call, block_offsets: torch.Tensor) -> torch.Tensor:
        self.calls.append(call)
        ref = self.ref
        x_all = ref.embed(call.input_ids, call.tasks, call.prompt_vocab_size, call.table)
        out, start = [], 0
        for b, n in enumerate(call.tokens_per_sequence()):
            context = int(call.request_types[b]) == 0
            past = 0 if context else int(call.past_key_value_lengths[b])
            assert int(call.sequence_length[b]) == past + n
            offsets = block_offsets[0, b]
            for t in range(n):
                pos = past + t
                assert int(call.position_ids[start + t]) == pos
                x = x_all[start + t : start + t + 1]
                visible = list(range(max(0, pos - self.window + 1), pos + 1))
                for i in range(ref.layers):
                    q, k, v = ref.qkv(i, x, torch.tensor([pos]))
                    for field, value in ((0, k[0]), (1, v[0])):
                        block, row = self._address(offsets, field, pos)
                        self.pool[block, i, field, :, row] = value
                    keys, values = (torch.stack([self._read(offsets, i, field, p) for p in visible]) for field in (0, 1))
                    x = ref.finish_layer(i, x, ref.attend(q, keys, values, torch.ones(1, len(visible), dtype=torch.bool)))
            out.append(ref.logits(x)[0])
            start += n
        assert start == call.num_tokens
        return torch.stack(out)
