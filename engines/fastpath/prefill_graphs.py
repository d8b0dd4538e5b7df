"""CUDA graphs of the prefill pass: one per padded length of a one-piece prompt, and one that
replays every piece of a split prompt.

A cold prefill (a new voice + persona) runs the temporal transformer over a few hundred
prompt positions.  Eagerly the pass launches well over a thousand kernels, so it is bound by
the host issuing them on the engine thread (whatever a piece's length, while live ticks
wait), not by the GPU; replaying a graph issues the whole pass at once.  Figures:
docs/PERFORMANCE.md, "Joins during a full load".

One-piece prompts are padded at the end to a bucket length.  The pass is causal and starts
from an empty cache, so padding positions never influence the real ones: the keys/values of
positions ``0..n-1`` are the same as an unpadded pass would give (the graph's own rounding
aside), and only those are returned.  The buckets stop at the chunk length.  A longer prompt
runs in pieces of the chunk length (``engines.model.prefill.prompt_pass``); its ``PromptKV`` keeps
the next position on the device and every piece has the same shapes, so one graph over one
cache replays them all.  That cache serves one pass at a time: ``claim_pieces`` says None
while another pass holds it, and the other pass waits for it (the server's) or runs its
pieces eagerly (``prompt_pass``'s ``wait``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engines.state.prompt_kv import PromptKV

log = logging.getLogger(__name__)

BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass
class _PassGraph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [1, length, D] input embeddings (a bucket: zero padded)
    kv: PromptKV  # its keys/values

    def run(self, piece: torch.Tensor) -> None:
        """One replay over ``piece`` [1, length, D] (a split prompt's next piece)."""
        self.x.copy_(piece)
        self.graph.replay()
        self.kv.written += self.x.shape[1]  # the replay moved ``kv.start`` on the device


class PrefillGraphs:
    def __init__(self, lm, window: str, capacity: int, chunk: int, buckets: tuple[int, ...] = BUCKETS) -> None:
        """Graphs of passes over prompts of up to ``chunk`` positions, and of a longer
        prompt's pieces of ``chunk``, for sessions whose window holds ``capacity`` positions
        (``window``: the window mode)."""
        self.lm = lm
        self.window = window
        self.capacity = capacity
        self.chunk = chunk
        self.buckets = tuple(b for b in sorted(buckets) if b <= chunk)
        self._sequence = torch.zeros(1, dtype=torch.long, device=lm.device)
        self._graphs: dict[int, _PassGraph] = {}
        self._pieces: _PassGraph | None = None
        self._pieces_claimed = False
        self._pool = torch.cuda.graph_pool_handle()

    def bucket_for(self, positions: int) -> int | None:
        return next((b for b in self.buckets if b >= positions), None)

    def capture_all(self) -> None:
        """Capture every graph now (start-up) rather than on first use."""
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket, bucket)
        self._piece_graph()

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys/values [layers, H, n, Dh] of prompt embeddings ``x`` [n, D] at positions
        ``0..n-1``, or None when no bucket holds ``n`` positions."""
        n = x.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return None
        g = self._graphs.get(bucket)
        if g is None:
            g = self._graphs[bucket] = self._capture(bucket, bucket)
        g.x[0, :n].copy_(x)
        g.x[0, n:].zero_()
        g.kv.reset()  # a host-side reset, which capture forbids: before the replay
        g.graph.replay()
        return g.kv.keys[:, 0, :, :n].clone(), g.kv.values[:, 0, :, :n].clone()

    def claim_pieces(self, chunk: int) -> _PassGraph | None:
        """The piece graph, reset for a new pass of ``chunk``-position pieces, or None when
        another pass holds it (or the pieces are of another length)."""
        if chunk != self.chunk or self._pieces_claimed:
            return None
        pieces = self._piece_graph()
        self._pieces_claimed = True
        with torch.inference_mode():  # its tensors were made in inference mode
            pieces.kv.reset()
        return pieces

    def pieces_held(self, chunk: int) -> bool:
        """Whether a pass of ``chunk``-position pieces holds the piece graph now (it would get
        it once that pass ends)."""
        return chunk == self.chunk and self._pieces_claimed

    def release_pieces(self, pieces: _PassGraph) -> None:
        if pieces is self._pieces:
            self._pieces_claimed = False

    def _piece_graph(self) -> _PassGraph:
        """The graph of a split prompt's pieces (captured on first use), over a cache of
        window + chunk - 1 positions: every piece fits it, however long the prompt."""
        if self._pieces is None:
            self._pieces = self._capture(self.chunk, self.capacity + self.chunk - 1)
        return self._pieces

    def _pass(self, g: _PassGraph) -> None:
        self.lm.temporal(self._sequence, g.x, g.kv, self.window)

    def _capture(self, length: int, size: int) -> _PassGraph:
        lm = self.lm
        cfg = lm.cfg
        with torch.inference_mode():
            x = torch.zeros(1, length, cfg.dim, device=lm.device, dtype=lm.dtype)
            kv = PromptKV(cfg.num_layers, cfg.num_heads, cfg.head_dim, window=self.capacity, size=size,
                          device=lm.device, dtype=lm.dtype)
            g = _PassGraph(torch.cuda.CUDAGraph(), x, kv)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation and compilation happen here, not in capture
                    kv.reset()
                    self._pass(g)
            torch.cuda.current_stream().wait_stream(side)
            kv.reset()
            # thread_local: other GPUs' engine threads run on meanwhile (graphs.py says why).
            with torch.cuda.graph(g.graph, pool=self._pool, capture_error_mode="thread_local"):
                self._pass(g)
            kv.reset()
        log.info("captured the prefill graph of %d positions over a cache of %d", length, size)
        return g
