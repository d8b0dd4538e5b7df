"""ONNX exports for TensorRT plans: Mimi's streaming steps and the depformer.

Stable entry points (the converter calls these; keep the signatures):

    export_mimi_onnx(mimi: MimiCodec, out_dir: Path, *, opset: int = 18) -> dict[str, Path]
        -> {"encoder": out_dir/mimi_encoder.onnx, "decoder": out_dir/mimi_decoder.onnx,
            "manifest": out_dir/mimi_onnx.json}

    export_depformer_onnx(lm: MoshiLM, out_path: Path, *, steps: int = 8, opset: int = 18,
                          window: str = "reference", top_k_max: int = 2048,
                          external_data: bool | None = None) -> Path

Graph contracts are in ``engines.export.onnx.mimi`` and ``engines.export.onnx.depformer``;
every graph has a dynamic batch axis 0 and carries its tensor layout as metadata
(``state.LAYOUT_KEY``).  ``OrtGraph`` runs a graph on onnxruntime carrying its states;
``depformer_noise`` builds the depformer's sampling-noise input from session seeds.
Exporting needs ``onnx`` and ``onnxscript`` (the ``convert`` extra); see docs/ONNX_EXPORT.md.
"""

from engines.export.onnx.depformer import export_depformer_onnx
from engines.export.onnx.depformer_graph import depformer_noise
from engines.export.onnx.mimi import export_mimi_onnx
from engines.export.onnx.ort_runner import OrtGraph
from engines.export.onnx.state import GraphTensor, StepLayout

__all__ = ["GraphTensor", "OrtGraph", "StepLayout", "depformer_noise", "export_depformer_onnx", "export_mimi_onnx"]
