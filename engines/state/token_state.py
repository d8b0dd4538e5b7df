"""PersonaPlex's delayed-token bookkeeping, batched over slots (spec/model.md section 3).

Each slot keeps a ring of 4 timeline positions x 17 streams (text, 8 agent codebooks,
8 user codebooks) plus a "provided" flag per entry for teacher forcing, and its ``offset``
(the target position of its next call).  Stream k's token for frame f lives at position
f + delay_k.  A call at offset s feeds position s-1 to the model, predicts position s, and
(from s = 2 on) emits the de-delayed frame s-1.
"""

from __future__ import annotations

import torch

from engines.config import LMConfig

RING = 4  # max_delay + 3 positions, as in the reference


class TokenState:
    def __init__(self, cfg: LMConfig, num_slots: int, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.delays = torch.tensor(cfg.delays, device=device, dtype=torch.long)
        self.initial = torch.tensor(cfg.initial_tokens(), device=device, dtype=torch.long)
        self.cache = torch.full((num_slots, cfg.num_streams, RING), -2, device=device, dtype=torch.long)
        self.provided = torch.zeros((num_slots, cfg.num_streams, RING), device=device, dtype=torch.bool)
        self.offset = torch.zeros(num_slots, device=device, dtype=torch.long)
        # A device-side False: assigning a Python scalar through advanced indexing copies a
        # CPU tensor, which CUDA graph capture forbids.
        self._false = torch.zeros((), device=device, dtype=torch.bool)

    def reset(self, slots: torch.Tensor) -> None:
        self.cache[slots] = -2  # the "ungenerated" marker; never reaches the model
        self.provided[slots] = False
        self.offset[slots] = 0

    def _rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        streams = torch.arange(self.cfg.num_streams, device=slots.device)
        return slots.view(-1, 1), streams.view(1, -1)

    def force(self, slots: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        """Teacher-force ``tokens`` [B, 17] where ``mask`` [B, 17]: each stream's token of
        this call's frame goes to position offset + delay."""
        s, k = self._rows(slots)
        pos = torch.remainder(self.offset[slots].view(-1, 1) + self.delays.view(1, -1), RING)
        self.cache[s, k, pos] = torch.where(mask, tokens, self.cache[s, k, pos])
        self.provided[s, k, pos] |= mask

    def begin_call(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Apply the start-of-stream rule and return (input, target, target_provided), each
        [B, 17]: the model input at position offset-1 and what is forced at position offset.

        At offset <= delay_k stream k's entry at ``offset`` is replaced by its initial token
        (so the first frame a session is given is discarded).  Slots at offset 0 make no model
        call: callers must use ``skip_call`` for them instead.
        """
        s, k = self._rows(slots)
        off = self.offset[slots].view(-1, 1)
        at_start = off <= self.delays.view(1, -1)
        cur = torch.remainder(off, RING).expand_as(at_start)
        self.cache[s, k, cur] = torch.where(at_start, self.initial.view(1, -1), self.cache[s, k, cur])
        self.provided[s, k, cur] |= at_start
        prev = torch.remainder(off - 1, RING).expand_as(at_start)
        return self.cache[s, k, prev], self.cache[s, k, cur], self.provided[s, k, cur]

    def skip_call(self, slots: torch.Tensor) -> None:
        """The offset-0 call: only initial tokens are written; no model call, no output."""
        s, k = self._rows(slots)
        self.cache[s, k, 0] = self.initial.view(1, -1)
        self.provided[s, k, 0] = True
        self.offset[slots] += 1

    def end_call(self, slots: torch.Tensor, text: torch.Tensor, audio: torch.Tensor,
                 live: bool = False) -> torch.Tensor | None:
        """Store the samples (text [B], audio [B, n]) where not forced and advance.

        Returns the de-delayed frame s-1 [B, 17], or None while offset <= max_delay (all slots
        of one call must be in the same phase, which the engine guarantees).  ``live`` slots
        are known to be past start-up: no check, no host synchronisation.
        """
        s, k = self._rows(slots)
        off = self.offset[slots]
        prev = torch.remainder(off - 1, RING)
        cur = torch.remainder(off, RING)
        self.provided[slots.view(-1, 1), k, prev.view(-1, 1)] = self._false
        n = audio.shape[1]
        samples = torch.cat([text.view(-1, 1), audio], dim=1)  # streams 0..n
        rows = k[:, : n + 1]
        cur_b = cur.view(-1, 1).expand(-1, n + 1)
        keep = self.provided[s, rows, cur_b]
        self.cache[s, rows, cur_b] = torch.where(keep, self.cache[s, rows, cur_b], samples)
        emit = live or bool((off > self.cfg.max_delay).all())
        if not emit and bool((off > self.cfg.max_delay).any()):
            raise RuntimeError("slots in different start-up phases cannot share a call")
        out = None
        if emit:
            pos = torch.remainder(off.view(-1, 1) - self.cfg.max_delay + self.delays.view(1, -1), RING)
            out = self.cache[s, k, pos]
        self.offset[slots] += 1
        return out

    # Snapshots used by the prefill cache --------------------------------------------------
    def snapshot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.cache[slot].clone(), self.provided[slot].clone(), int(self.offset[slot])

    def restore(self, slot: int, cache: torch.Tensor, provided: torch.Tensor, offset: int) -> None:
        self.cache[slot] = cache.to(self.cache.device)
        self.provided[slot] = provided.to(self.provided.device)
        self.offset[slot] = offset
