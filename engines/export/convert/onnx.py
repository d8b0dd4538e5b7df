"""The converter's ONNX step: Mimi's streaming steps and the depformer, exported by
``engines.export.onnx`` (its graphs and contracts live there; this module only feeds it the
checkpoint and records the graph layouts the README's trtexec commands need)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from engines.checkpoints.loader import CheckpointFiles, SafetensorsReader, depformer_tensors
from engines.model.mimi import MimiCodec
from engines.state.kv_ring import WindowMode
from engines.export.onnx import export_depformer_onnx, export_mimi_onnx
from engines.export.onnx.state import LAYOUT_KEY
from engines.runtime.trtllm.layout import BuildLayout
from engines.runtime.trtllm.native import partial_lm

log = logging.getLogger(__name__)

DEPFORMER_FILE = "depformer.onnx"
DEPFORMER_LAYOUT = "depformer_onnx.json"
MIMI_LAYOUTS = "mimi_onnx.json"  # written by export_mimi_onnx


def _onnx_layout(path: Path, key: str) -> dict:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return json.loads(meta[key])


def export_all(files: CheckpointFiles, reader: SafetensorsReader, layout: BuildLayout, depformer_steps: int) -> list[Path]:
    """Export both graphs (float32, the reference attention window) into ``layout.onnx``."""
    # A missing onnx / onnxscript raises ImportError in export_graph; reported below.
    try:
        return _export(files, reader, layout, depformer_steps)
    except Exception as exc:  # the exporter's torch.export errors come in many types
        log.debug("ONNX export failed", exc_info=True)
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # torch colours its messages
        first = text.splitlines()[0] if text else type(exc).__name__
        raise ValueError(f"ONNX export failed ({type(exc).__name__}: {first}); run with --verbose for "
                         "the details, or pass --skip-onnx to convert without the ONNX graphs") from None


def _export(files: CheckpointFiles, reader: SafetensorsReader, layout: BuildLayout, depformer_steps: int) -> list[Path]:
    out = layout.onnx
    out.mkdir(parents=True, exist_ok=True)
    state = SafetensorsReader(files.mimi_weights).state_dict()
    mimi = MimiCodec.from_state_dict(files.mimi_config, state, 1, window=WindowMode.REFERENCE)
    written = [Path(p) for p in export_mimi_onnx(mimi, out).values()]
    cfg = files.lm_config
    lm = partial_lm(cfg, depformer_steps, depformer_tensors(reader, cfg, depformer_steps, lambda t: t.to(torch.float32)))
    depformer = Path(export_depformer_onnx(lm, out / DEPFORMER_FILE, steps=depformer_steps,
                                           window=WindowMode.REFERENCE))
    (out / DEPFORMER_LAYOUT).write_text(json.dumps({"file": depformer.name, "window": WindowMode.REFERENCE,
                                                    "layout": _onnx_layout(depformer, LAYOUT_KEY)}, indent=2) + "\n")
    written += [depformer, out / DEPFORMER_LAYOUT]
    data = depformer.with_name(depformer.name + ".data")  # external weights of a large depformer
    if data.is_file():
        written.append(data)
    return written


def graph_layouts(layout: BuildLayout) -> list[tuple[Path, dict]]:
    """(ONNX file, tensor layout) of every exported graph, from the layout files."""
    out = []
    mimi = layout.onnx / MIMI_LAYOUTS
    if mimi.is_file():
        manifest = json.loads(mimi.read_text())
        out += [(layout.onnx / manifest[role]["file"], manifest[role]["layout"]) for role in ("encoder", "decoder")]
    dep = layout.onnx / DEPFORMER_LAYOUT
    if dep.is_file():
        manifest = json.loads(dep.read_text())
        out.append((layout.onnx / manifest["file"], manifest["layout"]))
    return out
