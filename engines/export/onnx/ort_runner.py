"""Run an exported graph with onnxruntime, carrying its streaming states between calls.

A check before TensorRT: the same ONNX file, on CPU, must reproduce the PyTorch engine
(tests/test_onnx_export.py).  Needs ``onnxruntime`` (the ``test``/``convert`` extras).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.export.onnx.state import LAYOUT_KEY, StepLayout


class OrtGraph:
    """One ONNX graph of this package in an onnxruntime session.

    ``step(inputs, states)`` runs one call: ``inputs`` maps the plain input names to arrays,
    ``states`` the state names (``initial_states`` for fresh sessions); it returns the plain
    outputs and the updated states, both keyed by the names the caller uses.
    """

    def __init__(self, path: Path, threads: int = 1, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        meta = self.session.get_modelmeta().custom_metadata_map
        if LAYOUT_KEY not in meta:
            raise ValueError(f"{path} has no {LAYOUT_KEY} metadata: not exported by engines.export.onnx")
        self.layout = StepLayout.from_json(meta[LAYOUT_KEY])

    def initial_states(self, batch: int) -> dict[str, np.ndarray]:
        return {name: t.numpy() for name, t in self.layout.initial_states(batch).items()}

    def step(self, inputs: dict[str, np.ndarray], states: dict[str, np.ndarray] | None = None
             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        feed = dict(inputs)
        feed.update(states or {})
        values = self.session.run(self.layout.output_names, feed)
        n = len(self.layout.outputs)
        outputs = {t.name: v for t, v in zip(self.layout.outputs, values[:n])}
        return outputs, {s.name: v for s, v in zip(self.layout.states, values[n:])}
