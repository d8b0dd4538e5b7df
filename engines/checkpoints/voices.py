"""Voice prompts: find them by name and read the PersonaPlex ``.pt`` format.

A voice ``.pt`` is a ``torch.save``d dict with
- ``embeddings``: [N-1, 1, 1, D] summed input embeddings of the voice-prompt run (one row
  per model call; the first of the N voice frames never reaches the model);
- ``cache``: [1, 17, 4] the delayed-token ring at the end of that run.
Lookup order for a name: an operator's voice directory (``add_directory``, e.g.
``PERSONAPLEX_VOICE_DIR``), ``<voices dir>/<name>``, ``<checkpoint>/<name>``, then the member
of ``voices.tgz`` with that basename (the archive is read once).
"""

from __future__ import annotations

import io
import logging
import tarfile
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from engines.audio_io import frames_of, normalize_loudness
from engines.errors import AudioInputError, CheckpointError
from engines.interface import InvalidSessionSpec, PrefillUnavailable, check_voice_name, shown
from engines.model.prefill import VoicePrompt

log = logging.getLogger(__name__)


def parse_voice_file(data: dict, dim: int, num_streams: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a loaded voice dict; returns (embeddings [N-1, D] float32, cache [17, 4])."""
    if not isinstance(data, dict) or "embeddings" not in data or "cache" not in data:
        raise CheckpointError(f"{source}: a voice file must hold a dict with 'embeddings' and 'cache'")
    emb, cache = data["embeddings"], data["cache"]
    if not isinstance(emb, torch.Tensor) or not isinstance(cache, torch.Tensor):
        raise CheckpointError(f"{source}: 'embeddings' and 'cache' must be tensors")
    if emb.dim() < 2 or emb.shape[-1] != dim or emb.numel() == 0:
        raise CheckpointError(f"{source}: 'embeddings' has shape {tuple(emb.shape)}, expected [N-1, 1, 1, {dim}]")
    emb = emb.reshape(-1, dim)
    if tuple(cache.shape) not in ((1, num_streams, 4), (num_streams, 4)):
        raise CheckpointError(f"{source}: 'cache' has shape {tuple(cache.shape)}, expected [1, {num_streams}, 4]")
    if cache.dtype.is_floating_point or not torch.isfinite(emb.float()).all():
        raise CheckpointError(f"{source}: 'cache' must be integer and 'embeddings' finite")
    return emb.float(), cache.reshape(num_streams, 4).long()


def random_voice_data(dim: int, initial_tokens: Sequence[int], frames: int = 60, seed: int = 2) -> dict:
    """A voice file's dict (``embeddings``, ``cache``) with ``frames`` voice frames of random
    embeddings at width ``dim``, and the model's initial tokens in the ring: the cost and
    shape of a real voice prompt, for random-weight engines (benchmarks, ``random:``
    checkpoints)."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(frames - 1, dim, generator=gen) * 0.02
    cache = torch.tensor(list(initial_tokens)).view(-1, 1).repeat(1, 4)
    return {"embeddings": emb, "cache": cache}


class VoiceStore:
    """Voices of one checkpoint, loaded on demand and kept (they are small)."""

    def __init__(self, voices_dir: Path | None, root: Path | None, archive: Path | None, dim: int, num_streams: int) -> None:
        self.operator_dirs: list[Path] = []  # searched first (add_directory)
        self.voices_dir = voices_dir
        self.root = root
        self.archive = archive
        self.dim = dim
        self.num_streams = num_streams
        self._archive_members: dict[str, bytes] | None = None
        self._loaded: dict[str, VoicePrompt] = {}
        self._registered: set[str] = set()
        self._lock = threading.Lock()

    def _archive(self) -> dict[str, bytes]:
        if self._archive_members is None:
            members: dict[str, bytes] = {}
            if self.archive is not None:
                try:
                    with tarfile.open(self.archive, "r:*") as tar:
                        for m in tar.getmembers():
                            base = Path(m.name).name
                            if m.isfile() and base.endswith(".pt") and base not in members:
                                f = tar.extractfile(m)
                                if f is not None:
                                    members[base] = f.read()
                except (tarfile.TarError, OSError) as exc:
                    raise CheckpointError(f"cannot read voice archive {self.archive}: {exc}") from exc
            self._archive_members = members
        return self._archive_members

    def add_directory(self, directory: str | Path) -> list[str]:
        """Serve the ``.pt`` voices of ``directory`` too, ahead of the checkpoint's own (a
        name in both is this directory's).  Every file is read and checked now, so a bad one
        is one ``CheckpointError`` naming it, at start-up rather than at a session's open.
        Returns the names found."""
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            raise CheckpointError(f"voice directory {directory} does not exist or is not a directory")
        names = sorted(p.name for p in directory.glob("*.pt") if p.is_file())
        for name in names:
            source = str(directory / name)
            try:
                check_voice_name(name)
                data = torch.load(directory / name, map_location="cpu", weights_only=True)
            except Exception as exc:  # unpickling errors come in many types
                raise CheckpointError(f"voice file {source} cannot be read: {exc}") from exc
            parse_voice_file(data, self.dim, self.num_streams, source)  # CheckpointError naming it
        shadowed = sorted(set(names) & set(self.names()))
        if shadowed:
            log.warning("voices in %s replace the checkpoint's of the same name: %s", directory, ", ".join(shadowed))
        self.operator_dirs.insert(0, directory)
        with self._lock:
            for name in names:
                self._loaded.pop(name, None)
        return names

    def _directories(self) -> list[Path]:
        return [d for d in (*self.operator_dirs, self.voices_dir, self.root) if d is not None]

    def names(self) -> list[str]:
        found: set[str] = set()
        for d in self._directories():
            if d.is_dir():
                found.update(p.name for p in d.glob("*.pt"))
        found.update(self._archive())
        found.update(self._registered)
        return sorted(found)

    def check(self, name: str) -> None:
        """``InvalidSessionSpec`` unless ``name`` is a well-formed name of a known voice."""
        check_voice_name(name)
        if name not in self.names():
            raise InvalidSessionSpec(f"unknown voice {shown(name)}; available: {', '.join(self.names()) or 'none'}")

    def load(self, name: str) -> VoicePrompt:
        check_voice_name(name)
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            raw, source = self._read(name)
            try:
                data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as exc:  # unpickling errors come in many types
                raise PrefillUnavailable(f"voice {shown(name)} could not be read ({source}): {exc}") from exc
            try:
                emb, cache = parse_voice_file(data, self.dim, self.num_streams, source)
            except CheckpointError as exc:
                raise PrefillUnavailable(str(exc)) from exc
            prompt = VoicePrompt(name, emb, cache)
            self._loaded[name] = prompt
            return prompt

    def register(self, name: str, data: dict) -> None:
        """Add an in-memory voice (e.g. one just built from a WAV) under ``name``."""
        check_voice_name(name)
        emb, cache = parse_voice_file(data, self.dim, self.num_streams, name)
        with self._lock:
            self._loaded[name] = VoicePrompt(name, emb, cache)
            self._registered.add(name)

    def _read(self, name: str) -> tuple[bytes, str]:
        for d in self._directories():
            if (d / name).is_file():
                return (d / name).read_bytes(), str(d / name)
        members = self._archive()
        if name in members:
            return members[name], f"{self.archive}:{name}"
        raise InvalidSessionSpec(f"unknown voice {shown(name)}; available: {', '.join(self.names()) or 'none'}")


MIN_VOICE_FRAMES = 2


def build_voice_prompt(engine, pcm: np.ndarray) -> dict[str, torch.Tensor]:
    """Voice ``.pt`` contents for 24 kHz mono ``pcm`` of a speaker, loudness-normalised here as
    NVIDIA's reference does (``engine``: a ``PersonaPlexEngine``, ``encode_voice``)."""
    pcm = normalize_loudness(np.asarray(pcm, dtype=np.float32))
    frames = frames_of(pcm)
    if frames.shape[0] < MIN_VOICE_FRAMES:
        raise AudioInputError(f"voice audio must be at least {MIN_VOICE_FRAMES} frames (160 ms) long")
    return engine.encode_voice(frames)
