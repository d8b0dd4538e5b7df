"""torch.compile's caches live in the project's cache directory and a second start reuses
them (engines/fastpath/compiled.py).  The GPU tick's compiled pieces do not compile on CPU, so a
small function goes through the same ``compile_dynamic`` in two fresh processes: Inductor
on CPU, its real FX-graph cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMPILE_ONCE = """
import json, torch
from engines.fastpath.compiled import compile_dynamic
step = compile_dynamic(lambda x: torch.tanh(x * 2.0) + x.cos())
step(torch.randn(4, 16))
from torch._dynamo.utils import counters
print(json.dumps(dict(counters["inductor"])))
"""


def _start(env: dict[str, str], code: str = COMPILE_ONCE) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    clean.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=300)


def test_a_second_start_reuses_the_compiled_graphs(tmp_path: Path):
    env = {"PERSONAPLEX_CACHE_DIR": str(tmp_path)}
    first = _start(env)
    assert first.returncode == 0, first.stderr[-3000:]
    counts = json.loads(first.stdout.strip().splitlines()[-1])
    assert counts.get("fxgraph_cache_miss", 0) >= 1 and counts.get("fxgraph_cache_hit", 0) == 0, counts
    assert any((tmp_path / "compile" / "inductor" / "fxgraph").iterdir())  # not in /tmp
    second = _start(env)
    assert second.returncode == 0, second.stderr[-3000:]
    counts = json.loads(second.stdout.strip().splitlines()[-1])
    assert counts.get("fxgraph_cache_hit", 0) >= 1 and counts.get("fxgraph_cache_miss", 0) == 0, counts


def test_an_operators_own_cache_directories_win(tmp_path: Path, monkeypatch):
    from engines.fastpath.compiled import use_persistent_caches

    monkeypatch.setenv("PERSONAPLEX_CACHE_DIR", str(tmp_path / "p"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "i"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    use_persistent_caches()
    assert (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]) == (str(tmp_path / "i"),
                                                                                    str(tmp_path / "t"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    use_persistent_caches()
    assert (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]) == (
        str(tmp_path / "p" / "compile" / "inductor"), str(tmp_path / "p" / "compile" / "triton"))


def _compilations(shapes: list[tuple[int, ...]]) -> int:
    """How many times ``compile_dynamic`` compiles a tick-shaped function fed these shapes."""
    import torch
    from torch._dynamo.utils import counters

    from engines.fastpath.compiled import compile_dynamic

    torch._dynamo.reset()
    counters.clear()
    step = compile_dynamic(lambda x: torch.tanh(x * 2.0) + x.cos() + x.mean(dim=1, keepdim=True))
    for shape in shapes:
        step(torch.randn(shape))
    return counters["stats"]["unique_graphs"]


def test_a_lone_slot_is_no_compilation_of_its_own(tmp_path: Path, monkeypatch):
    """torch specialises a batch of exactly 1, so a 1-slot tick graph would compile the tick a
    second time at every start (engines/fastpath/graphs.py); compiled engines pad it to 2."""
    from engines.fastpath.graphs import tick_buckets

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    requested = (1, 2, 4, 8, 16)
    assert tick_buckets(requested, 12, compiled=False) == [1, 2, 4, 8, 12]
    buckets = tick_buckets(requested, 12, compiled=True)
    assert buckets == [2, 4, 8, 12]
    assert _compilations([(b, 16) for b in (1, *buckets)]) == 2  # what bucket 1 used to cost
    assert _compilations([(b, 16) for b in buckets]) == 1
    assert tick_buckets((1, 2, 4), 1, compiled=True) == [1]  # one slot: nothing to pad to
    assert tick_buckets((1, 4), 6, compiled=True) == [2, 4, 6]


def test_a_batch_first_seen_equal_to_another_dimension_is_not_tied_to_it(tmp_path: Path, monkeypatch):
    """Mimi's transformer sees [batch, 2 time steps, ...]: in the 2-slot graph both are 2.  With
    torch's duck sizing the two shared one symbol and the 4-slot graph compiled again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert _compilations([(2, 2, 16), (4, 2, 16), (8, 2, 16)]) == 1
