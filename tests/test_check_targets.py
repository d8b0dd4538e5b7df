"""``python -m engines.tools.check_targets``: every Triton kernel the engine may launch, compiled
for sm_80 and sm_90 on this CPU machine (issue 37).  The engine takes no e4m3 kernel on
sm_80, where Triton refuses them; a decision that took one there, or a kernel nobody
registered, fails the check.

Cost on the 2-core CI machine: ~15 s for the first run with an empty Triton cache (ten
launches x two targets, two compiling processes), a few seconds for the in-process checks
after it (they find its compiled kernels in the same cache)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from engines.fastpath import fp8_gemv, gpu_arch, kernel_registry  # noqa: E402
from engines.tools import check_targets  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
E4M3_LAUNCHES = {"attention._partial_kernel[lm fp8 cache]", "kv_write._write_kernel[lm fp8]",
                 *(f"fp8_gemv._fp8_rows_kernel[{rows}, {where}]" for rows in ("1 row", "2 rows")
                   for where in ("temporal", "depformer out"))}
REFUSED = "refused: type fp8e4nv not supported in this architecture"


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> Path:
    """A Triton cache of this file's own: the first check compiles everything."""
    return tmp_path_factory.mktemp("triton-cache")


def _rows(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in stdout.splitlines())}


def test_every_kernel_the_engine_takes_compiles_for_sm80_and_sm90(triton_cache):
    env = dict(os.environ, TRITON_CACHE_DIR=str(triton_cache), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "engines.tools.check_targets", "--arch", "80,90", "--jobs", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["kernel"] == ["sm_80", "sm_90"]
    names = {launch.name for launch in kernel_registry.launches()}
    assert E4M3_LAUNCHES < names and set(rows) >= names
    for name in names:
        sm80, sm90 = rows[name]
        assert sm90 == "ok", name  # the H200 takes and compiles all of them
        # The A100 takes none of the e4m3 ones, and Triton would refuse them there.
        assert sm80 == (f"not taken on this arch ({REFUSED})" if name in E4M3_LAUNCHES else "ok"), name
    assert "every kernel the engine would take compiles for sm_80, sm_90" in done.stdout


def test_the_engine_decides_e4m3_by_capability():
    taken = dict(zip((launch.name for launch in kernel_registry.launches()), check_targets.decisions([80, 86, 89, 90])))
    for name, row in taken.items():
        assert row == ([False, False, True, True] if name in E4M3_LAUNCHES else [True] * 4), name


def test_a_decision_that_takes_e4m3_on_sm80_fails_the_check(monkeypatch, triton_cache, capsys):
    """The planted fault: gpu_arch claims e4m3 on an A100."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    monkeypatch.setattr(gpu_arch, "has_fp8_e4m3", lambda capability: True)
    assert check_targets.main(["--arch", "80", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["kv_write._write_kernel[lm fp8]"] == [f"FAIL {REFUSED}"]
    assert rows["attention._partial_kernel[lm bf16 cache]"] == ["ok"]
    assert f"{len(E4M3_LAUNCHES)} kernel(s) the engine would take do not compile" in out


def test_a_module_that_ignores_gpu_arch_fails_the_check(monkeypatch, triton_cache, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    monkeypatch.setattr(fp8_gemv, "device_available", lambda device: True)
    assert check_targets.main(["--arch", "80", "--jobs", "1"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert rows["fp8_gemv._fp8_rows_kernel[1 row, temporal]"] == [f"FAIL {REFUSED}"]
    assert rows["kv_write._write_kernel[lm fp8]"][0].startswith("not taken")


def test_every_triton_kernel_under_engines_is_registered():
    found = kernel_registry.jit_functions()
    # Grepped and imported: each file's @triton.jit count matched its namespace (or this raised).
    assert {name.rsplit(".", 2)[1] for name in found} == {"attention", "kv_write", "fp8_gemv"}
    assert kernel_registry.unregistered() == []


def test_a_kernel_nobody_registered_fails_the_check(monkeypatch, triton_cache, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    everything = kernel_registry.launches
    monkeypatch.setattr(kernel_registry, "launches",
                        lambda: [launch for launch in everything() if not launch.name.startswith("kv_write")])
    assert kernel_registry.unregistered() == ["engines.fastpath.kv_write._quantize_store",
                                              "engines.fastpath.kv_write._round_half_even",
                                              "engines.fastpath.kv_write._write_kernel"]
    assert check_targets.main(["--arch", "90", "--jobs", "1"]) == 1
    assert "FAIL engines.fastpath.kv_write._write_kernel: a @triton.jit function" in capsys.readouterr().out
