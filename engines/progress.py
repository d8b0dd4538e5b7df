"""Where an engine's start-up is: the phase it is in and how far along, for ``/ready`` and
``/health`` while a model loads (a 7B start takes minutes: download, weights, compilation,
two CUDA graphs per batch bucket).

Code on the loading path calls ``report(...)``; whoever loads the engine listens for the
reports of its own thread (``listening``), so engines loading at once on several threads
(one per device) do not mix theirs.  Nothing listening: a report costs a dictionary lookup.
Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# The phases, in the order a start goes through them.
COMPILE_ARTIFACTS = "compile artifacts"  # filling torch.compile's caches from a portable file
CHECKPOINT = "checkpoint"  # finding or downloading the files
WEIGHTS = "weights"  # reading them onto the device
WARM_UP = "warm-up"  # the first frames through a throwaway slot (prefill, compilation)
TICK_GRAPHS = "tick graphs"  # two CUDA graphs per batch bucket (sampling, all greedy)


@dataclass(frozen=True)
class LoadProgress:
    phase: str
    detail: str = ""
    done: int | None = None  # of ``total`` steps of this phase, where it has steps
    total: int | None = None

    def as_dict(self) -> dict[str, object]:
        body: dict[str, object] = {"phase": self.phase}
        if self.detail:
            body["detail"] = self.detail
        if self.total is not None:
            body["done"], body["total"] = self.done, self.total
        return body


_local = threading.local()


def report(phase: str, detail: str = "", done: int | None = None, total: int | None = None) -> None:
    """Tell whoever loads an engine on this thread where it is now."""
    listener = getattr(_local, "listener", None)
    if listener is not None:
        listener(LoadProgress(phase, detail, done, total))


@contextmanager
def listening(listener: Callable[[LoadProgress], None]) -> Iterator[None]:
    """Send this thread's reports to ``listener`` while the block runs."""
    previous = getattr(_local, "listener", None)
    _local.listener = listener
    try:
        yield
    finally:
        _local.listener = previous
