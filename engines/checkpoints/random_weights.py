"""Random-weight engines at a known model's shapes: ``PERSONAPLEX_CHECKPOINT=random:personaplex-7b``.

What a tick costs does not depend on the weight values, so random weights measure capacity
(sessions per GPU, tick times, memory) without downloading the gated checkpoint.  The
engine is the benchmark's (``engines.checkpoints.random_model.build_random_engine``): random bf16 weights on a
GPU (float32 on CPU), the tiny checkpoint's text tokenizer (pieces are only looked up) and
the tiny checkpoint's voice names, each a random prompt of the real format at the model's
width.  Its speech is noise.

Importing this module does not import torch: the server's settings read the names and sizes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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


def create_random_engine(name: str, *, max_slots: int | None, device: str, window: str, kv_cache: str,
                         compile: bool, weights: str = "auto", memory: Any = None) -> Any:
    """A ``PersonaPlexEngine`` with random weights at ``name``'s shapes (see the module doc)."""
    from engines.checkpoints import loader as ckpt
    from engines import progress
    from engines.checkpoints.random_model import build_random_engine
    from engines.runtime.torch_engine import EngineOptions
    from engines.config import LMConfig, MimiConfig
    from engines.checkpoints.tiny import TINY_LM, TINY_MIMI, TINY_VOICES, ensure_tiny_checkpoint

    lm_cfg, mimi_cfg = (TINY_LM, TINY_MIMI) if name == "tiny" else (LMConfig(), MimiConfig())
    log.warning("RANDOM WEIGHTS: building %s%s on %s with random weights at %s shapes; its speech is noise "
                "(for capacity and latency measurements only)", RANDOM_PREFIX, name, device, name)
    tokenizer = ensure_tiny_checkpoint() / ckpt.TOKENIZER_FILE
    progress.report(progress.WEIGHTS, f"random weights at {name} shapes")
    return build_random_engine(max_slots, device, tokenizer, lm_cfg=lm_cfg, mimi_cfg=mimi_cfg, kv_cache=kv_cache,
                               compile=compile, weights=weights, window=window, voice_names=tuple(TINY_VOICES),
                               model_name=f"random-{name}", is_demo=True,
                               options=EngineOptions() if memory is None else EngineOptions(memory=memory))
