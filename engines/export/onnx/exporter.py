"""One place that runs ``torch.onnx.export`` for our graphs.

We use the dynamo exporter (``torch.export`` + onnxscript, the default and maintained path
in torch >= 2.9): it exports the pure-function graphs of this package with one dynamic
batch axis and its optimizer leaves a compact graph.  The older TorchScript exporter is
deprecated and, on our depformer, wrote a model that onnxruntime rejects.

Every input and output gets a dynamic axis 0 named ``batch``.  The example batch is 2:
``torch.export`` specialises sizes 0 and 1, which would freeze the axis.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from engines.export.onnx.state import LAYOUT_KEY, StepLayout

log = logging.getLogger(__name__)

# Opset 18: LayerNormalization and the reductions with axes as inputs; the opset the
# exporter's op library targets, and well inside what TensorRT 10's ONNX parser reads.
DEFAULT_OPSET = 18
EXAMPLE_BATCH = 2
# Libraries that log every rewrite at INFO; kept at WARNING while we export.
_CHATTY_LOGGERS = ("onnxscript", "onnx_ir")


@contextlib.contextmanager
def _quiet_exporter():
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
        with warnings.catch_warnings():
            # The exporter warns about torchvision ops and its own deprecations; not ours to fix.
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def example_inputs(layout: StepLayout, batch: int = EXAMPLE_BATCH) -> list[torch.Tensor]:
    """Zero inputs and states of ``batch`` sessions, in graph input order."""
    return [t.zeros(batch) for t in layout.inputs + layout.states]


def batch_dynamic_shapes(module: nn.Module, num_args: int, batch: torch.export.Dim) -> tuple:
    """``dynamic_shapes`` marking axis 0 of each of ``num_args`` positional arguments.

    ``torch.export`` wants them shaped like ``forward``'s signature: a ``*states``
    parameter takes one nested tuple for all the arguments it collects.
    """
    params = inspect.signature(module.forward).parameters.values()
    fixed = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    shapes: tuple = tuple({0: batch} for _ in range(min(fixed, num_args)))
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        shapes += (tuple({0: batch} for _ in range(num_args - fixed)),)
    return shapes


def export_graph(module: nn.Module, path: Path, *, opset: int = DEFAULT_OPSET,
                 external_data: bool | None = None) -> Path:
    """Export ``module`` to ``path`` with its ``layout``'s tensor names and a dynamic batch,
    traced on that layout's ``example_inputs``.

    ``external_data``: None writes the weights beside the model (``<name>.data``) only when
    they exceed protobuf's 2 GB limit; True always does.  The layout JSON goes into the
    model's metadata under ``LAYOUT_KEY``.
    """
    layout: StepLayout = module.layout
    args = example_inputs(layout)
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"ONNX export needs {' and '.join(missing)}: pip install 'personaplex-serve[convert]'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1)
    start = time.monotonic()
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            module.eval(), tuple(args), dynamo=True, opset_version=opset,
            dynamic_shapes=batch_dynamic_shapes(module, len(args), batch),
            input_names=layout.input_names, output_names=layout.output_names,
            optimize=True, verbose=False,
        )
    program.model.metadata_props[LAYOUT_KEY] = layout.layout_json()
    program.model.producer_name = "personaplex-serve"
    program.save(path, external_data=external_data)
    log.info("exported %s (%d nodes, opset %d) in %.1f s", path, len(program.model.graph), opset,
             time.monotonic() - start)
    return path
