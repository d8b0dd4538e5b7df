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

from engines.interface import SlotFault
from engines.runtime.trtllm.layout import BuildMeta
from engines.runtime.trtllm.prompt_table import EngineCall, context_call, decode_call
from engines.runtime.trtllm.kv_blocks import SlotKVBlocks, SlotPositions, slot_index


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
        """Start ``slot``'s sequence over its system prompt ``embeddings`` [N, hidden].

        One context call over the first ``window`` positions at most: the engine's cyclic KV
        holds a window, and a context call does not attend through the ring.  A longer
        prompt (not the bundled ones: a few hundred positions against a window of 2999)
        goes on one generation call per position, as the tick's calls do."""
        n = int(embeddings.shape[0])
        if n > self.meta.max_prefill:
            raise ValueError(f"the system prompt has {n} positions; this engine was built for "
                             f"{self.meta.max_prefill} (convert with a larger --max-prefill)")
        self.positions.reset(slot)
        head = min(n, self.window)
        call = context_call(slot, embeddings[:head], self.meta.vocab_size)
        self.executor.run(call, self.blocks.offsets(call.slots))
        self.positions.start(slot, head)
        for t in range(head, n):
            self._decode([slot], embeddings[t : t + 1])

    def full_slots(self, slots: Sequence[int]) -> list[int]:
        """The slots of ``slots`` that have reached the engine's ``--max-positions``."""
        return self.positions.full(slots)

    def step(self, slots: Sequence[int], embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per slot; returns (text logits [B, text_vocab], hidden [B, hidden]).

        A slot past the engine's positions fails the call before anything runs, as a
        ``SlotFault`` naming only the full slots (none of the runner's state advanced).  The
        engine (``TrtllmEngine.run_tick``) leaves such slots out of its tick beforehand, so
        the others step; this is the check for any other caller."""
        full = self.full_slots(slots)
        if full:
            raise SlotFault(positions_exhausted(full, self.meta.max_positions), full)
        logits = self._decode(slots, embeddings)
        text = self.meta.text_vocab
        return logits[:, :text], logits[:, text : text + self.meta.hidden_rows]

    def _decode(self, slots: Sequence[int], embeddings: torch.Tensor) -> torch.Tensor:
        """One generation call: the next position of each of ``slots``; the engine's logits."""
        index = slot_index(slots)
        call = decode_call(slots, self.positions.length[index], self.positions.context[index], embeddings,
                           self.meta.vocab_size)
        logits = self.executor.run(call, self.blocks.offsets(index))
        self.positions.advance(index)
        return logits

    def release(self, slot: int) -> None:
        # Stale KV needs no wiping: the next context call of the slot starts at position 0
        # and a sequence never attends past its own length.
        self.positions.reset(slot)


def positions_exhausted(slots: Sequence[int], max_positions: int) -> str:
    return (f"slot(s) {list(slots)} reached the engine's {max_positions} positions "
            "(convert and build with a larger --max-positions for longer calls)")
