"""The temporal transformer as a per-slot stepper over a Llama engine.

``TemporalRunner`` owns the slot bookkeeping (KV blocks, positions), builds each call's
prompt-table inputs and splits the engine's logits into the text logits and the normed
hidden state (the identity rows of the converted ``lm_head``).  Executing a call is the
``Executor``'s job: ``engines.runtime.trtllm.runtime.TrtllmExecutor`` on a TensorRT-LLM machine,
a plain-PyTorch model of the same engine in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engines.runtime.trtllm.layout import BuildMeta
from engines.runtime.trtllm.prompt_table import EngineCall, context_call, decode_call
from engines.runtime.trtllm.kv_blocks import SlotKVBlocks, SlotPositions


class Executor(Protocol):
    tokens_per_block: int

    def run(self, call: EngineCall, block_offsets: torch.Tensor) -> torch.Tensor:
        """Execute ``call``; float32 logits [batch, vocab_size], one row per sequence."""


class TemporalRunner:
    def __init__(self, executor: Executor, meta: BuildMeta, num_slots: int, window: int) -> None:
        self.executor = executor
        self.meta = meta
        self.window = window
        self.blocks = SlotKVBlocks(num_slots, window, executor.tokens_per_block, meta.num_layers)
        self.positions = SlotPositions(num_slots, meta.max_positions)

    def prefill(self, slot: int, embeddings: torch.Tensor) -> None:
        """Start ``slot``'s sequence over its system prompt ``embeddings`` [N, hidden]."""
        n = int(embeddings.shape[0])
        if n > self.meta.max_prefill:
            raise ValueError(f"the system prompt has {n} positions; this engine was built for "
                             f"{self.meta.max_prefill} (convert with a larger --max-prefill)")
        self.positions.reset(slot)
        call = context_call(slot, embeddings, self.meta.vocab_size)
        self.executor.run(call, self.blocks.offsets(call.slots))
        self.positions.start(slot, n)

    def step(self, slots: Sequence[int], embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per slot; returns (text logits [B, text_vocab], hidden [B, hidden])."""
        self.positions.check_room(slots)
        call = decode_call(slots, [self.positions.length[s] for s in slots],
                           [self.positions.context[s] for s in slots], embeddings, self.meta.vocab_size)
        logits = self.executor.run(call, self.blocks.offsets(call.slots))
        self.positions.advance(slots)
        text = self.meta.text_vocab
        return logits[:, :text], logits[:, text : text + self.meta.hidden_rows]

    def release(self, slot: int) -> None:
        # Stale KV needs no wiping: the next context call of the slot starts at position 0
        # and a sequence never attends past its own length.
        self.positions.reset(slot)
