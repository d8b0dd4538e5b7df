"""torch.compile's portable artifacts (engines/fastpath/compile_artifacts.py): a start that
compiled writes one file; a start on a machine whose compile caches are empty reads it and
compiles nothing.  Real engines (the tiny checkpoint, compiled on the CPU with Inductor's C++
backend: the input embedding, the smallest compiled piece), each start a process of its own
with compile caches of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO)
from engines.runtime.factory import build_engine
from engines.spec import EngineSpec
engine = build_engine(EngineSpec(sys.argv[1], max_slots=1, device="cpu", compile="on", compile_artifacts=sys.argv[2]))
lm, cfg = engine.lm, engine.lm.cfg
B = 2
with torch.inference_mode():
    lm.embed_tokens(torch.zeros(B, 1, cfg.num_streams, dtype=torch.long))
engine.finish_compiling()
from torch._dynamo.utils import counters
print(json.dumps(dict(counters["inductor"])))
"""


def _start(checkpoint: Path, artifacts: Path | str, caches: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"), PERSONAPLEX_CACHE_DIR=str(caches / "project"))
    done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(artifacts)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"counts": json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


def test_a_fresh_machine_given_the_artifacts_compiles_nothing(tiny_checkpoint, tmp_path: Path):
    """Machine 1 finds a file torch cannot read where its artifacts belong: it says so,
    compiles, and replaces the file with what it compiled.  Machine 2, whose compile caches
    are empty, reads that file and compiles nothing."""
    import platform

    import torch

    from engines.fastpath.compile_artifacts import artifact_name

    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    path = artifacts / artifact_name(f"cpu-{platform.machine()}", torch.__version__, "auto", "auto")
    path.write_bytes(b"not torch's artifacts")
    first = _start(tiny_checkpoint, artifacts, tmp_path / "machine-1")
    assert "compile artifacts: could not load" in first["log"]
    assert first["counts"].get("fxgraph_cache_miss", 0) >= 1, first["counts"]
    assert "torch.compile this start:" in first["log"] and "compile artifacts: wrote" in first["log"]
    assert list(artifacts.glob("*.bin")) == [path] and path.read_bytes() != b"not torch's artifacts"

    # Another machine: its compile caches are empty, the artifact file is all it has.
    second = _start(tiny_checkpoint, artifacts, tmp_path / "machine-2")
    assert second["counts"].get("fxgraph_cache_miss", 0) == 0, second["counts"]
    assert second["counts"].get("fxgraph_cache_hit", 0) >= 1, second["counts"]
    assert "compile artifacts: loaded" in second["log"]
    # Everything came from the file: it is not written again.
    assert "compile artifacts: wrote" not in second["log"]


def test_off_reads_and_writes_nothing(monkeypatch, tmp_path: Path):
    from engines.fastpath import compile_artifacts

    monkeypatch.setenv("PERSONAPLEX_CACHE_DIR", str(tmp_path))
    assert compile_artifacts.artifacts_dir("off") is None
    assert compile_artifacts.CompileArtifacts.for_device("off", "cpu", "auto", "auto") is None
    assert compile_artifacts.artifacts_dir("auto") == tmp_path / "compile" / "artifacts"
    assert compile_artifacts.artifacts_dir("/srv/a") == Path("/srv/a")


def test_the_file_name_says_what_changes_the_compiled_code():
    from engines.fastpath.compile_artifacts import artifact_name

    assert artifact_name("NVIDIA H200", "2.11.0+cu130", "fp8", "fp8") == \
        "NVIDIA_H200-torch2.11.0+cu130-weights-fp8-kv-fp8.bin"
    assert artifact_name("NVIDIA A100-SXM4-80GB", "2.11.0", "auto", "auto") != \
        artifact_name("NVIDIA A100-SXM4-40GB", "2.11.0", "auto", "auto")
