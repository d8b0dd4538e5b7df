"""CUDA graphs of the prefill pass, one per padded prompt length.

A cold prefill (a new voice + persona) runs the temporal transformer once over a few
hundred prompt positions.  Eagerly that is ~1,500 kernel launches, so the pass is bound by
the host issuing them (tens of ms on the engine thread, during which live ticks wait), not
by the GPU.  Replaying a graph issues the whole pass at once.

Prompts are padded at the end to a bucket length.  The pass is causal and starts from an
empty cache, so padding positions never influence the real ones: the keys/values of
positions ``0..n-1`` are the same as an unpadded pass would give (the graph's own
rounding aside), and only those are returned.  Buckets longer than the cache's capacity are
not used (the ring would wrap over the real positions): such prompts run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [1, bucket, D] input embeddings (zero padded)
    keys: torch.Tensor  # [layers, H, bucket, Dh]
    values: torch.Tensor


class PrefillGraphs:
    def __init__(self, lm, kv, window: str, scratch_slot: int, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.lm = lm
        self.kv = kv
        self.window = window
        self.buckets = tuple(b for b in sorted(buckets) if b <= kv.capacity)
        self._slot = torch.tensor([scratch_slot], device=lm.device)
        self._scratch = scratch_slot
        self._graphs: dict[int, _PrefillGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket_for(self, positions: int) -> int | None:
        return next((b for b in self.buckets if b >= positions), None)

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys/values [layers, H, n, Dh] of prompt embeddings ``x`` [n, D] at positions
        ``0..n-1``, or None when no bucket holds ``n`` positions."""
        n = x.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return None
        g = self._graphs.get(bucket)
        if g is None:
            g = self._graphs[bucket] = self._capture(bucket)
        g.x[0, :n].copy_(x)
        g.x[0, n:].zero_()
        # Resetting writes a host scalar, which capture forbids: it runs before the replay.
        self.kv.reset(self._slot)
        g.graph.replay()
        return g.keys[:, :, :n].clone(), g.values[:, :, :n].clone()

    def _pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.lm.temporal(self._slot, x, self.kv, self.window, fresh=True)
        return self.kv.export(self._scratch, 0, x.shape[1])

    def _capture(self, bucket: int) -> _PrefillGraph:
        x = torch.zeros(1, bucket, self.lm.cfg.dim, device=self.lm.device, dtype=self.lm.dtype)
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation and compilation happen here, not in capture
                    self.kv.reset(self._slot)
                    self._pass(x)
            torch.cuda.current_stream().wait_stream(side)
            self.kv.reset(self._slot)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other GPUs' engine threads run on meanwhile (graphs.py says why).
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                keys, values = self._pass(x)
        log.info("captured the prefill graph for prompts of up to %d positions", bucket)
        return _PrefillGraph(graph, x, keys, values)
