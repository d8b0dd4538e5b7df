"""Export Mimi's streaming encoder and decoder steps to ONNX (for TensorRT plans).

    export_mimi_onnx(mimi: MimiCodec, out_dir: Path, *, opset: int = 18) -> dict[str, Path]

writes into ``out_dir``:

* ``mimi_encoder.onnx``: inputs ``pcm`` [B, 1920] float32 (24 kHz) and the encoder states;
  outputs ``codes`` [B, num_codebooks] int64 and each state ``NAME`` updated as ``NAME_out``;
* ``mimi_decoder.onnx``: inputs ``codes`` [B, num_codebooks] int64 and the decoder states;
  outputs ``pcm`` [B, 1920] float32 and the updated states;
* ``mimi_onnx.json``: both layouts (every tensor's name, per-session shape and dtype), the
  frame geometry and the attention window mode;

and returns ``{"encoder": path, "decoder": path, "manifest": path}``.  B is dynamic.  A
session's states start as zeros; carry each ``NAME_out`` into ``NAME`` for its next frame.
Each file also holds its layout as JSON metadata (``state.LAYOUT_KEY``).

Streaming states (per session; full-size Mimi in brackets):
conv left contexts ``<layer>.history`` [channels, (k-1)*d+1-s], transposed-conv tails
``<layer>.partial`` [channels, k-s], and per transformer ``<side>_transformer.keys`` /
``.values`` [layers, heads, context, head_dim] ([8, 8, 250, 64]) plus ``.position`` (int64,
latent steps written).  The transformer context is a fixed-size shift buffer of the last
``context`` positions, oldest first; a frame appends its 2 latent steps and drops the
oldest 2, and the attention mask is built in-graph from ``position`` with the codec's
window rule (``MimiCodec.window``: NVIDIA's reference window by default).  So shapes are
static however long a session runs, and the graph has no modulo or scatter.

The graphs compute in float32 with the codec's weights; codes match the PyTorch codec on
onnxruntime CPU (tests/test_onnx_export.py).  Build TensorRT plans in FP32 first and
compare codes before trying reduced precision (spec/trtllm.md 6).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engines.model.mimi import MimiCodec
from engines.export.onnx.exporter import DEFAULT_OPSET, export_graph
from engines.export.onnx.mimi_graph import MimiDecoderGraph, MimiEncoderGraph

log = logging.getLogger(__name__)

ENCODER_FILE = "mimi_encoder.onnx"
DECODER_FILE = "mimi_decoder.onnx"
MANIFEST_FILE = "mimi_onnx.json"


def export_mimi_onnx(mimi: MimiCodec, out_dir: Path, *, opset: int = DEFAULT_OPSET) -> dict[str, Path]:
    """Export ``mimi`` (float32, any device, any slot count) as the two step graphs above."""
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {}
    manifest: dict = {
        "sample_rate": mimi.cfg.sample_rate,
        "frame_samples": mimi.frame_samples,
        "num_codebooks": mimi.num_codebooks,
        "latent_steps_per_frame": mimi.cfg.latent_steps_per_frame,
        "transformer_context": mimi.cfg.transformer.context,
        "window": mimi.window,
        "opset": opset,
    }
    for role, graph_cls, file_name in (("encoder", MimiEncoderGraph, ENCODER_FILE),
                                       ("decoder", MimiDecoderGraph, DECODER_FILE)):
        graph = graph_cls(mimi)
        paths[role] = export_graph(graph, out_dir / file_name, opset=opset)
        manifest[role] = {"file": file_name, "layout": json.loads(graph.layout.layout_json())}
    paths["manifest"] = out_dir / MANIFEST_FILE
    paths["manifest"].write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("Mimi ONNX step graphs written to %s", out_dir)
    return paths
