"""CUDA graphs of the live tick, one per batch bucket (two with ``greedy_ticks``: one that
samples, one for ticks whose sessions are all greedy, which takes the argmaxes only).

A tick with B live slots replays the graph of the smallest bucket >= B; the unused rows
point at the engine's scratch slot, whose state is throw-away (duplicate writes to it are
harmless).  Every state tensor the tick touches (KV ring, token ring, Mimi state, sampling
settings) is allocated once by the engine, so the captured addresses stay valid; inputs
and outputs go through static buffers.  The only host synchronisation is reading the
results back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engines import progress
from engines.config import FRAME_SAMPLES

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor  # [bucket] int64, device
    pcm: torch.Tensor  # [bucket, FRAME_SAMPLES] float32, device
    out_pcm: torch.Tensor
    out_text: torch.Tensor


def tick_buckets(requested: tuple[int, ...], num_slots: int, compiled: bool) -> list[int]:
    """The batch sizes that get a graph: the requested ones below the slot count, and the
    slot count itself.  A compiled tick has no graph for a lone slot: torch specialises a
    dimension of size 1, so a batch of exactly one is a compilation of its own (~14 s of every
    restart at 7B shapes, 99 s of a first start with fp8 weights: docs/PERFORMANCE.md), while
    one live slot padded to two costs about the same GPU time with bf16 weights (cuBLAS reads
    the weights once either way).  With fp8 weights the few-row product
    (``fastpath.fp8_gemv``) does work per row: a lone slot's own graph would save an estimated
    ~0.6 ms of its tick (summed from the per-product times of one and two rows on the H200),
    not worth a compilation at every start (issue 36)."""
    buckets = {b for b in requested if b < num_slots} | {num_slots}
    if compiled and num_slots >= 2:
        buckets = (buckets - {1}) | {2}
    return sorted(buckets)


class TickGraphs:
    def __init__(self, engine, buckets: tuple[int, ...]) -> None:
        self.engine = engine
        self.buckets = tick_buckets(buckets, engine.num_slots, engine.options.compile)
        self._graphs: dict[tuple[int, bool], _Graph] = {}  # by (bucket, greedy)
        self._pool = torch.cuda.graph_pool_handle()
        # Pinned staging buffers: the per-tick uploads are true async copies, with no
        # allocation on the tick path.
        self._host_pcm = torch.empty((max(self.buckets), FRAME_SAMPLES), dtype=torch.float32).pin_memory()
        self._host_slots = torch.empty(max(self.buckets), dtype=torch.long).pin_memory()
        # Results land in pinned buffers too: one synchronisation, then numpy views.  Each
        # torch call from Python gives up the interpreter lock, and a server thread busy
        # with websockets may hold it for a while before handing it back: the tick makes as
        # few host-side torch calls as it can.
        self._out_pcm = torch.empty((max(self.buckets), FRAME_SAMPLES), dtype=torch.float32).pin_memory()
        self._out_text = torch.empty(max(self.buckets), dtype=torch.long).pin_memory()

    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"{batch} slots exceed the engine's {self.engine.num_slots}")

    def capture_all(self) -> None:
        """Capture every bucket now (at start-up) instead of on first use."""
        kinds = [(b, greedy) for b in self.buckets
                 for greedy in ((False, True) if self.engine.options.greedy_ticks else (False,))]
        for done, (b, greedy) in enumerate(kinds):
            progress.report(progress.TICK_GRAPHS, f"{b} slots" + (", greedy" if greedy else ""), done, len(kinds))
            self._get(b, greedy)

    def _get(self, bucket: int, greedy: bool = False) -> _Graph:
        key = (bucket, greedy)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(*key)
            self._graphs[key] = g
        return g

    def _capture(self, bucket: int, greedy: bool) -> _Graph:
        engine = self.engine
        dev = engine.device
        slots = torch.full((bucket,), engine.scratch, device=dev, dtype=torch.long)
        pcm = torch.zeros(bucket, FRAME_SAMPLES, device=dev, dtype=torch.float32)
        clock_enabled, engine.clock.enabled = engine.clock.enabled, False
        engine.greedy_tick = greedy
        try:
            with torch.inference_mode():
                # Warm-up on a side stream (lazy initialisations must not be captured: a
                # compiled piece's first call at these shapes, Triton's kernel loads, cuBLAS's
                # handles); it only advances the scratch slot.  One tick does them all; a
                # second was a third of a restart's ~10 s of graph capture (22 graphs, 3 ticks each).
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    engine.live_tick(slots, pcm)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the server drives one engine per GPU, each from its own thread;
                # the default (global) mode would fail this capture whenever another engine's
                # thread makes an unsafe CUDA call (a sync, an allocation) meanwhile.
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    out_pcm, out_text = engine.live_tick(slots, pcm)
        finally:
            engine.clock.enabled = clock_enabled
            engine.greedy_tick = False
        log.info("captured the %stick graph for %d slots", "greedy " if greedy else "", bucket)
        return _Graph(graph, slots, pcm, out_pcm, out_text)

    def run(self, slots: list[int], pcm: np.ndarray, greedy: bool = False) -> tuple[np.ndarray, list[int]]:
        """One tick of ``slots``; ``greedy``: every one of them is greedy (the argmax graph)."""
        B = len(slots)
        clock = self.engine.clock
        g = self._get(self.bucket_for(B), greedy)
        bucket = g.slots.shape[0]
        host_slots, host_pcm = self._host_slots[:bucket], self._host_pcm[:bucket]
        ids, samples = host_slots.numpy(), host_pcm.numpy()  # numpy views: no torch calls
        ids[:B] = slots
        ids[B:] = self.engine.scratch
        samples[:B] = pcm
        samples[B:] = 0
        g.slots.copy_(host_slots, non_blocking=True)
        g.pcm.copy_(host_pcm, non_blocking=True)
        clock.host_mark("inputs")
        clock.start()
        g.graph.replay()
        clock.mark("tick")
        out_pcm, out_text = self._out_pcm[:bucket], self._out_text[:bucket]
        out_pcm.copy_(g.out_pcm, non_blocking=True)
        out_text.copy_(g.out_text, non_blocking=True)
        clock.host_mark("launch")
        torch.cuda.current_stream().synchronize()  # the one host synchronisation of the tick
        clock.host_mark("wait")
        # Copies: the pinned buffers are reused by the next tick.
        pcm_out, text = out_pcm.numpy()[:B].copy(), out_text.numpy()[:B].tolist()
        clock.host_mark("copy_out")
        return pcm_out, text
