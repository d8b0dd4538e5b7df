"""The capacity model (engines/tools/capacity_model.py) reproduces what was measured on the H200
from the parts it was fitted to, and predicts in the directions its terms say."""

from __future__ import annotations

import json
from pathlib import Path

from engines.tools import capacity_model as cm

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> dict[tuple[str, str, str], dict]:
    bench = json.loads((ROOT / cm.DEFAULT_FIT).read_text())
    int8_bench = json.loads((ROOT / cm.DEFAULT_INT8_FIT).read_text())
    return {(r["gpu"], r["weights"], r["kv_cache"]): r for r in cm.predict(bench, 60.0, int8_bench)}


def _windows() -> dict[str, float]:
    from engines.config import LMConfig, kv_window_bytes

    cfg = LMConfig()
    return {kv: kv_window_bytes(cfg.num_layers, cfg.num_heads, cfg.context, cfg.head_dim, 2, kv)
            for kv in ("auto", "fp8", "int8")}


def test_the_h200_figures_it_was_fitted_to_come_back():
    bench = json.loads((ROOT / cm.DEFAULT_FIT).read_text())
    rows = _rows()
    # The engine's memory plan on the H200 (2026-12-05, bf16 weights, fp8 KV) admitted 147.
    assert rows[("H200", "bf16", "fp8")]["memory_wall"] == 147
    # Its ticks from B = 8 up, within 6 % of the benchmark's p50s (5.2 % at B = 8 is the worst: a line
    # through a curve that bends where the fixed cost stops hiding the per-session reads).
    kv = _windows()["fp8"]
    fit = cm.fit_ticks(bench, kv)["bf16"]
    for row in bench["configs"]["fp8+compile"]["ours"]:
        if row["batch"] >= 8:
            predicted = cm.tick_ms(cm.H200, fit, kv, row["batch"])
            assert abs(predicted / row["tick_ms_p50"] - 1) < 0.06, (row["batch"], predicted, row["tick_ms_p50"])


def test_predictions_follow_memory_bandwidth_and_the_kv_format():
    rows = _rows()
    # An 8-bit window is half a bf16 one: about twice the sessions where memory bounds them.
    for gpu in ("A100-80GB", "H100-80GB", "H200"):
        bf16, int8 = rows[(gpu, "bf16", "bf16")], rows[(gpu, "bf16", "int8")]
        assert 1.8 <= int8["memory_wall"] / bf16["memory_wall"] <= 2.1, (gpu, bf16, int8)
    # More bandwidth, a faster lone session; more memory, more sessions.
    b1 = {g: rows[(g, "bf16", "int8")]["tick_ms_b1"] for g in ("L40S", "A100-80GB", "H100-80GB", "H200")}
    assert b1["L40S"] > b1["A100-80GB"] > b1["H100-80GB"] > b1["H200"], b1
    assert rows[("A100-40GB", "bf16", "int8")]["sessions"] < rows[("A100-80GB", "bf16", "int8")]["sessions"]
    # No fp8 KV where the GPU has no e4m3: the engine refuses it at start.
    assert ("A100-80GB", "bf16", "fp8") not in rows and ("H100-80GB", "bf16", "fp8") in rows


def test_it_predicts_the_h100_it_was_not_fitted_to():
    """An H100 with the A100's kernels and the int8 KV cache (2026-12-05, docs/PERFORMANCE.md,
    "A capacity model per GPU"): only its bandwidth differs from the H200 in the model."""
    h100_run = json.loads((ROOT / "docs/results/2026-12-05-h100-sm80-bench-int8.json").read_text())
    assert h100_run["gpu"].startswith("NVIDIA H100")
    bench = json.loads((ROOT / cm.DEFAULT_FIT).read_text())
    window = _windows()
    fit = cm.fit_ticks(bench, window["fp8"])["bf16"]
    h100 = next(g for g in cm.GPUS if g.name == "H100-80GB")
    ceiling = cm.kv_ceiling_tbs(h100, "int8", cm.fit_int8_ceiling(
        json.loads((ROOT / cm.DEFAULT_INT8_FIT).read_text()), fit, window["int8"]))
    rows = h100_run["configs"]["int8+compile"]["ours"]
    assert [r["batch"] for r in rows] == [1, 8, 32, 64, 66]
    for row in rows:
        predicted = cm.tick_ms(h100, fit, window["int8"], row["batch"], ceiling)
        # The lone session is the line's weak end (+10 %); from 8 sessions on within 7 %.
        allowed = 0.12 if row["batch"] == 1 else 0.07
        assert abs(predicted / row["tick_ms_p50"] - 1) < allowed, (row["batch"], predicted, row["tick_ms_p50"])


def test_the_h200_with_the_a100s_kernels():
    """The H200 with PERSONAPLEX_GPU_ARCH=sm80 (2026-12-05, docs/PERFORMANCE.md, "A capacity model
    per GPU"): the bf16 window, which the model was not fitted to, within 6 % from 8 sessions; the
    int8 window only with the int8 attention's ceiling, which its rows set (without it the model
    reads an int8 window as fast as an fp8 one and is 16 % short at the wall)."""
    run = json.loads((ROOT / cm.DEFAULT_INT8_FIT).read_text())
    assert run["gpu"] == "NVIDIA H200" and "taken as 8.0" in run["gpu_arch"]
    bench = json.loads((ROOT / cm.DEFAULT_FIT).read_text())
    window = _windows()
    fit = cm.fit_ticks(bench, window["fp8"])["bf16"]
    ceiling = cm.fit_int8_ceiling(run, fit, window["int8"])
    assert 2.8 < ceiling < cm.ETA_KV * cm.H200.bandwidth_tbs, ceiling  # below what the bandwidth allows
    for config, kv in (("bf16+compile", "auto"), ("int8+compile", "int8")):
        for row in run["configs"][config]["ours"]:
            if row["batch"] < 8:
                continue
            predicted = cm.tick_ms(cm.H200, fit, window[kv], row["batch"], cm.kv_ceiling_tbs(cm.H200, kv, ceiling))
            assert abs(predicted / row["tick_ms_p50"] - 1) < 0.06, (config, row["batch"], predicted, row["tick_ms_p50"])
    wall = run["configs"]["int8+compile"]["ours"][-1]
    assert cm.tick_ms(cm.H200, fit, window["int8"], wall["batch"]) < 0.88 * wall["tick_ms_p50"]
    # The memory plans the servers made on that H200: 147 sessions with int8 KV, 76 with bf16 KV.
    rows = _rows()
    assert rows[("H200", "bf16", "int8")]["memory_wall"] == 147
    assert rows[("H200", "bf16", "bf16")]["memory_wall"] == 76


def test_the_int8_ceiling_scales_with_the_gpus_integer_work():
    # The A100's and the H100's windows stay bandwidth-bound (as the H100 measured); the H200's does not.
    ceiling = 3.0
    for name in ("A100-80GB", "H100-80GB"):
        gpu = next(g for g in cm.GPUS if g.name == name)
        assert cm.kv_ceiling_tbs(gpu, "int8", ceiling) > cm.ETA_KV * gpu.bandwidth_tbs, name
    assert cm.kv_ceiling_tbs(cm.H200, "int8", ceiling) == ceiling < cm.ETA_KV * cm.H200.bandwidth_tbs
    assert cm.kv_ceiling_tbs(cm.H200, "fp8", ceiling) == float("inf")
