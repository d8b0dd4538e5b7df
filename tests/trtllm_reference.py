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

``PagedExecutor`` runs engine calls the way the engine does, from the inputs the runtime's
own ``EngineBindings._bindings`` builds for them: KV in a paged pool addressed through
``kv_cache_block_offsets``, a ring of ``window`` positions per sequence, per-token tasks,
context (type 0) and generation (type 1) requests, last-token logits per sequence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.runtime.trtllm.kv_blocks import blocks_per_slot
from engines.runtime.trtllm.layout import BuildMeta
from engines.runtime.trtllm.runtime import EngineBindings


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


def engine_inputs(tokens: int, batch: int, *, layers: int, window: int, blocks: int, hidden: int,
                  dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...], bool]]:
    """What a Llama engine built with the GPT attention plugin, paged KV (one pool),
    ``remove_input_padding`` and a prompt table takes for a call of ``tokens`` tokens over
    ``batch`` sequences, by input name: (dtype, shape, read on the host), from TensorRT-LLM's
    documented inputs (``GenerationSession`` / the attention plugin's ``host_*`` tensors).
    ``blocks``: KV blocks per sequence; ``window``: the cyclic KV length."""
    i32, i64 = torch.int32, torch.int64
    per_token, per_seq = (tokens,), (batch,)
    offsets = (1, batch, 2, blocks)  # [pools, sequences, K/V, blocks]
    return {
        "input_ids": (i32, per_token, False), "position_ids": (i32, per_token, False), "tasks": (i32, per_token, False),
        "prompt_vocab_size": (i32, (1,), False), "prompt_embedding_table": (dtype, (tokens, hidden), False),
        "last_token_ids": (i32, per_seq, False), "context_lengths": (i32, per_seq, False),
        "sequence_length": (i32, per_seq, False), "cache_indirection": (i32, (batch, 1, window), False),
        "kv_cache_block_offsets": (i32, offsets, False), "host_kv_cache_block_offsets": (i32, offsets, True),
        "host_context_lengths": (i32, per_seq, True), "host_request_types": (i32, per_seq, True),
        "host_past_key_value_lengths": (i32, per_seq, True), "host_max_attention_window_sizes": (i32, (layers,), True),
        "host_sink_token_length": (i32, (1,), True), "host_kv_cache_pool_pointers": (i64, (1, 2), True),
        "host_kv_cache_pool_mapping": (i32, (layers, 2), True), "host_runtime_perf_knobs": (i64, (16,), True),
        "host_context_progress": (i64, (1,), True),
    }


class PagedExecutor:
    """Executes engine calls like the engine: from exactly the inputs the runtime binds
    (``EngineBindings._bindings``, the method ``TrtllmExecutor.run`` binds from), read by
    name, with the KV in a paged pool addressed through the bound block offsets, a ring of
    the bound window per sequence, per-token tasks, context (type 0) and generation (type 1)
    requests, last-token logits per sequence.  Every call's inputs are first checked against
    ``engine_inputs``."""

    def __init__(self, ref: LlamaReference, meta: BuildMeta, num_slots: int, window: int,
                 tokens_per_block: int) -> None:
        self.ref = ref
        self.tokens_per_block = tokens_per_block
        blocks = num_slots * blocks_per_slot(window, tokens_per_block)
        self.pool = torch.zeros(blocks, ref.layers, 2, ref.kv_heads, tokens_per_block, ref.head_size)
        self.bindings = EngineBindings(meta, num_slots, window, tokens_per_block, self.pool)
        self.calls = []

    def run(self, call, block_offsets: torch.Tensor) -> torch.Tensor:
        self.calls.append(call)
        inputs = self.bindings._bindings(call, block_offsets)
        self.check(inputs)
        return self.execute(inputs)

    def check(self, inputs: dict[str, torch.Tensor]) -> None:
        """Names, dtypes, shapes and where each input lives, as the engine declares them."""
        b = self.bindings
        tokens, batch = inputs["input_ids"].shape[0], inputs["last_token_ids"].shape[0]
        want = engine_inputs(tokens, batch, layers=self.ref.layers, window=b.window, hidden=self.ref.hidden,
                             blocks=b.staging.blocks_per_slot, dtype=getattr(torch, b.meta.dtype))
        assert set(inputs) == set(want), (sorted(set(inputs) - set(want)), sorted(set(want) - set(inputs)))
        for name, (dtype, shape, on_host) in want.items():
            value = inputs[name]
            assert (value.dtype, tuple(value.shape)) == (dtype, shape), (name, value.dtype, tuple(value.shape))
            assert value.device == (torch.device("cpu") if on_host else b.device), (name, value.device)
        # The host twins hold what the device reads.
        for host, device in (("host_context_lengths", "context_lengths"),
                             ("host_kv_cache_block_offsets", "kv_cache_block_offsets")):
            assert torch.equal(inputs[host], inputs[device]), f"{device} on the device differs from {host}"

    def _address(self, offsets: torch.Tensor, field: int, position: int, window: int) -> tuple[int, int]:
        """(block, row) of ``position`` for one sequence's offsets [2, blocks]: a ring of ``window``."""
        ring = position % window
        entry = int(offsets[field, ring // self.tokens_per_block])
        assert entry % 2 == field, "K entries are even, V entries odd"
        return entry // (2 * self.ref.layers), ring % self.tokens_per_block

    def execute(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ref = self.ref
        assert int(inputs["host_kv_cache_pool_pointers"][0, 0]) == self.pool.data_ptr()
        assert inputs["host_kv_cache_pool_mapping"].tolist() == [[0, i] for i in range(ref.layers)]
        windows = inputs["host_max_attention_window_sizes"].tolist()
        assert int(inputs["host_sink_token_length"][0]) == 0 and not inputs["cache_indirection"].any()
        x_all = ref.embed(inputs["input_ids"], inputs["tasks"], inputs["prompt_vocab_size"],
                          inputs["prompt_embedding_table"])
        ends = inputs["last_token_ids"].tolist()
        out = []
        for b, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            n = end - start
            context = int(inputs["host_request_types"][b]) == 0
            past = 0 if context else int(inputs["host_past_key_value_lengths"][b])
            assert int(inputs["sequence_length"][b]) == past + n
            assert not context or int(inputs["context_lengths"][b]) == n
            offsets = inputs["kv_cache_block_offsets"][0, b]
            for t in range(n):
                pos = past + t
                assert int(inputs["position_ids"][start + t]) == pos
                x = x_all[start + t : start + t + 1]
                for i in range(ref.layers):
                    x = self._layer(i, x, pos, offsets, windows[i])
            out.append(ref.logits(x)[0])
        assert ends[-1] == inputs["input_ids"].shape[0]
        return torch.stack(out)

    def _layer(self, i: int, x: torch.Tensor, pos: int, offsets: torch.Tensor, window: int) -> torch.Tensor:
        """Layer ``i`` for one token at ``pos``: write its K and V into the ring, attend over
        the last ``window`` positions (itself included)."""
        ref = self.ref
        q, k, v = ref.qkv(i, x, torch.tensor([pos]))
        for field, value in ((0, k[0]), (1, v[0])):
            block, row = self._address(offsets, field, pos, window)
            self.pool[block, i, field, :, row] = value
        visible = range(max(0, pos - window + 1), pos + 1)
        keys, values = (torch.stack([self._read(offsets, i, field, p, window) for p in visible]) for field in (0, 1))
        return ref.finish_layer(i, x, ref.attend(q, keys, values, torch.ones(1, len(visible), dtype=torch.bool)))

    def _read(self, offsets: torch.Tensor, layer: int, field: int, position: int, window: int) -> torch.Tensor:
        block, row = self._address(offsets, field, position, window)
        return self.pool[block, layer, field, :, row]
