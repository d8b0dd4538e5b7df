"""Client audio in, model audio out.

Input: strict base64 -> samples of the declared codec -> float32 -> 24 kHz (one streaming
resampler per session, so chunk boundaries leave no seams) -> whole 1920-sample frames.
pcm_f32le at 24 kHz is passed through untouched, byte for byte.
Output: float32 frames -> PCM16 LE -> base64.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import soxr

from engines.config import FRAME_SAMPLES, SAMPLE_RATE
from engines.interface import shown

MIN_RATE = 8000
MAX_RATE = 192000

# Canonical codec name -> accepted spellings (the reference's list plus the GA
# ``audio/pcmu`` / ``audio/pcma`` names for G.711).
_SPELLINGS = {
    "pcm16": ("audio/pcm", "pcm", "audio/pcm16", "pcm16", "pcm_s16le", "s16le"),
    "pcm_f32le": ("audio/pcm_f32le", "pcm_f32le", "f32le"),
    "g711_ulaw": ("g711_ulaw", "g711-ulaw", "ulaw", "mulaw", "audio/g711_ulaw", "audio/pcmu"),
    "g711_alaw": ("g711_alaw", "g711-alaw", "alaw", "audio/g711_alaw", "audio/pcma"),
    "wav": ("audio/wav", "wav"),
}
_CANONICAL = {spelling: name for name, spellings in _SPELLINGS.items() for spelling in spellings}
INPUT_CODECS = frozenset({"pcm16", "pcm_f32le", "g711_ulaw", "g711_alaw"})
OUTPUT_CODECS = frozenset({"pcm16"})
_SAMPLE_BYTES = {"pcm16": 2, "pcm_f32le": 4, "g711_ulaw": 1, "g711_alaw": 1}


class AudioError(ValueError):
    """Client audio that cannot be used; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def canonical_codec(name: object) -> str | None:
    """The canonical codec for a client spelling, or None if unknown."""
    return _CANONICAL.get(name.strip().lower()) if isinstance(name, str) else None


def check_rate(rate: object) -> int:
    """A sample rate must be an integer in [8000, 192000] (the reference's bounds)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not MIN_RATE <= rate <= MAX_RATE \
            or rate != int(rate):  # the range test first: int() of NaN or infinity raises
        raise AudioError("bad_event", f"sample_rate_hz must be an integer in [{MIN_RATE}, {MAX_RATE}], got {shown(rate)}")
    return int(rate)


def decode_base64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError("bad_audio", "input audio is not valid base64") from None


def _g711_tables() -> tuple[np.ndarray, np.ndarray]:
    """ITU-T G.711 byte -> linear sample tables, as float32 in [-1, 1)."""
    codes = np.arange(256, dtype=np.int32)
    u = ~codes & 0xFF
    mag = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    ulaw = np.where(u & 0x80, 0x84 - mag, mag - 0x84)
    a = codes ^ 0x55
    seg = (a & 0x70) >> 4
    base = ((a & 0x0F) << 4) + 8
    mag = np.where(seg == 0, base, (base + 0x100) << np.maximum(seg - 1, 0))
    alaw = np.where(a & 0x80, mag, -mag)
    return (ulaw / 32768.0).astype(np.float32), (alaw / 32768.0).astype(np.float32)


_ULAW, _ALAW = _g711_tables()


def to_float32(raw: bytes, codec: str) -> np.ndarray:
    """Decode raw bytes of ``codec`` to float32 samples; refuses partial or non-finite samples."""
    width = _SAMPLE_BYTES[codec]
    if len(raw) % width:
        raise AudioError("bad_event", f"{codec} byte length must be divisible by {width}, got {len(raw)}")
    if codec == "pcm_f32le":
        samples = np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=False)
        if not np.isfinite(samples).all():
            raise AudioError("bad_event", "pcm_f32le samples must be finite")
        return samples
    if codec == "pcm16":
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / np.float32(32768.0)
    table = _ULAW if codec == "g711_ulaw" else _ALAW
    return table[np.frombuffer(raw, dtype=np.uint8)]


class InputStream:
    """One session's input path after decoding: resampling to 24 kHz and 80 ms framing.

    The rate is fixed for the life of the stream (changing it mid-call would need a resampler
    flush that shifts the audio; the reference refuses it too).
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = self._new_resampler()
        self._residue = np.zeros(0, dtype=np.float32)
        self._held = 0.0  # output samples the resampler owes for input it has taken (its delay)

    def _new_resampler(self):
        if self.rate == SAMPLE_RATE:
            return None
        return soxr.ResampleStream(self.rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def frames_after(self, n_samples: int) -> int:
        """Upper bound of the whole frames that ``push`` of ``n_samples`` input samples yields
        (what the resampler still holds may come out with them)."""
        out = n_samples * SAMPLE_RATE / self.rate + self._held + 2  # + rounding
        return int((len(self._residue) + out) // FRAME_SAMPLES)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Append samples at the stream rate; returns the completed frames, float32 [n, 1920]."""
        if self._resampler is not None:
            taken = len(samples)
            samples = self._resampler.resample_chunk(samples)
            self._held = max(0.0, self._held + taken * SAMPLE_RATE / self.rate - len(samples))
        buf = np.concatenate((self._residue, samples)) if len(self._residue) else samples
        n = len(buf) // FRAME_SAMPLES
        self._residue = np.array(buf[n * FRAME_SAMPLES:], dtype=np.float32)
        return buf[: n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES)

    def pad_to_frame(self) -> np.ndarray | None:
        """The partial frame zero-padded to 1920 samples (input_audio_buffer.commit), or None."""
        if not len(self._residue):
            return None
        frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
        frame[: len(self._residue)] = self._residue
        self._residue = np.zeros(0, dtype=np.float32)
        return frame

    def clear(self) -> None:
        """Drop the partial frame and the resampler's history (input_audio_buffer.clear)."""
        self._residue = np.zeros(0, dtype=np.float32)
        self._resampler = self._new_resampler()
        self._held = 0.0


def float_to_pcm16(frames: np.ndarray) -> np.ndarray:
    """float32 [..., n] in [-1, 1] -> little-endian int16 (clipped; NaN becomes 0)."""
    clean = np.nan_to_num(frames, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.rint(np.clip(clean, -1.0, 1.0) * 32767.0).astype("<i2")


def pcm16_base64(pcm16: np.ndarray) -> str:
    return base64.b64encode(pcm16.astype("<i2", copy=False).tobytes()).decode("ascii")
