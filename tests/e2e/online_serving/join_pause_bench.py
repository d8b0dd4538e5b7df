"""How late live sessions' frames come back while sessions join with long personas: the
lockstep scheduler and the engine, without the web server (that is the end-to-end run's job;
this one explains).

The engine is loaded once (``random:personaplex-7b`` on the GPU by default, fp8 KV).  LANES
live lanes are opened with full windows (the default session's prefill moved past the
window, as ``engines.tools.bench`` does) and each is fed one frame every 80 ms on its own phase of
the period, as paced clients send.  For every output frame the lag is the time from its
input frame's push to its result being handed back.  Phase 1 (``--quiet-s``) has no joins;
in phase 2 (``--join-s``) a session joins every ``--join-every-s`` with a persona of
``--persona-chars`` characters never seen before (a cold prefill) and leaves once open.

Prints a table and writes JSON (``--output``).  ``--tree DIR`` imports ``engines`` and
``orchestrator`` from DIR instead of this checkout, so that an older revision is measured by
the same script (``git archive REV engines orchestrator | tar -x -C DIR``).  With the new
tree, the per-piece cost of a cold prefill is also timed on the idle engine afterwards.

    python tests/e2e/online_serving/join_pause_bench.py --lanes 128 --output x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import importlib
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

PERIOD_S = 0.08


def persona_text(index: int, chars: int) -> str:
    """A persona of ``chars`` characters that no other index shares (a cold prefill)."""
    words = " ".join(f"topic{index}-{i}" for i in range(chars))
    return f"You are tutor {index}. {words}"[:chars]


def percentile(values, q) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if len(values) else None


def summarize(lags_ms: dict[str, list[float]], gaps_ms: dict[str, list[float]], tick_gaps_ms: list[float]) -> dict:
    every = [v for lane in lags_ms.values() for v in lane]
    per_lane_p99 = [percentile(v, 99) for v in lags_ms.values() if v]
    return {
        "frames": len(every),
        "lag_ms_p50": percentile(every, 50),
        "lag_ms_p99": percentile(every, 99),
        "lag_ms_max": max(every) if every else None,
        "worst_lane_lag_ms_p99": max(per_lane_p99) if per_lane_p99 else None,
        "longest_output_gap_ms": max((max(v) for v in gaps_ms.values() if v), default=None),
        "longest_tick_interval_ms": max(tick_gaps_ms) if tick_gaps_ms else None,
        "tick_interval_ms_p99": percentile(tick_gaps_ms, 99),
    }


def _engines_module(name: str, before_levels: str):
    """Module ``name``, or ``before_levels`` in trees from before engines/ was split into
    levels (``--tree`` of an older revision)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return importlib.import_module(before_levels)


def time_pieces(engine, spec, torch) -> dict:
    """Wall time of each piece of a cold prefill of ``spec`` on the idle engine (synchronised),
    in pieces of the engine's size and of others (the first runs of a new size may compile),
    and in one piece."""
    prefill = _engines_module("engines.model.prefill", "engines.prefill")
    plan_prompt, prefill_pieces = prefill.plan_prompt, prefill.prefill_pieces

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(pieces) -> list[float]:
        times = []
        while True:
            sync()
            start = time.perf_counter()
            try:
                next(pieces)
            except StopIteration:
                sync()
                times.append((time.perf_counter() - start) * 1e3)
                return times
            sync()
            times.append((time.perf_counter() - start) * 1e3)

    persona = engine.tokenizer.persona_tokens(spec.effective_persona)
    voice = engine.voice_store.load(spec.voice)
    plan = plan_prompt(engine.cfg, voice, persona)
    options = engine.options
    out = {}
    chunks = [("pieces", options.prefill_chunk)] + [(f"pieces_of_{c}", c) for c in (128, 512)
                                                    if c != options.prefill_chunk] + [("one_pass", None)]
    for label, chunk in chunks:
        runs = [timed(prefill_pieces(engine.lm, voice, plan, options.window, engine.kv.capacity, chunk,
                                     engine.prefill_graphs)) for _ in range(3)]
        last = runs[-1]  # the first runs pay allocator warm-up
        out[label] = {"pieces": len(last), "piece_ms_max": max(last), "piece_ms_p50": percentile(last, 50),
                      "first_run_total_ms": sum(runs[0]),
                      "first_piece_ms": last[0], "total_ms": sum(last)}
    out["persona_tokens"] = len(persona)
    out["positions"] = (voice.embeddings.shape[0] if voice is not None else 0) + plan.length
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=None, help="import engines/ and orchestrator/ from this directory")
    parser.add_argument("--label", default="", help="a name for this run in the table and JSON")
    parser.add_argument("--checkpoint", default="random:personaplex-7b",
                        help="as PERSONAPLEX_CHECKPOINT; 'embedded' for the tiny demo model (a CPU dry run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache", default="fp8")
    parser.add_argument("--lanes", type=int, default=128)
    parser.add_argument("--quiet-s", type=float, default=15.0)
    parser.add_argument("--join-s", type=float, default=30.0)
    parser.add_argument("--join-every-s", type=float, default=1.0)
    parser.add_argument("--persona-chars", type=int, default=6000)
    parser.add_argument("--revision", default="unknown", help="the git revision measured (for the JSON)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    full_window_prefill = _engines_module("engines.tools.bench", "engines.bench").full_window_prefill
    create_engine = _engines_module("engines.runtime.factory", "engines.factory").create_engine
    from engines.interface import SessionSpec
    from orchestrator.engine_port import FrameResult
    from orchestrator.lockstep.scheduler import TickScheduler
    from orchestrator.metrics import Metrics
    from orchestrator.settings import Settings

    import engines

    holder = {}

    def factory():
        checkpoint = None if args.checkpoint == "embedded" else args.checkpoint
        holder["engine"] = create_engine(checkpoint, max_slots=args.lanes + 2, device=args.device,
                                         kv_cache=args.kv_cache)
        return holder["engine"]

    handed: list[tuple[float, object]] = []

    def hand_back(results) -> None:
        now = time.monotonic()
        handed.extend((now, r) for r in results)

    metrics = Metrics()
    jobs: list[tuple[float, str, float]] = []  # (when, kind, seconds) of each engine job piece
    if hasattr(metrics, "observe_engine_job"):  # trees before the split prefill have no such record
        record = metrics.observe_engine_job

        def observe_engine_job(kind: str, seconds: float, *own_seconds: float) -> None:
            jobs.append((time.monotonic(), kind, seconds))
            record(kind, seconds, *own_seconds)  # trees before issue 32 record no own time
        metrics.observe_engine_job = observe_engine_job
    t_load = time.monotonic()
    scheduler = TickScheduler(factory, policy=Settings().tick_policy_object(), silence_grace_s=0.0,
                              warmup_frames=8, metrics=metrics)
    scheduler.start(hand_back)
    if not scheduler.ready.wait(900) or scheduler.load_error is not None:
        print(f"engine failed to load: {scheduler.load_error}", file=sys.stderr)
        return 1
    load_s = time.monotonic() - t_load
    engine = holder["engine"]
    default = SessionSpec()
    key = (default.voice, tuple(engine.tokenizer.persona_tokens(default.effective_persona)))
    with torch.inference_mode():
        engine.prefills.put(key, full_window_prefill(engine, engine.prepare(default)))
    keys = [f"live{i}" for i in range(args.lanes)]
    for k in keys:
        scheduler.open(k, default).result(120)
    print(f"{args.label}: engine loaded in {load_s:.0f} s from {Path(engines.__file__).parent}; "
          f"{args.lanes} lanes open with full windows", flush=True)

    frames_total = int((args.quiet_s + args.join_s) / PERIOD_S)
    pushed: dict[str, list[float]] = {k: [] for k in keys}
    frame = (np.random.default_rng(0).standard_normal((1, 1920)) * 0.05).astype(np.float32)
    t0 = time.monotonic() + 0.5
    join_start = t0 + args.quiet_s

    def feed() -> None:
        order = [(i / args.lanes * PERIOD_S, k) for i, k in enumerate(keys)]
        for n in range(frames_total):
            for phase, k in order:
                due = t0 + n * PERIOD_S + phase
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pushed[k].append(time.monotonic())
                scheduler.push(k, 0, frame)

    joins: list[dict] = []
    memory: dict[str, dict] = {}

    def memory_now() -> dict:
        """What the caching allocator did: a retry means it had to free cached blocks (a device
        synchronisation, hundreds of ms with live sessions waiting) to find memory."""
        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0),
                "device_frees": stats.get("num_device_free", 0), "reserved_gb": torch.cuda.memory_reserved() / 1e9,
                "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                "prefill_cache_gb": getattr(engine.prefills, "nbytes", 0) / 1e9, "prefill_cache_entries": len(engine.prefills)}

    def join() -> None:
        index = 0
        time.sleep(max(0.0, join_start - time.monotonic()))
        memory["before_joins"] = memory_now()
        while time.monotonic() < join_start + args.join_s - 2.0:
            spec = SessionSpec(persona=persona_text(index, args.persona_chars))
            started = time.monotonic()
            slot = scheduler.open(f"join{index}", spec).result(120)
            opened = time.monotonic()
            scheduler.close(f"join{index}").result(30)
            joins.append({"open_s": opened - started, "slot": slot, "start": started - t0})
            index += 1
            time.sleep(max(0.0, args.join_every_s - (time.monotonic() - started)))
        memory["after_joins"] = memory_now()

    feeder = threading.Thread(target=feed, daemon=True)
    joiner = threading.Thread(target=join, daemon=True)
    feeder.start()
    joiner.start()
    feeder.join()
    joiner.join()
    time.sleep(1.0)
    scheduler.stop()

    # Lags and gaps per phase (by when the input frame was pushed).
    phases = {"quiet": (t0, join_start), "joins": (join_start, join_start + args.join_s)}
    got: dict[str, list[float]] = {k: [] for k in keys}
    tick_at: dict[int, float] = {}
    for at, result in handed:
        if isinstance(result, FrameResult) and result.key in got:
            got[result.key].append(at)
            tick_at.setdefault(result.tick, at)
    report_phases = {}
    for name, (lo, hi) in phases.items():
        lags, gaps = {}, {}
        for k in keys:
            pairs = [(p, g) for p, g in zip(pushed[k], got[k]) if lo <= p < hi]
            lags[k] = [(g - p) * 1e3 for p, g in pairs]
            outs = [g for _, g in pairs]
            gaps[k] = [(b - a) * 1e3 for a, b in zip(outs, outs[1:])]
        ticks = sorted(at for at in tick_at.values() if lo <= at < hi)
        report_phases[name] = summarize(lags, gaps, [(b - a) * 1e3 for a, b in zip(ticks, ticks[1:])])
    missing = sum(len(pushed[k]) - len(got[k]) for k in keys)
    spec = SessionSpec(persona=persona_text(10_000, args.persona_chars))
    pieces = time_pieces(engine, spec, torch) if hasattr(engine, "prepare_in_pieces") else None
    report = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "revision": args.revision,
        "label": args.label,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "tree": str(Path(engines.__file__).parent.parent),
        "lanes": args.lanes,
        "persona_chars": args.persona_chars,
        "persona_tokens": len(engine.tokenizer.persona_tokens(spec.effective_persona)),
        "load_s": load_s,
        "frames_missing": missing,
        "joins": joins,
        "join_open_s_p50": percentile([j["open_s"] for j in joins], 50),
        "join_open_s_max": max((j["open_s"] for j in joins), default=None),
        "phases": report_phases,
        "memory": memory,
        "engine_jobs_ms_max": {kind: max((s * 1e3 for at, k, s in jobs if k == kind and at >= join_start), default=None)
                               for kind in ("open", "restart", "close")},
        "engine_jobs_over_20ms": [(round(at - t0, 2), kind, round(s * 1e3, 1)) for at, kind, s in jobs
                                  if at >= t0 and s > 0.02],
        "prefill_pieces": pieces,
    }
    print(f"\n== {args.label} ({report['gpu']}, {args.lanes} lanes, {len(joins)} joins of "
          f"{args.persona_chars}-character personas, {report['persona_tokens']} tokens; frames missing {missing})")
    print(f"{'phase':8} {'frames':>7} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} {'worst lane p99':>15} "
          f"{'longest gap':>12} {'longest tick interval':>22}")
    for name, p in report_phases.items():
        print(f"{name:8} {p['frames']:7d} {p['lag_ms_p50'] or 0:8.1f} {p['lag_ms_p99'] or 0:8.1f} "
              f"{p['lag_ms_max'] or 0:8.1f} {p['worst_lane_lag_ms_p99'] or 0:15.1f} "
              f"{p['longest_output_gap_ms'] or 0:12.1f} {p['longest_tick_interval_ms'] or 0:22.1f}")
    if joins:
        print(f"join open time p50 {report['join_open_s_p50']:.2f} s, max {report['join_open_s_max']:.2f} s")
    print(f"GPU memory before / after the joins: {memory}")
    print(f"engine job pieces during the joins, longest per kind (ms): {report['engine_jobs_ms_max']}; "
          f"over 20 ms: {report['engine_jobs_over_20ms'][:20]}")
    if pieces:
        print(f"cold prefill of {pieces['positions']} positions on the idle engine: " + "; ".join(
            f"{label}: {v['pieces']} piece(s), longest {v['piece_ms_max']:.1f} ms, total {v['total_ms']:.1f} ms"
            for label, v in pieces.items() if isinstance(v, dict)))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
