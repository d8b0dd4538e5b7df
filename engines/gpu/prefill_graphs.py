"""CUDA graphs of the prefill pass, one per padded prompt length.

A cold prefill (a new voice + persona) runs the temporal transformer over a few hundred
prompt positions.  Eagerly that is ~1,500 kernel launches, so the pass is bound by the host
issuing them (tens of ms on the engine thread, during which live ticks wait), not by the
GPU.  Replaying a graph issues the whole pass at once.

Prompts are padded at the end to a bucket length.  The pass is causal and starts from an
empty cache, so padding positions never influence the real ones: the keys/values of
positions ``0..n-1`` are the same as an unpadded pass would give (the graph's own rounding
aside), and only those are returned.  Only prompts that fit one piece of the chunked prefill
(``engines.prefill.prefill_pieces``) are replayed: the buckets stop at the chunk length, and
longer prompts run eagerly a chunk at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..modules.prompt_kv import PromptKV

log = logging.getLogger(__name__)

BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [1, bucket, D] input embeddings (zero padded)
    kv: PromptKV  # the pass's keys/values of all ``bucket`` positions


class PrefillGraphs:
    def __init__(self, lm, window: str, capacity: int, chunk: int, buckets: tuple[int, ...] = BUCKETS) -> None:
        """Graphs of passes over prompts of up to ``chunk`` positions, for sessions whose
        window holds ``capacity`` positions (``window``: the window mode)."""
        self.lm = lm
        self.window = window
        self.capacity = capacity
        self.buckets = tuple(b for b in sorted(buckets) if b <= chunk)
        self._sequence = torch.zeros(1, dtype=torch.long, device=lm.device)
        self._graphs: dict[int, _PrefillGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket_for(self, positions: int) -> int | None:
        return next((b for b in self.buckets if b >= positions), None)

    def capture_all(self) -> None:
        """Capture every bucket now (start-up) rather than on first use."""
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket)

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
        g.graph.replay()
        return g.kv.keys[:, 0, :, :n].clone(), g.kv.values[:, 0, :, :n].clone()

    def _pass(self, g: _PrefillGraph) -> None:
        g.kv.written = 0
        self.lm.temporal(self._sequence, g.x, g.kv, self.window)

    def _capture(self, bucket: int) -> _PrefillGraph:
        lm = self.lm
        cfg = lm.cfg
        with torch.inference_mode():
            x = torch.zeros(1, bucket, cfg.dim, device=lm.device, dtype=lm.dtype)
            kv = PromptKV(cfg.num_layers, cfg.num_heads, cfg.head_dim, window=self.capacity, prompt=bucket,
                          chunk=bucket, device=lm.device, dtype=lm.dtype)
            g = _PrefillGraph(torch.cuda.CUDAGraph(), x, kv)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation and compilation happen here, not in capture
                    self._pass(g)
            torch.cuda.current_stream().wait_stream(side)
            # thread_local: other GPUs' engine threads run on meanwhile (graphs.py says why).
            with torch.cuda.graph(g.graph, pool=self._pool, capture_error_mode="thread_local"):
                self._pass(g)
        log.info("captured the prefill graph for prompts of up to %d positions", bucket)
        return g
