"""Per-call inputs of the Llama engine, driven through its prompt table (pure PyTorch/CPU).

The engine is built with ``--max_prompt_embedding_table_size``, so its embedding layer is
TensorRT-LLM's ``PromptTuningEmbedding``: a token id ``>= vocab_size`` is embedded as row
``tasks * prompt_vocab_size + (id - vocab_size)`` of the ``prompt_embedding_table`` input.
We feed every token as the fake id ``vocab_size`` with ``prompt_vocab_size = 1`` and
``tasks`` = the token's index in the call, so token ``j`` reads table row ``j``: the table
IS the call's input embeddings (spec/trtllm.md 3.2 A).  With ``remove_input_padding`` the
tokens of all sequences are packed, and ``tasks`` is per token.

The attention-plugin inputs follow what TensorRT-LLM 1.2.1's ``GenerationSession`` binds
(tensorrt_llm/runtime/generation.py): context requests carry their whole prompt and
``host_request_types = 0``; generation requests carry one token, ``host_request_types = 1``,
``host_past_key_value_lengths`` = positions already cached, ``sequence_length`` = that + 1.
``last_token_ids`` is the running sum of tokens per sequence (1-based index of each
sequence's last token), so the engine returns one row of logits per sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CONTEXT, GENERATION = 0, 1  # host_request_types

_i32 = {"dtype": torch.int32}


@dataclass(frozen=True)
class EngineCall:
    """One engine call.  Host-side int32 tensors except ``table`` (the embeddings, on the
    caller's device); ``slots`` name the sequences for the KV block table."""

    slots: tuple[int, ...]
    table: torch.Tensor  # prompt_embedding_table [num_tokens, hidden]
    input_ids: torch.Tensor  # [num_tokens]
    position_ids: torch.Tensor  # [num_tokens]
    tasks: torch.Tensor  # [num_tokens]
    prompt_vocab_size: torch.Tensor  # [1]
    context_lengths: torch.Tensor  # [batch]
    sequence_length: torch.Tensor  # [batch]
    past_key_value_lengths: torch.Tensor  # [batch]
    request_types: torch.Tensor  # [batch]
    last_token_ids: torch.Tensor  # [batch]

    @property
    def batch(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_context(self) -> bool:
        return bool((self.request_types == CONTEXT).all())

    def tokens_per_sequence(self) -> list[int]:
        ends = self.last_token_ids.tolist()
        return [e - s for s, e in zip([0] + ends[:-1], ends)]


def _prompt_ids(num_tokens: int, fake_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_ids = torch.full((num_tokens,), fake_id, **_i32)
    tasks = torch.arange(num_tokens, **_i32)
    return input_ids, tasks, torch.ones(1, **_i32)


def context_call(slot: int, embeddings: torch.Tensor, fake_id: int) -> EngineCall:
    """A fresh sequence for ``slot`` over ``embeddings`` [N, hidden] at positions 0..N-1."""
    n = int(embeddings.shape[0])
    if n < 1:
        raise ValueError("a context call needs at least one position")
    input_ids, tasks, vocab = _prompt_ids(n, fake_id)
    length = torch.tensor([n], **_i32)
    return EngineCall(
        slots=(slot,), table=embeddings, input_ids=input_ids, position_ids=torch.arange(n, **_i32), tasks=tasks,
        prompt_vocab_size=vocab, context_lengths=length, sequence_length=length.clone(),
        # What GenerationSession binds for a context request (the plugin ignores it there).
        past_key_value_lengths=length.clone(),
        request_types=torch.full((1,), CONTEXT, **_i32), last_token_ids=length.clone(),
    )


def decode_call(slots: Sequence[int], past_lengths: Sequence[int] | torch.Tensor,
                context_lengths: Sequence[int] | torch.Tensor, embeddings: torch.Tensor, fake_id: int) -> EngineCall:
    """One new position per slot: ``embeddings`` [B, hidden] at positions ``past_lengths``."""
    b = len(slots)
    if embeddings.shape[0] != b or len(past_lengths) != b or len(context_lengths) != b:
        raise ValueError("slots, lengths and embeddings must have one entry per sequence")
    if len(set(slots)) != b:
        raise ValueError("a slot may appear only once per call")
    input_ids, tasks, vocab, request_types, last_token_ids = _decode_constants(b, fake_id)
    past = torch.as_tensor(past_lengths, **_i32)
    return EngineCall(
        slots=tuple(slots), table=embeddings, input_ids=input_ids, position_ids=past, tasks=tasks,
        prompt_vocab_size=vocab, context_lengths=torch.as_tensor(context_lengths, **_i32),
        sequence_length=past + 1, past_key_value_lengths=past, request_types=request_types,
        last_token_ids=last_token_ids,
    )


@functools.lru_cache(maxsize=None)
def _decode_constants(batch: int, fake_id: int) -> tuple[torch.Tensor, ...]:
    """The inputs of a decode call that depend on its batch size only, made once per size
    (at most one per slot count) and shared by every call of that size: nobody writes an
    ``EngineCall``'s tensors."""
    input_ids, tasks, vocab = _prompt_ids(batch, fake_id)
    return input_ids, tasks, vocab, torch.full((batch,), GENERATION, **_i32), torch.arange(1, batch + 1, **_i32)
