"""Mimi speech codec (24 kHz <-> 12.5 Hz x 8 codebooks), batched over session slots."""

from engines.model.mimi.codec import MimiCodec

__all__ = ["MimiCodec"]
