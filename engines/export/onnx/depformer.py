"""Export the depformer (all codebook steps of a frame, sampling in-graph) to ONNX.

    export_depformer_onnx(lm: MoshiLM, out_path: Path, *, steps: int = 8, opset: int = 18,
                          window: str = "reference", top_k_max: int = 2048,
                          external_data: bool | None = None) -> Path

writes one graph (see ``depformer_graph`` for the exact semantics):

* inputs (B dynamic): ``hidden`` [B, dim] float32, ``text_token`` [B] int64,
  ``forced`` [B, steps] int64, ``forced_mask`` [B, steps] bool, ``temperature`` [B]
  float32, ``top_k`` [B] int64, ``greedy`` [B] bool, ``noise`` [B, steps, card] float32
  (Exponential(1) noise, ``depformer_noise(seeds, counters, steps, card)``);
* output ``codes`` [B, steps] int64.

``steps`` defaults to the 8 agent codebooks PersonaPlex serving runs (model.md 3.4) and may
be anything up to the steps loaded into ``lm``.  Weights are exported in float32 whatever
``lm``'s dtype; a 7B-sized depformer (8 steps, ~2.8 GB) exceeds protobuf's 2 GB limit, so
its weights go beside the model as ``<out_path name>.data`` (``external_data=None``
decides by size).  ``top_k_max`` is the static TopK width: sessions asking for more are
clamped, as in the engine's CUDA-graph path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engines.model.lm import MoshiLM
from engines.state.kv_ring import WindowMode
from engines.export.onnx.depformer_graph import DepformerGraph
from engines.export.onnx.exporter import DEFAULT_OPSET, export_graph
from engines.model.sampling import STATIC_TOP_K

log = logging.getLogger(__name__)


def export_depformer_onnx(lm: MoshiLM, out_path: Path, *, steps: int = 8, opset: int = DEFAULT_OPSET,
                          window: str = WindowMode.REFERENCE, top_k_max: int = STATIC_TOP_K,
                          external_data: bool | None = None) -> Path:
    graph = DepformerGraph(lm, steps, window=window, top_k_max=top_k_max)
    return export_graph(graph, Path(out_path), opset=opset, external_data=external_data)
