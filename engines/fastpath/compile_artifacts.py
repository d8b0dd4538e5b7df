"""torch.compile's work in one portable file: written after a start that compiled, read before
the next start's first compilation, so a new machine (a new replica, a new pod) starts as fast
as a restart of an old one.

The on-disk caches (``compiled.use_persistent_caches``) already make a restart on the same
machine skip Inductor and Triton; they are a directory tree of many small files that a
container loses.  torch's portable artifacts (``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts``) bundle the same entries (Inductor's FX graphs with their Triton
kernels, AOTAutograd's entries, autotuning results, the dynamic-shape decisions) into one
blob that an image or a volume carries; loading it fills the caches before the engine
compiles.  torch checks each entry against its own version, Triton's and the GPU, so a file
from another machine only ever costs the misses.

The file is named by what changes the compiled code: the GPU model, torch's version, the
weight and KV formats.  The slot count is not in the name: entries that do not match this
start are misses, and a start with misses writes the file again with everything it used
(torch records the entries it reads as well as those it writes).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from pathlib import Path

from engines import progress
from engines.config import default_cache_dir

log = logging.getLogger(__name__)

# The setting's two words; anything else is a directory.
AUTO, OFF = "auto", "off"


def artifacts_dir(setting: str) -> Path | None:
    """Where the artifacts live: ``auto`` = ``compile/artifacts`` in the project's cache
    directory, ``off`` = nowhere, else the directory named."""
    if setting == OFF:
        return None
    if setting == AUTO:
        return default_cache_dir() / "compile" / "artifacts"
    return Path(setting)


def artifact_name(gpu_name: str, torch_version: str, weights: str, kv_cache: str) -> str:
    """The file name for artifacts compiled on ``gpu_name`` by ``torch_version`` for the
    weight and KV formats given (what changes the compiled code)."""
    parts = (gpu_name, f"torch{torch_version}", f"weights-{weights}", f"kv-{kv_cache}")
    return "-".join(re.sub(r"[^A-Za-z0-9.+-]+", "_", p).strip("_") for p in parts) + ".bin"


class CompileArtifacts:
    """The artifact file of one engine's start: ``load`` before it compiles, ``save`` once
    everything it compiles at start-up is compiled."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loaded = False

    @classmethod
    def for_device(cls, setting: str, device: str, weights: str, kv_cache: str) -> "CompileArtifacts | None":
        import torch

        directory = artifacts_dir(setting)
        if directory is None:
            return None
        where = torch.device(device)
        hardware = torch.cuda.get_device_name(where) if where.type == "cuda" else f"{where.type}-{platform.machine()}"
        name = artifact_name(hardware, torch.__version__, weights, kv_cache)
        return cls(directory / name)

    def precompiled_dir(self) -> Path:
        """Where the pieces compiled ahead of time live (``fastpath.precompiled``): a directory
        beside the file, named as it is and by Python's version and the engine's source."""
        from engines.fastpath.precompiled import directory_name

        return self.path.parent / directory_name(self.path.stem)

    def load(self) -> bool:
        """Fill torch's compile caches from the file, if there is one.  A file torch cannot
        read is logged and left to be replaced: the start compiles as if it were absent."""
        import torch

        if not self.path.is_file():
            log.info("compile artifacts: none at %s; this start compiles and writes them there", self.path)
            return False
        progress.report(progress.COMPILE_ARTIFACTS, self.path.name)
        start = time.perf_counter()
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - a stale or damaged file must not stop the start
            log.warning("compile artifacts: could not load %s (%s: %s); compiling instead",
                        self.path, type(exc).__name__, exc)
            return False
        if info is None:  # torch logged why
            log.warning("compile artifacts: could not load %s (not torch's artifacts, or another torch's); "
                        "compiling instead", self.path)
            return False
        self.loaded = True
        log.info("compile artifacts: loaded %s (%.0f MB) in %.1f s: %s", self.path,
                 self.path.stat().st_size / 1e6, time.perf_counter() - start, _describe(info))
        return True

    def save(self) -> bool:
        """Write what this start compiled or read, unless the file it loaded served every
        compilation (nothing would change).  Atomic: a reader never sees half a file."""
        import torch

        if self.loaded and not compiled_anything():
            return False
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        blob, info = artifacts
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_bytes(blob)
            partial.replace(self.path)
        except OSError as exc:  # a read-only volume: the artifacts serve, they are not updated
            log.warning("compile artifacts: could not write %s (%s)", self.path, exc)
            return False
        log.info("compile artifacts: wrote %s (%.0f MB): %s", self.path, len(blob) / 1e6, _describe(info))
        return True


def compiled_anything() -> bool:
    """Whether this process compiled a graph its caches did not hold."""
    from torch._dynamo.utils import counters

    # Inductor's misses only: AOTAutograd counts a miss on a restart whose FX graphs all hit.
    return counters["inductor"].get("fxgraph_cache_miss", 0) > 0


def compile_report() -> str:
    """One line on what torch.compile did in this process: graphs, where they came from,
    and where its time went (the largest entries of dynamo's own timing table)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    inductor, stats = counters["inductor"], counters["stats"]
    top = sorted(((name, sum(seconds)) for name, seconds in compilation_time_metrics.items()),
                 key=lambda item: -item[1])[:8]
    return (f"{stats.get('unique_graphs', 0)} graphs ({inductor.get('fxgraph_cache_hit', 0)} from the caches, "
            f"{inductor.get('fxgraph_cache_miss', 0)} compiled); seconds: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in top))


def _describe(info) -> str:
    """Counts per kind of entry of a ``CacheInfo``."""
    kinds = [name for name in dir(info) if name.endswith("_artifacts") and not name.startswith("_")]
    counts = []
    for kind in kinds:
        try:
            entries = getattr(info, kind)
        except Exception:  # noqa: BLE001 - an attribute this torch does not fill
            continue
        if entries:
            counts.append(f"{kind.removesuffix('_artifacts')} {len(entries)}")
    return ", ".join(counts) or "empty"
