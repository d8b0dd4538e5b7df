"""Audio files in and out, with the reference's conventions.

Reading uses ``sphn`` (what NVIDIA's reference uses): any rate is resampled to 24 kHz with
the same resampler, and, as the reference does, a multi-channel file is reduced to its
first channel.  Voice prompts are loudness-normalised to -24 LUFS with pyloudnorm.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from engines.config import FRAME_SAMPLES, SAMPLE_RATE
from engines.errors import AudioInputError

log = logging.getLogger(__name__)

VOICE_LOUDNESS_LUFS = -24.0


def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples of ``path`` at ``sample_rate``."""
    import sphn

    p = Path(path)
    if not p.is_file():
        raise AudioInputError(f"audio file not found: {p}")
    try:
        pcm, sr = sphn.read(str(p))
    except Exception as exc:  # sphn raises plain exceptions for undecodable files
        raise AudioInputError(f"cannot decode audio file {p}: {exc}") from exc
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 2 or pcm.shape[-1] == 0:
        raise AudioInputError(f"audio file {p} holds no samples")
    if pcm.shape[0] > 1:
        log.warning("%s has %d channels; using the first one, as the reference does", p, pcm.shape[0])
    if sr != sample_rate:
        pcm = np.asarray(sphn.resample(pcm, src_sample_rate=sr, dst_sample_rate=sample_rate), dtype=np.float32)
    mono = np.ascontiguousarray(pcm[0])
    if not np.isfinite(mono).all():
        raise AudioInputError(f"audio file {p} contains non-finite samples")
    return mono


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    import sphn

    sphn.write_wav(str(path), np.asarray(pcm, dtype=np.float32), sample_rate)


def frames_of(pcm: np.ndarray, frame: int = FRAME_SAMPLES) -> np.ndarray:
    """Split into [F, frame] frames, zero-padding the last partial one (as the reference)."""
    n = -(-pcm.shape[-1] // frame)
    padded = np.zeros(n * frame, dtype=np.float32)
    padded[: pcm.shape[-1]] = pcm
    return padded.reshape(n, frame)


def normalize_loudness(pcm: np.ndarray, sample_rate: int = SAMPLE_RATE, target_lufs: float = VOICE_LOUDNESS_LUFS) -> np.ndarray:
    import pyloudnorm

    meter = pyloudnorm.Meter(sample_rate)
    try:
        loudness = meter.integrated_loudness(pcm.astype(np.float64))
    except ValueError as exc:  # shorter than one 400 ms gating block
        raise AudioInputError(f"voice audio is too short to measure its loudness: {exc}") from exc
    if not np.isfinite(loudness):
        raise AudioInputError("voice audio is silent; cannot normalise its loudness")
    return pyloudnorm.normalize.loudness(pcm.astype(np.float64), loudness, target_lufs).astype(np.float32)
