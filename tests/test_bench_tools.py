"""The GPU benchmark's CPU-side pieces: variant parsing and the tick-vs-B plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.tools import bench_plot
from engines.tools.bench import WALL, BenchConfig, main, parse_batch_sizes

RESULT = Path(__file__).resolve().parents[1] / "docs" / "results" / "2026-12-01-h200-bench-fp8-compile.json"


def test_bench_configs_parse_and_reject_unknown_variants():
    assert BenchConfig.parse("fp8+compile") == BenchConfig("fp8+compile", "fp8", True)
    assert BenchConfig.parse("bf16") == BenchConfig("bf16", "auto", False)
    assert BenchConfig.parse("fp8w+fp8+compile") == BenchConfig("fp8w+fp8+compile", "fp8", True, "fp8", "auto")
    assert BenchConfig.parse("fp8w-w8a16") == BenchConfig("fp8w-w8a16", "auto", False, "fp8", "w8a16")
    assert BenchConfig.parse("int8+compile") == BenchConfig("int8+compile", "int8", True)
    for bad in ("fp16", "bf16+fast", "fp8+compile+x", "bf16+fp8", "fp8+int8", "fp8w+fp8w-w8a16", "compile+compile",
                ""):
        with pytest.raises(ValueError, match="bad config"):
            BenchConfig.parse(bad)


def test_batch_sizes_parse_with_the_memory_wall_and_reject_bad_values(capsys):
    assert parse_batch_sizes("1,8, 128") == [1, 8, 128]
    assert parse_batch_sizes("1,wall,") == [1, WALL]
    for bad in ("0,8", "-1", "", "1,x", "1.5"):
        with pytest.raises(ValueError, match="bad --batch-sizes"):
            parse_batch_sizes(bad)
    with pytest.raises(SystemExit):
        main(["--batch-sizes", "1,all", "--output", "x.json"])
    assert "bad --batch-sizes '1,all'" in capsys.readouterr().err


def test_plot_of_a_recorded_report(tmp_path):
    out = tmp_path / "tick.png"
    assert bench_plot.main([str(RESULT), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    b, p50, p99 = bench_plot.series(json.loads(RESULT.read_text())["configs"]["bf16"]["ours"])
    assert b == [1, 8, 32, 64] and all(a <= c for a, c in zip(p50, p99))  # rows that did not fit are skipped


def test_plot_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert bench_plot.main([str(bad), "--output", str(tmp_path / "x.png")]) == 2
    assert "not an engines.tools.bench report" in capsys.readouterr().err
    assert bench_plot.main([str(tmp_path / "missing.json"), "--output", str(tmp_path / "x.png")]) == 2


def test_the_opus_worker_bench_decodes_every_page_and_reports(tmp_path, capsys):
    """The native route's Opus bench on real speech: every client page comes back as PCM, every
    tick's encodes come back, and the JSON says what ran."""
    from tests.e2e.online_serving import opus_worker_bench

    out = tmp_path / "opus.json"
    assert opus_worker_bench.main(["--sessions", "3", "--seconds", "0.8", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pages_decoded"] == result["pages_sent"] == 3 * 10 and result["ticks"] == 10
    for key in ("decode_latency_ms", "tick_encode_ms", "loop_timer_late_ms"):
        assert 0 <= result[key]["p50"] <= result[key]["p99"] <= result[key]["max"]
    assert result["sessions"] == 3 and result["git_revision"] and isinstance(result["cpu_cores_by_thread"], dict)
    assert "decode_latency_ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        opus_worker_bench.main(["--sessions", "0"])


def test_the_fp8_product_benchmark_says_it_needs_a_gpu(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the benchmark would run")
    done = subprocess.run([sys.executable, "-m", "engines.tools.bench_fp8_gemm", "--output", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1] == "bench_fp8_gemm: needs a CUDA GPU"
    assert not (tmp_path / "x.json").exists()
