"""Converter bookkeeping: which artifacts of a build directory are finished.

``manifest.json`` holds the fingerprint of the conversion (source files and options) and,
per finished step, the size, mtime and SHA-256 of every file it wrote.  A re-run with the
same fingerprint skips every step whose files are still intact (size and mtime unchanged,
or the same hash); a different fingerprint means the directory holds another conversion.
Every file is written under a temporary name and renamed, so an interrupted run never
leaves a half-written file that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engines.runtime.trtllm.layout import BuildLayout

MANIFEST_VERSION = 1


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def source_fingerprint(paths: list[Path | None]) -> list[dict[str, Any]]:
    """Identity of the source files (name, size, mtime): cheap, and enough to notice that
    a directory was converted from other weights."""
    out = []
    for p in paths:
        if p is None:
            continue
        if p.is_dir():
            files = sorted(q for q in p.rglob("*") if q.is_file())
            out.append({"path": str(p.resolve()), "files": [[str(q.relative_to(p)), q.stat().st_size] for q in files]})
        else:
            st = p.stat()
            out.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


class Manifest:
    def __init__(self, root: Path, fingerprint: dict[str, Any], steps: dict[str, dict[str, Any]] | None = None) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.steps: dict[str, dict[str, Any]] = steps or {}

    @property
    def path(self) -> Path:
        return BuildLayout(self.root).manifest

    @classmethod
    def read(cls, root: Path) -> Manifest | None:
        path = BuildLayout(root).manifest
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != MANIFEST_VERSION:
                return None
            return cls(root, data["fingerprint"], data["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": MANIFEST_VERSION, "fingerprint": self.fingerprint, "steps": self.steps},
                                  indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def is_done(self, step: str) -> bool:
        """True if ``step`` finished and every file it wrote is intact."""
        entry = self.steps.get(step)
        if entry is None:
            return False
        for rel, rec in entry["files"].items():
            path = self.root / rel
            if not path.is_file():
                return False
            st = path.stat()
            if st.st_size != rec["size"]:
                return False
            if st.st_mtime_ns != rec["mtime_ns"] and sha256_file(path) != rec["sha256"]:
                return False
        return True

    def record(self, step: str, files: list[Path], info: dict[str, Any] | None = None) -> None:
        self.steps[step] = {"files": {str(f.relative_to(self.root)): file_record(f) for f in sorted(files)},
                            "info": info or {}}
        self.save()

    def forget(self, step: str) -> None:
        if self.steps.pop(step, None) is not None:
            self.save()

    def owned_files(self) -> list[Path]:
        return [self.root / rel for entry in self.steps.values() for rel in entry["files"]]


def atomic_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before ``commit`` renames it (its
    directory is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name("." + path.name + ".partial")


def commit(path: Path) -> Path:
    os.replace(atomic_path(path), path)
    return path
