"""The names of random-weight engines at a known model's shapes: ``PERSONAPLEX_CHECKPOINT=random:personaplex-7b``.

What a tick costs does not depend on the weight values, so random weights measure capacity
(sessions per GPU, tick times, memory) without downloading the gated checkpoint.  The
engine is the benchmark's (``engines.checkpoints.random_model.build_random_engine``): random bf16 weights on a
GPU (float32 on CPU), the tiny checkpoint's text tokenizer (pieces are only looked up) and
the tiny checkpoint's voice names, each a random prompt of the real format at the model's
width.  Its speech is noise.

Importing this module does not import torch: the server's settings and the engine spec read
the names; ``engines.runtime.factory`` builds the engine.
"""

from __future__ import annotations

from pathlib import Path

RANDOM_PREFIX = "random:"
# The models random weights may stand in for, at their shapes.
RANDOM_MODELS = ("personaplex-7b", "tiny")


def random_model_name(checkpoint: str | Path | None) -> str | None:
    """``"personaplex-7b"`` for ``"random:personaplex-7b"``; None for anything that is not a
    ``random:`` checkpoint; ``ValueError`` for an unknown random model."""
    if not isinstance(checkpoint, str) or not checkpoint.startswith(RANDOM_PREFIX):
        return None
    name = checkpoint[len(RANDOM_PREFIX):]
    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; available: "
                         f"{', '.join(RANDOM_PREFIX + n for n in RANDOM_MODELS)}")
    return name
