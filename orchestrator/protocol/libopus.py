"""libopus through ``ctypes``: Opus packets of one mono stream in and out, the interpreter lock
released for each encode and decode.

A ``ctypes.CDLL`` call drops the interpreter lock for as long as the C function runs (CPython's
``_ctypes`` wraps every foreign call of a ``CDLL``, unlike a ``PyDLL``, in
``Py_BEGIN_ALLOW_THREADS``), so a front-end worker's event loop keeps running while its codec
threads encode, and several codec threads encode on several cores at once.  What the lock still
covers per frame is the call's argument handling and the Ogg page around the packet
(``protocol/ogg.py``); the figures are in docs/PERFORMANCE.md, "Opus off the interpreter lock".

The library is the system's (Debian ``libopus0``), or the file the server's settings name
(``PERSONAPLEX_OPUS_LIBRARY``, handed to ``use`` at start-up).  Encoding settings are the ones
sphn's writer uses (the VOIP application, libopus's default bitrate and complexity): on speech
both gave the same packets byte for byte (libopus 1.3.1 against sphn 0.1.12's, 200 frames of
tests/data/input_assistant.wav), so the route's bytes are the ones NVIDIA's server sends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache

import numpy as np

from .audio import AudioError

log = logging.getLogger(__name__)

APPLICATION_VOIP = 2048
MAX_PACKET_BYTES = 4000  # libopus's recommended ceiling for one packet
MAX_PACKET_MS = 120  # the longest packet Opus allows (RFC 6716, section 3.2.5)

_OK = 0


class OpusUnavailable(RuntimeError):
    """No libopus could be loaded; the message says what was tried."""


_configured: str | None = None  # the path the settings name, if any (``use``)


def use(path: str | None) -> None:
    """Load libopus from ``path`` (None: the system's) from now on; raises ``OpusUnavailable``
    at once if it cannot be loaded."""
    global _configured
    load(path)
    _configured = path


def load(path: str | None = None) -> ctypes.CDLL:
    """The library at ``path``, else the one ``use`` named, else the system's."""
    return _load(path or _configured)


@lru_cache(maxsize=None)
def _load(path: str | None) -> ctypes.CDLL:
    candidates = [path] if path else []
    if not candidates:
        candidates = [name for name in (ctypes.util.find_library("opus"), "libopus.so.0") if name]
    errors = []
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)  # CDLL, not PyDLL: each call releases the interpreter lock
        except OSError as exc:
            errors.append(f"{candidate}: {exc}")
            continue
        _declare(lib)
        return lib
    raise OpusUnavailable("libopus could not be loaded (" + "; ".join(errors or ["not found"]) + "); install "
                          "Debian's libopus0 or set PERSONAPLEX_OPUS_LIBRARY to the library's file")


def available() -> bool:
    try:
        load()
    except OpusUnavailable:
        return False
    return True


def version() -> str:
    return load().opus_get_version_string().decode()


def _declare(lib: ctypes.CDLL) -> None:
    void_p, c_int, int_p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    lib.opus_get_version_string.restype = ctypes.c_char_p
    lib.opus_strerror.argtypes = [c_int]
    lib.opus_strerror.restype = ctypes.c_char_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, c_int, c_int, int_p]
    lib.opus_encoder_create.restype = void_p
    lib.opus_encoder_destroy.argtypes = [void_p]
    lib.opus_encoder_destroy.restype = None
    lib.opus_encode_float.argtypes = [void_p, void_p, c_int, void_p, ctypes.c_int32]
    lib.opus_encode_float.restype = ctypes.c_int32
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, c_int, int_p]
    lib.opus_decoder_create.restype = void_p
    lib.opus_decoder_destroy.argtypes = [void_p]
    lib.opus_decoder_destroy.restype = None
    lib.opus_decode_float.argtypes = [void_p, ctypes.c_char_p, ctypes.c_int32, void_p, c_int, c_int]
    lib.opus_decode_float.restype = c_int


def _error(lib: ctypes.CDLL, code: int) -> str:
    return lib.opus_strerror(code).decode(errors="replace")


class OpusEncoder:
    """One mono stream's encoder: ``encode`` takes one frame of float32 samples (a length Opus
    allows at this rate: 2.5 to 120 ms) and returns its packet."""

    def __init__(self, sample_rate: int, *, library: str | None = None) -> None:
        self._lib = load(library)
        status = ctypes.c_int()
        self._state = self._lib.opus_encoder_create(sample_rate, 1, APPLICATION_VOIP, ctypes.byref(status))
        if status.value != _OK or not self._state:
            raise ValueError(f"libopus refused an encoder at {sample_rate} Hz: {_error(self._lib, status.value)}")
        self._out = ctypes.create_string_buffer(MAX_PACKET_BYTES)
        self._destroy = self._lib.opus_encoder_destroy

    def encode(self, pcm: np.ndarray) -> bytes:
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        size = self._lib.opus_encode_float(self._state, pcm.ctypes.data, len(pcm), self._out, MAX_PACKET_BYTES)
        if size < 0:
            raise ValueError(f"libopus could not encode {len(pcm)} samples: {_error(self._lib, size)}")
        return self._out.raw[:size]

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._destroy(state)


class OpusDecoder:
    """One stream's decoder to mono float32 (a stereo stream is mixed down by libopus).  A
    packet Opus cannot decode raises ``AudioError("bad_audio")``."""

    def __init__(self, sample_rate: int, *, library: str | None = None) -> None:
        self._lib = load(library)
        status = ctypes.c_int()
        self._state = self._lib.opus_decoder_create(sample_rate, 1, ctypes.byref(status))
        if status.value != _OK or not self._state:
            raise ValueError(f"libopus refused a decoder at {sample_rate} Hz: {_error(self._lib, status.value)}")
        self._max_samples = sample_rate * MAX_PACKET_MS // 1000
        self._out = np.empty(self._max_samples, dtype=np.float32)
        self._destroy = self._lib.opus_decoder_destroy

    def decode(self, packet: bytes, samples: int) -> np.ndarray:
        """The packet's samples (a copy: the decoder's buffer is reused).  ``samples``: what
        the packet's TOC says it holds (``ogg_opus.opus_packet_samples``), the most it may
        decode to: a packet that would decode to more is refused, so that audio can never
        outgrow what a stream's budget counted.  A packet must not be empty (libopus decodes
        an empty one as a lost packet: concealment of any length asked)."""
        if not packet:
            raise ValueError("an empty packet is a lost packet, not audio")
        size = self._lib.opus_decode_float(self._state, packet, len(packet), self._out.ctypes.data,
                                           min(samples, self._max_samples), 0)
        if size < 0:
            # libopus's own words stay in the log: the client gets ours.
            log.debug("libopus could not decode a packet of %d bytes: %s", len(packet), _error(self._lib, size))
            raise AudioError("bad_audio", "an Opus packet could not be decoded")
        return self._out[:size].copy()

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._destroy(state)
