"""Named per-session tensors of an exported graph: streaming states and plain inputs.

A step graph takes every state tensor as an input ``NAME`` and returns its updated value as
the output ``NAME_out`` (separate outputs, so a TensorRT runtime can keep two state slabs
and swap them each tick instead of aliasing one buffer as input and output).  Every tensor
has a leading dynamic batch axis (one row per session); ``shape`` below is the per-session
rest.  Initial states are all zeros, so opening a session is a memset of its slab rows.

The layout is also written into each ONNX file as JSON metadata (``LAYOUT_KEY``), so a
runtime can allocate and bind states without importing this package.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

OUTPUT_SUFFIX = "_out"
LAYOUT_KEY = "personaplex.layout"  # ONNX metadata_props key holding ``layout_json``

_DTYPE_NAMES = {torch.float32: "float32", torch.int64: "int64", torch.bool: "bool"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class GraphTensor:
    """One graph input, output or state: its name, per-session shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def output_name(self) -> str:
        """Name of the updated value when this tensor is a state."""
        return self.name + OUTPUT_SUFFIX

    def zeros(self, batch: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros((batch, *self.shape), dtype=self.dtype, device=device)

    def describe(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": _DTYPE_NAMES[self.dtype]}

    @classmethod
    def from_description(cls, d: dict) -> GraphTensor:
        return cls(d["name"], tuple(d["shape"]), _DTYPES[d["dtype"]])


@dataclass(frozen=True)
class StepLayout:
    """Inputs and outputs of one exported graph, in graph order.

    The graph's inputs are ``inputs`` then ``states``; its outputs are ``outputs`` then
    each state's ``output_name``.
    """

    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]
    states: tuple[GraphTensor, ...] = ()

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs + self.states]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs] + [s.output_name for s in self.states]

    def initial_states(self, batch: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The state of ``batch`` fresh sessions: zeros, keyed by input name."""
        return {s.name: s.zeros(batch, device) for s in self.states}

    def layout_json(self) -> str:
        return json.dumps({
            "batch_axis": 0,
            "output_suffix": OUTPUT_SUFFIX,
            "inputs": [t.describe() for t in self.inputs],
            "outputs": [t.describe() for t in self.outputs],
            "states": [t.describe() for t in self.states],
        })

    @classmethod
    def from_json(cls, text: str) -> StepLayout:
        raw = json.loads(text)
        if raw.get("output_suffix") != OUTPUT_SUFFIX:
            raise ValueError(f"layout uses output suffix {raw.get('output_suffix')!r}, expected {OUTPUT_SUFFIX!r}")
        return cls(*(tuple(GraphTensor.from_description(d) for d in raw[key])
                     for key in ("inputs", "outputs", "states")))

    def trtexec_shapes(self, min_batch: int, opt_batch: int, max_batch: int) -> dict[str, str]:
        """``--minShapes/--optShapes/--maxShapes`` values for every input of the graph."""
        def spec(batch: int) -> str:
            return ",".join(f"{t.name}:{'x'.join(str(d) for d in (batch, *t.shape))}"
                            for t in self.inputs + self.states)
        return {"--minShapes": spec(min_batch), "--optShapes": spec(opt_batch), "--maxShapes": spec(max_batch)}


class StateIO:
    """Threads named state tensors through one traced step.

    Layers ``take`` their state by name and ``give`` back the updated value; the graph
    returns ``updated()`` in layout order.  Plain Python, so tracing sees only tensor ops.
    """

    def __init__(self, states: Sequence[GraphTensor], values: Iterable[torch.Tensor]) -> None:
        self._order = [s.name for s in states]
        self._in = dict(zip(self._order, values, strict=True))
        self._out: dict[str, torch.Tensor] = {}

    def take(self, name: str) -> torch.Tensor:
        return self._in[name]

    def give(self, name: str, value: torch.Tensor) -> None:
        if name not in self._in or name in self._out:
            raise KeyError(f"state {name!r} is unknown or updated twice")
        self._out[name] = value

    def updated(self) -> tuple[torch.Tensor, ...]:
        missing = [n for n in self._order if n not in self._out]
        if missing:
            raise KeyError(f"states never updated: {missing}")
        return tuple(self._out[n] for n in self._order)
