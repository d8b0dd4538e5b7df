"""torch.compile's portable artifacts (engines/fastpath/compile_artifacts.py): a start that
compiled writes one file; a start on a machine whose compile caches are empty reads it and
compiles nothing.  Real engines (the tiny checkpoint, compiled on the CPU with Inductor's C++
backend: the input embedding, the smallest compiled piece), each start a process of its own
with compile caches of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO)
from engines.fastpath import precompiled
if len(sys.argv) > 4:  # another engine source, as far as the precompiled pieces can tell
    precompiled.source_hash = lambda: sys.argv[4]
from engines.runtime.factory import build_engine
from engines.spec import EngineSpec
engine = build_engine(EngineSpec(sys.argv[1], max_slots=1, device="cpu", compile="on", compile_artifacts=sys.argv[2]))
lm, cfg = engine.lm, engine.lm.cfg
g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    # The input embedding (precompiled: a variant for the ticks' batches, one for a batch of 1)
    # and the static-shape sampler (graph breaks: torch.compile, its caches in the artifacts).
    outputs = [lm.embed_tokens(torch.randint(0, cfg.card, (B, 1, cfg.num_streams), generator=g)) for B in (2, 1)]
    logits, noise = torch.randn(2, cfg.card, generator=g), torch.rand(2, cfg.card, generator=g)
    outputs.append(engine._sample_static(logits, torch.ones(2), torch.full((2,), 5), torch.tensor([True, False]),
                                         noise))
engine.finish_compiling()
torch.save(outputs, sys.argv[3])
from torch._dynamo.utils import counters
print(json.dumps({**counters["inductor"], "graphs": counters["stats"].get("unique_graphs", 0),
                  **{kind.replace(" ", "_"): n for kind, n in precompiled.TALLY.counts.items()}}))
"""


def _start(checkpoint: Path, artifacts: Path | str, caches: Path, *source: str) -> dict:
    """One engine start in a process of its own, with compile caches of its own (``caches``):
    its counts, log and outputs."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"), PERSONAPLEX_CACHE_DIR=str(caches / "project"))
    outputs = caches / "outputs.pt"
    done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(artifacts), str(outputs), *source],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    return {"counts": json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr,
            "outputs": torch.load(outputs)}


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_fresh_machine_given_the_artifacts_compiles_nothing(tiny_checkpoint, tmp_path: Path):
    """Machine 1 finds a file torch cannot read where its artifacts belong: it says so,
    compiles, and replaces the file with what it compiled; its precompiled pieces write a file
    per variant beside it.  Machine 2, whose compile caches are empty, reads those files,
    traces no precompiled piece and computes the same; the artifact file serves what stays on
    torch.compile.  Machine 3 runs another engine source (the files are keyed by it): it
    compiles again, and a file of another variant planted where its batch-of-1 variant belongs
    is refused by its guards, said so, compiled again and replaced."""
    import platform
    import shutil

    import torch

    from engines.fastpath.compile_artifacts import CompileArtifacts, artifact_name

    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    path = artifacts / artifact_name(f"cpu-{platform.machine()}", torch.__version__, "auto", "auto")
    path.write_bytes(b"not torch's artifacts")
    first = _start(tiny_checkpoint, artifacts, tmp_path / "machine-1")
    assert "compile artifacts: could not load" in first["log"]
    assert first["counts"].get("fxgraph_cache_miss", 0) >= 1, first["counts"]
    assert first["counts"].get("compiled") == 2 and "loaded" not in first["counts"], first["counts"]
    assert "torch.compile this start:" in first["log"] and "compile artifacts: wrote" in first["log"]
    assert "precompiled variants this start: 0 loaded" in first["log"]
    assert list(artifacts.glob("*.bin")) == [path] and path.read_bytes() != b"not torch's artifacts"
    variants = CompileArtifacts(path).precompiled_dir()
    files = sorted(variants.glob("engines.model.lm.embed_streams-*.aot"))
    assert len(files) == 2, list(variants.iterdir())

    # Another machine: its compile caches are empty, the artifacts are all it has.
    second = _start(tiny_checkpoint, artifacts, tmp_path / "machine-2")
    assert second["counts"].get("loaded") == 2 and "compiled" not in second["counts"], second["counts"]
    assert second["counts"]["graphs"] == 1, second["counts"]  # the sampler's: nothing precompiled traced
    assert _same(second["outputs"], first["outputs"])
    assert second["counts"].get("fxgraph_cache_miss", 0) == 0, second["counts"]
    assert second["counts"].get("fxgraph_cache_hit", 0) >= 1, second["counts"]
    assert "compile artifacts: loaded" in second["log"]
    # Everything came from the artifacts: they are not written again.
    assert "compile artifacts: wrote" not in second["log"]
    assert "precompiled" not in " ".join(line for line in second["log"].splitlines() if "WARNING" in line)

    # Another engine source: other files.  Its batch-of-1 file is planted (the batch-of-2 one).
    changed = variants.with_name(variants.name.rsplit("-src", 1)[0] + "-srcchanged")
    changed.mkdir()
    batch_2, batch_1 = (variants / name for name in re.findall(r"embed_streams: compiled (\S+)", first["log"]))
    shutil.copy(batch_2, changed / batch_1.name)
    third = _start(tiny_checkpoint, artifacts, tmp_path / "machine-1", "changed")
    assert third["counts"].get("compiled") == 2 and "loaded" not in third["counts"], third["counts"]
    assert f"{batch_1.name} its guards refuse the call it is keyed for" in third["log"]
    assert _same(third["outputs"], first["outputs"])
    assert (changed / batch_1.name).read_bytes() not in (batch_2.read_bytes(), b"")
    assert sorted(p.name for p in changed.iterdir()) == [f.name for f in files]


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
