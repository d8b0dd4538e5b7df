"""Shape-checked access to a Mimi state dict in the official checkpoint layout."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from engines.errors import CheckpointError


class CheckpointTensors:
    """Hands out checkpoint tensors by name, refusing missing or mis-shaped ones.

    Every layer of the codec pulls its own weights through ``take`` so that the error
    names the exact tensor; keys nobody asks for are simply ignored.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], source: str = "Mimi checkpoint") -> None:
        self.state_dict = state_dict
        self.source = source
        self.used: set[str] = set()

    def take(self, key: str, shape: Sequence[int], aliases: Sequence[str] = ()) -> torch.Tensor:
        """The tensor stored under ``key`` (or the first present alias), checked against ``shape``."""
        expected = tuple(int(s) for s in shape)
        for name in (key, *aliases):
            if name in self.state_dict:
                tensor = self.state_dict[name]
                if not isinstance(tensor, torch.Tensor):
                    raise CheckpointError(f"{self.source}: entry {name!r} is not a tensor")
                if tuple(tensor.shape) != expected:
                    raise CheckpointError(
                        f"{self.source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                    )
                self.used.add(name)
                return tensor
        names = " or ".join(repr(n) for n in (key, *aliases))
        raise CheckpointError(f"{self.source}: missing tensor {names} (expected shape {expected})")

    def unused(self) -> list[str]:
        return sorted(k for k in self.state_dict if k not in self.used)


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a preallocated parameter (casting dtype/device)."""
    with torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))
