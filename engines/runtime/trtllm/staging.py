"""An engine call's integer inputs, staged through one host buffer and one copy (pure PyTorch).

Every engine call binds ten small int32 inputs that change from call to call (token ids,
positions, lengths, the KV block table, ...).  Copying each from a fresh pageable CPU tensor
costs one synchronising copy apiece; instead ``InputStaging`` writes a call's values into one
host buffer allocated once (pinned on CUDA, so that a copy from it can be asynchronous) and
moves the part the device reads with one ``non_blocking`` copy into one device buffer, also
allocated once.  Every input is a view into one of the two buffers: the device inputs of the
device buffer, the ``host_*`` inputs (read by TensorRT on the CPU) of the host buffer.

Per call shape (tokens, sequences) the buffers hold the device inputs first, so the copy is
one prefix, then the host-only ones.  Each section starts a multiple of 256 bytes into its
buffer: TensorRT wants every tensor address 256-byte aligned
(``IExecutionContext::setTensorAddress``), and both allocations are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

ALIGN = 256 // 4  # int32 elements per 256 bytes

TOKENS, SEQUENCES, ONE, BLOCKS = "tokens", "sequences", "one", "blocks"
# (input, extent) in buffer order.  The device reads these: one copy moves their sections.
DEVICE_INPUTS = (
    ("input_ids", TOKENS), ("position_ids", TOKENS), ("tasks", TOKENS), ("last_token_ids", SEQUENCES),
    ("context_lengths", SEQUENCES), ("sequence_length", SEQUENCES), ("prompt_vocab_size", ONE),
    ("kv_cache_block_offsets", BLOCKS),
)
# Read on the host only: after the copied prefix, never copied.
HOST_INPUTS = (("host_request_types", SEQUENCES), ("host_past_key_value_lengths", SEQUENCES))
# Host inputs that hold the same values as a device input: a view of that input's host section.
HOST_TWINS = {"host_context_lengths": "context_lengths", "host_kv_cache_block_offsets": "kv_cache_block_offsets"}
STAGED_VALUES = tuple(name for name, _ in DEVICE_INPUTS + HOST_INPUTS)

Sections = dict[str, tuple[int, tuple[int, ...]]]  # input -> (offset in int32 elements, shape)


class Fence(Protocol):
    """A point in the device's work: ``record`` marks it, ``wait`` blocks the host until the
    device has passed the last recorded one (``torch.cuda.Event`` semantics)."""

    def record(self) -> None: ...

    def wait(self) -> None: ...


class StreamFence:
    """A CUDA event recorded on ``device``'s current stream (the one the engine runs on)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event()

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        self.event.synchronize()  # returns at once if never recorded


class NoFence:
    """Without CUDA every copy is synchronous: nothing is ever in flight."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


def input_shape(extent: str, tokens: int, batch: int, blocks_per_slot: int) -> tuple[int, ...]:
    """The shape of an input of ``extent`` in a call of ``tokens`` tokens over ``batch`` sequences."""
    return {TOKENS: (tokens,), SEQUENCES: (batch,), ONE: (1,), BLOCKS: (1, batch, 2, blocks_per_slot)}[extent]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def section_layout(tokens: int, batch: int, blocks_per_slot: int) -> tuple[Sections, int, int]:
    """{input: (offset, shape)} in int32 elements, the device prefix's length and the total."""
    sections, offset, device_end = {}, 0, 0
    for name, extent in DEVICE_INPUTS + HOST_INPUTS:
        shape = input_shape(extent, tokens, batch, blocks_per_slot)
        sections[name] = (offset, shape)
        offset += _aligned(math.prod(shape))
        if name == DEVICE_INPUTS[-1][0]:
            device_end = offset
    return sections, device_end, offset


@dataclass(frozen=True)
class StagedShape:
    """The views of one call shape, made once and reused by every call of that shape."""

    host: dict[str, torch.Tensor]  # every staged value's host section
    inputs: dict[str, torch.Tensor]  # by engine input name: device views, then host-only views
    host_prefix: torch.Tensor  # what the one copy moves ...
    device_prefix: torch.Tensor  # ... and where to


class InputStaging:
    """One host buffer and one device buffer for the per-call inputs of calls up to
    ``max_tokens`` tokens over up to ``max_batch`` sequences."""

    def __init__(self, max_tokens: int, max_batch: int, blocks_per_slot: int, device: torch.device,
                 fence: Fence | None = None) -> None:
        self.max_tokens, self.max_batch, self.blocks_per_slot = max_tokens, max_batch, blocks_per_slot
        _, device_size, total = section_layout(max_tokens, max_batch, blocks_per_slot)
        pinned = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pinned)
        self.device_buffer = torch.zeros(device_size, dtype=torch.int32, device=device)
        self.fence: Fence = fence if fence is not None else StreamFence(device) if pinned else NoFence()
        # At most one entry per call shape: (n, 1) for context calls, (b, b) for decode calls.
        self._shapes: dict[tuple[int, int], StagedShape] = {}

    def _shape(self, tokens: int, batch: int) -> StagedShape:
        staged = self._shapes.get((tokens, batch))
        if staged is None:
            if not (1 <= tokens <= self.max_tokens and 1 <= batch <= self.max_batch):
                raise ValueError(f"a call of {tokens} tokens over {batch} sequences does not fit the staging "
                                 f"buffers ({self.max_tokens} tokens, {self.max_batch} sequences)")
            staged = self._shapes[(tokens, batch)] = self._views(tokens, batch)
        return staged

    def _views(self, tokens: int, batch: int) -> StagedShape:
        sections, device_end, _ = section_layout(tokens, batch, self.blocks_per_slot)

        def view(buffer: torch.Tensor, name: str) -> torch.Tensor:
            offset, shape = sections[name]
            return buffer[offset : offset + math.prod(shape)].view(shape)

        host = {name: view(self.host, name) for name in STAGED_VALUES}
        inputs = {name: view(self.device_buffer, name) for name, _ in DEVICE_INPUTS}
        inputs.update({name: host[name] for name, _ in HOST_INPUTS})
        inputs.update({twin: host[name] for twin, name in HOST_TWINS.items()})
        return StagedShape(host, inputs, self.host[:device_end], self.device_buffer[:device_end])

    def stage(self, values: Mapping[str, torch.Tensor], tokens: int, batch: int) -> Mapping[str, torch.Tensor]:
        """Write ``values`` (one per ``STAGED_VALUES`` name, host int32) and start their one
        copy to the device; returns the inputs by engine name (views, valid until the next call;
        the mapping itself is this shape's, to read, not to change).

        The host buffer is rewritten only once the device is past the previous call's use of it
        (``fence.wait()`` first): an asynchronous copy still reading the buffer, or a call
        still reading its host inputs, would otherwise see the next call's values.  The fence
        is recorded right after the copy, and again by the executor after the engine call.
        The device buffer needs no such wait: its next copy is queued on the stream that runs
        the engine, behind the call that reads it.
        """
        staged = self._shape(tokens, batch)
        self.fence.wait()
        for name, section in staged.host.items():
            value = values[name]
            if value.shape != section.shape:  # copy_ would broadcast a wrong shape silently
                raise ValueError(f"{name}: shape {tuple(value.shape)}, the call needs {tuple(section.shape)}")
            section.copy_(value)
        staged.device_prefix.copy_(staged.host_prefix, non_blocking=True)
        self.fence.record()
        return staged.inputs
