"""Sessions per GPU and the lone session's tick, predicted for GPUs we have not measured from
the parts of a tick measured on the H200.

A tick at B sessions reads the model's weights once and every session's KV window once, and
pays a fixed cost (thousands of small kernels: Mimi, the depformer's few-row steps, sampling)
that hardly depends on B:

    tick(B) = fixed + weights / (eta_w * bandwidth) + B * (kv_window / (eta_kv * bandwidth) + per_session)

- ``eta_kv``: the share of the peak bandwidth the decode attention reaches (H200, 3.95 of
  4.8 TB/s on an fp8 window at B = 128: docs/PERFORMANCE.md, "GPU: lockstep tick").
- ``eta_w``: the same for the weight-reading GEMMs (~3.7 of 4.8 TB/s at B = 1, same section).
- An int8 window is read no faster than the int8 attention converts it: on the H200 that
  kernel reached 3.0 TB/s of window bytes, not 3.95 (``--int8-fit``: the H200's benchmark with
  the A100's kernels forced, its int8 rows from B = 8 up), a ceiling of the SMs' integer work
  rather than of memory.  Other GPUs get it scaled by SMs x boost clock; below it (the H100,
  the A100s, the L40S) the window is bandwidth-bound as fp8's is.
- ``per_session`` and ``fixed``: fitted to the H200 benchmark given (``--fit``: a
  ``engines.tools.bench`` JSON; its fp8-KV rows from B = 8 up, least squares), per weight format.
- Sessions at the wall: the engine's own memory plan (``engines.runtime.memory_plan``), with
  the GPU's memory and the items measured on the H200 (graphs, joins, other processes).
- Sessions in real time: the largest B whose tick is at most ``--max-tick-ms`` (60 ms: the
  server held every session at ticks of ~50 ms, and the paced policy keeps the engine busy
  70 % of the 80 ms frame).
- Capacity: the smaller of the two.

Assumptions that make every non-H200 figure a prediction: the fixed cost is the H200's (a
GPU with fewer SMs or lower clocks pays more); the bandwidth shares carry over; fp8 weights
on a GPU without fp8 tensor cores save memory but no time (W8A16 reads the fp8 weight and
multiplies in bf16), so their tick is predicted with the bf16 weights' fixed cost and bytes.

    python -m engines.tools.capacity_model [--fit docs/results/2026-12-04-h200-bench-same-run-210e8b8.json]
        [--int8-fit docs/results/2026-12-05-h200-sm80-bench.json] [--output capacity.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1e9
GIB = 2**30

DEFAULT_FIT = "docs/results/2026-12-04-h200-bench-same-run-210e8b8.json"
# The H200 with PERSONAPLEX_GPU_ARCH=sm80: the int8 attention's rows (and bf16 KV's).
DEFAULT_INT8_FIT = "docs/results/2026-12-05-h200-sm80-bench.json"
ETA_KV = 3.95 / 4.8
ETA_W = 3.7 / 4.8
# What the H200's plan measured beside the sessions and weights (2026-12-05, issue 34):
# CUDA graph pools, one join of the longest prompt, other processes' memory.
GRAPHS_GIB, JOINS_GIB, NOT_OURS_GIB = 5.00, 1.61, 0.91


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what torch reports as the device's total
    bandwidth_tbs: float  # peak memory bandwidth, the vendor's figure
    capability: tuple[int, int]
    sms: int  # streaming multiprocessors and boost clock (GHz): what integer work scales with
    boost_ghz: float

    @property
    def fp8(self) -> bool:
        return self.capability >= (8, 9)


# Totals as torch reports them (``total_memory``, what the memory plan starts from): the H200's
# measured here (139.80 GiB), the H100's inferred from a benchmark run here (2026-12-05: reserved
# + free + the CUDA context, ~79.1 GiB, as its users' out-of-memory messages also read); the
# others the lowest that users' out-of-memory messages show for the card (A100 40 GB 39.39-39.59,
# A100 80 GB 79.14-79.35, L40S 44.42 GiB).  Not the nominal "80 GB": 80 GiB less the driver's.
GPUS = (
    Gpu("A100-40GB", 39.39, 1.555, (8, 0), 108, 1.41),
    Gpu("A100-80GB", 79.14, 2.039, (8, 0), 108, 1.41),
    Gpu("L40S", 44.42, 0.864, (8, 9), 142, 2.52),
    Gpu("H100-80GB", 79.11, 3.35, (9, 0), 132, 1.98),
    Gpu("H200", 139.80, 4.8, (9, 0), 132, 1.98),
)
H200 = GPUS[-1]


@dataclass(frozen=True)
class TickFit:
    """A weight format's fitted parts (milliseconds) and what it reads (bytes)."""
    fixed_ms: float
    per_session_ms: float
    weight_bytes: float


def fit_ticks(bench: dict, kv_window_bytes: float) -> dict[str, TickFit]:
    """Per weight format ("bf16", "fp8"), the fixed cost and per-session cost beyond the KV
    read, from the fp8-KV configs of a benchmark run on the H200."""
    fits = {}
    for config, result in bench["configs"].items():
        words = config.split("+")
        if "fp8" not in words or "compile" not in words:
            continue
        weights = "fp8" if "fp8w" in words else "bf16"
        slope, intercept = _line([(r["batch"], r["tick_ms_p50"]) for r in result["ours"] if r["batch"] >= 8])
        weight_bytes = result["lm_weights_gb"] * GB
        fits[weights] = TickFit(
            fixed_ms=intercept - weight_bytes / (ETA_W * H200.bandwidth_tbs * 1e12) * 1e3,
            per_session_ms=slope - kv_window_bytes / (ETA_KV * H200.bandwidth_tbs * 1e12) * 1e3,
            weight_bytes=weight_bytes)
    return fits


def _line(rows: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares through (batch, tick ms): slope, intercept."""
    n = len(rows)
    mean_b, mean_t = sum(b for b, _ in rows) / n, sum(t for _, t in rows) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in rows) / sum((b - mean_b) ** 2 for b, _ in rows)
    return slope, mean_t - slope * mean_b


def fit_int8_ceiling(bench: dict, fit: TickFit, kv_window_bytes: float) -> float:
    """The int8 window's read rate (TB/s) on the H200: its rows' per-session slope, less the
    per-session cost beyond the KV read that the fp8-KV fit found."""
    rows = [(r["batch"], r["tick_ms_p50"]) for r in bench["configs"]["int8+compile"]["ours"] if r["batch"] >= 8]
    slope, _ = _line(rows)
    return kv_window_bytes / ((slope - fit.per_session_ms) * 1e-3) / 1e12


def kv_ceiling_tbs(gpu: Gpu, kv_cache: str, int8_ceiling_h200_tbs: float | None) -> float:
    """The most TB/s a window of this format is read at on ``gpu`` beside its bandwidth: the
    int8 conversion's H200 ceiling scaled by SMs x clock; no ceiling for the others."""
    if kv_cache != "int8" or int8_ceiling_h200_tbs is None:
        return float("inf")
    return int8_ceiling_h200_tbs * (gpu.sms * gpu.boost_ghz) / (H200.sms * H200.boost_ghz)


def tick_ms(gpu: Gpu, fit: TickFit, kv_window_bytes: float, batch: int, kv_ceiling: float = float("inf")) -> float:
    bandwidth = gpu.bandwidth_tbs * 1e12
    kv_rate = min(ETA_KV * bandwidth, kv_ceiling * 1e12)
    return (fit.fixed_ms + fit.weight_bytes / (ETA_W * bandwidth) * 1e3
            + batch * (kv_window_bytes / kv_rate * 1e3 + fit.per_session_ms))


def memory_wall(gpu: Gpu, weight_bytes: float, session_bytes: int) -> int:
    """Sessions the engine's memory plan fits (``MemoryPlan.largest_fit`` with the H200's measured
    items and the default settings)."""
    from engines.runtime.memory_plan import MemoryPlan, PlanItem
    from engines.spec import MemorySettings

    settings = MemorySettings()
    items = (PlanItem("not_ours", int(NOT_OURS_GIB * GIB), "measured"),
             PlanItem("weights", int(weight_bytes), "computed"),
             PlanItem("graphs", int(GRAPHS_GIB * GIB), "measured"),
             PlanItem("joins", int(JOINS_GIB * GIB), "measured"),
             PlanItem("prefill_cache", settings.prefill_cache_bytes, "setting"),
             PlanItem("margin", settings.margin_bytes, "setting"))
    plan = MemoryPlan(gpu.name, int(gpu.memory_gib * GIB), 0, session_bytes, items)
    return plan.largest_fit()


def _fp8_lm(lm):
    """``lm`` (meta) as loaded with fp8 weights: the quantized ones in e4m3, the rest bf16."""
    import torch

    from engines.model.fp8_weights import fp8_dtype_of

    for name, tensor in list(lm.state_dict().items()):
        module_name, _, attr = name.rpartition(".")
        module = lm.get_submodule(module_name) if module_name else lm
        dtype = fp8_dtype_of(name) or torch.bfloat16
        getattr(module, attr).data = torch.empty_like(tensor, dtype=dtype)
    return lm


def predict(bench: dict, max_tick_ms: float, int8_bench: dict | None = None) -> list[dict]:
    import torch

    from engines.model.lm import MoshiLM
    from engines.config import LMConfig, MimiConfig, WindowMode, kv_window_bytes
    from engines.runtime import memory_probe

    lm_cfg, mimi_cfg = LMConfig(), MimiConfig()
    window = WindowMode.REFERENCE
    # The KV bytes a tick reads per session: the whole window (a session minutes in).
    kv_read = {kv: kv_window_bytes(lm_cfg.num_layers, lm_cfg.num_heads, lm_cfg.context, lm_cfg.head_dim, 2, kv)
               for kv in ("auto", "fp8", "int8")}
    fits = fit_ticks(bench, kv_read["fp8"])
    int8_ceiling = fit_int8_ceiling(int8_bench, fits["bf16"], kv_read["int8"]) if int8_bench else None
    mimi = memory_probe.mimi_weight_bytes(mimi_cfg, window)
    with torch.device("meta"):  # sizes only
        weights_in_memory = {
            "bf16": memory_probe.module_bytes(MoshiLM(lm_cfg, 8).to(torch.bfloat16)) + mimi,
            "fp8": memory_probe.module_bytes(_fp8_lm(MoshiLM(lm_cfg, 8, "w8a16"))) + mimi,
        }
    rows = []
    for gpu in GPUS:
        for weights in ("bf16", "fp8"):
            for kv in ("auto", "int8", "fp8"):
                if kv == "fp8" and not gpu.fp8:
                    continue  # refused at start on this GPU
                # Without fp8 tensor cores, fp8 weights take the bf16 time (module docstring).
                fit = fits[weights if gpu.fp8 else "bf16"]
                ceiling = kv_ceiling_tbs(gpu, kv, int8_ceiling)
                session = memory_probe.per_slot_bytes(lm_cfg, mimi_cfg, window, torch.bfloat16, kv)
                wall = memory_wall(gpu, weights_in_memory[weights], session)
                realtime = 0
                while tick_ms(gpu, fit, kv_read[kv], realtime + 1, ceiling) <= max_tick_ms:
                    realtime += 1
                sessions = min(wall, realtime)
                rows.append({"gpu": gpu.name, "weights": weights, "kv_cache": "bf16" if kv == "auto" else kv,
                             "memory_wall": wall, "realtime_bound": realtime, "sessions": sessions,
                             "bound": "memory" if wall <= realtime else "time",
                             "tick_ms_b1": round(tick_ms(gpu, fit, kv_read[kv], 1, ceiling), 2),
                             "tick_ms_at_sessions": round(tick_ms(gpu, fit, kv_read[kv], max(sessions, 1), ceiling), 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", default=DEFAULT_FIT, help="an engines.tools.bench JSON from the H200 (fp8 KV rows)")
    parser.add_argument("--int8-fit", default=DEFAULT_INT8_FIT,
                        help="an engines.tools.bench JSON from the H200 with --gpu-arch sm80 (int8+compile rows): "
                             "the int8 attention's ceiling; '' for none")
    parser.add_argument("--max-tick-ms", type=float, default=60.0, help="the longest tick that keeps real time")
    parser.add_argument("--output", default="capacity.json", help="the JSON report")
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.fit).read_text())
    int8_bench = json.loads(Path(args.int8_fit).read_text()) if args.int8_fit else None
    rows = predict(bench, args.max_tick_ms, int8_bench)
    print(f"{'GPU':10s} {'weights':7s} {'KV':5s} {'memory wall':>11s} {'real time':>9s} {'sessions':>8s} "
          f"{'bound':6s} {'B=1 ms':>7s} {'tick ms':>8s}")
    for r in rows:
        print(f"{r['gpu']:10s} {r['weights']:7s} {r['kv_cache']:5s} {r['memory_wall']:11d} {r['realtime_bound']:9d} "
              f"{r['sessions']:8d} {r['bound']:6s} {r['tick_ms_b1']:7.2f} {r['tick_ms_at_sessions']:8.2f}")
    from engines.tools.bench import git_revision

    report = {"command": " ".join([sys.executable, "-m", "engines.tools.capacity_model",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": git_revision(), "fit": args.fit, "fit_git_revision": bench.get("git_revision"),
              "int8_fit": args.int8_fit or None,
              "max_tick_ms": args.max_tick_ms, "eta_kv": ETA_KV, "eta_w": ETA_W,
              "gpus": [asdict(g) for g in GPUS], "predictions": rows}
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
