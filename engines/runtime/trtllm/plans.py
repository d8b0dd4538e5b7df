"""Mimi and the depformer as TensorRT plans (built by ``trtexec`` from the converter's ONNX
graphs; graph contracts in ``engines.export.onnx``).

``Graph`` is anything that runs one exported graph on named tensors: ``PlanGraph`` (a
TensorRT plan, GPU only) or, in the tests, onnxruntime on the same ONNX file.  On top of it
``GraphMimi`` keeps every session's streaming state in slabs indexed by slot (a tick gathers
the rows of its slots, runs, and scatters the ``*_out`` rows back; a reset zeroes rows: the
exported graphs start from all-zero states) and ``GraphDepformer`` feeds the depformer its
sampling settings and the engine's own noise, so tokens follow the PyTorch path's rule.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

import torch

from engines.export.onnx.state import GraphTensor, StepLayout
from engines.runtime.trtllm.guard import require_tensorrt

log = logging.getLogger(__name__)


def layout_from(raw: dict) -> StepLayout:
    return StepLayout.from_json(json.dumps(raw))


class Graph(Protocol):
    layout: StepLayout

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every input and state by name in; every output and ``NAME_out`` state by name out."""


class PlanGraph:
    """One TensorRT plan with dynamic batch, driven through its named I/O tensors."""

    def __init__(self, plan: Path, layout: StepLayout, device: torch.device) -> None:
        trt = require_tensorrt()
        self.layout = layout
        self.device = device
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {plan} (built by another TensorRT version?)")
        self.context = self.engine.create_execution_context()
        self._keep: dict[str, torch.Tensor] = {}

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = next(iter(feeds.values())).shape[0]
        ctx = self.context
        for name, tensor in feeds.items():
            tensor = tensor.contiguous()
            feeds[name] = tensor
            ctx.set_input_shape(name, tuple(tensor.shape))
            ctx.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for desc in self.layout.outputs + tuple(GraphTensor(s.output_name, s.shape, s.dtype)
                                                for s in self.layout.states):
            out = torch.empty((batch, *desc.shape), dtype=desc.dtype, device=self.device)
            ctx.set_tensor_address(desc.name, out.data_ptr())
            outputs[desc.name] = out
        if not ctx.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT plan execution failed")
        self._keep = feeds  # inputs must outlive the asynchronous execution
        return outputs


class StateSlabs:
    """One graph's streaming states for every slot: ``[num_slots, *shape]`` per state."""

    def __init__(self, states: tuple[GraphTensor, ...], num_slots: int, device: torch.device) -> None:
        self.slabs = {s.name: s.zeros(num_slots, device) for s in states}
        self.out_names = {s.name: s.output_name for s in states}

    def gather(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: slab[slots] for name, slab in self.slabs.items()}

    def scatter(self, slots: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
        for name, slab in self.slabs.items():
            slab[slots] = outputs[self.out_names[name]]

    def reset(self, slots: torch.Tensor) -> None:
        for slab in self.slabs.values():
            slab[slots] = 0


class GraphMimi:
    """``engines.runtime.trtllm.engine.Codec`` over the Mimi encoder and decoder step graphs."""

    def __init__(self, encoder: Graph, decoder: Graph, num_slots: int, device: torch.device) -> None:
        self.encoder, self.decoder = encoder, decoder
        self.device = device
        self.enc = StateSlabs(encoder.layout.states, num_slots, device)
        self.dec = StateSlabs(decoder.layout.states, num_slots, device)

    def encode_step(self, slots: torch.Tensor, pcm: torch.Tensor) -> torch.Tensor:
        out = self.encoder.run({"pcm": pcm.to(self.device, torch.float32), **self.enc.gather(slots)})
        self.enc.scatter(slots, out)
        return out["codes"]

    def decode_step(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        out = self.decoder.run({"codes": codes.to(self.device, torch.int64), **self.dec.gather(slots)})
        self.dec.scatter(slots, out)
        return out["pcm"]

    def reset(self, slots: torch.Tensor) -> None:
        self.enc.reset(slots)
        self.dec.reset(slots)


class GraphDepformer:
    """The depformer graph (all codebook steps, sampling in-graph) for the engine's tick."""

    def __init__(self, graph: Graph, steps: int, card: int) -> None:
        self.graph, self.steps, self.card = graph, steps, card

    def __call__(self, idx: torch.Tensor, hidden: torch.Tensor, text: torch.Tensor, forced: torch.Tensor,
                 forced_mask: torch.Tensor, sampling) -> torch.Tensor:
        from engines.export.onnx.depformer_graph import depformer_noise

        noise = depformer_noise(sampling.seed[idx], sampling.counter[idx], self.steps, self.card)
        audio = sampling.batch(idx, text=False)  # float32 / int64 / bool rows, as the graph takes them
        out = self.graph.run({
            "hidden": hidden.float(), "text_token": text.long(), "forced": forced.long(),
            "forced_mask": forced_mask.bool(), "temperature": audio.temperature,
            "top_k": audio.top_k, "greedy": audio.greedy, "noise": noise,
        })
        return out["codes"]


def load_plans(onnx_dir: Path, plans_dir: Path, num_slots: int, device: torch.device, window: str,
               depformer_steps: int, card: int) -> tuple[GraphMimi | None, GraphDepformer | None]:
    """The TensorRT plans that exist and fit this server (else None: the PyTorch path runs)."""
    if device.type != "cuda" or not plans_dir.is_dir():
        return None, None
    mimi = depformer = None
    mimi_manifest = onnx_dir / "mimi_onnx.json"
    enc, dec = plans_dir / "mimi_encoder.plan", plans_dir / "mimi_decoder.plan"
    if mimi_manifest.is_file() and enc.is_file() and dec.is_file():
        manifest = json.loads(mimi_manifest.read_text())
        if manifest.get("window") != window:
            log.warning("the Mimi plans were exported for the %s window, the server runs %s: using PyTorch Mimi",
                        manifest.get("window"), window)
        else:
            mimi = GraphMimi(PlanGraph(enc, layout_from(manifest["encoder"]["layout"]), device),
                             PlanGraph(dec, layout_from(manifest["decoder"]["layout"]), device),
                             num_slots, device)
            log.info("Mimi runs as TensorRT plans")
    dep_manifest, dep_plan = onnx_dir / "depformer_onnx.json", plans_dir / "depformer.plan"
    if dep_manifest.is_file() and dep_plan.is_file():
        manifest = json.loads(dep_manifest.read_text())
        layout = layout_from(manifest["layout"])
        steps = layout.outputs[0].shape[0]
        if steps != depformer_steps:
            log.warning("the depformer plan has %d steps, the build %d: using the PyTorch depformer", steps,
                        depformer_steps)
        else:
            depformer = GraphDepformer(PlanGraph(dep_plan, layout, device), steps, card)
            log.info("the depformer runs as a TensorRT plan")
    return mimi, depformer
