"""GPU tick benchmark at PersonaPlex-7B shapes with random weights, with a baseline.

    python -m engines.tools.bench --batch-sizes 1,8,32,64 --ticks 100 --output bench.json [--baseline]

For each batch size B it opens B sessions whose temporal windows are already full (3000
positions), then times >= ``--ticks`` lockstep ticks (Mimi encode -> temporal -> depformer
-> Mimi decode, plus the hand-back to the host) and reports p50/p99 of the whole tick
and of each stage (CUDA events), GPU memory, and the cold prefill time of a typical
voice + persona.  ``--baseline`` runs, in the same process, the upstream PyPI ``moshi``
package's ``LMGen`` (its own CUDA graphs, 16-step depformer, greedy) at the same shapes
plus its streaming Mimi: what users of the upstream package run today.  Weight values do
not change the cost, so random bf16 weights stand in for the gated real ones.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch._dynamo

from engines.config import FRAME_SAMPLES, GPU_ARCH_MODES, SCALED_KV_CACHES, LMConfig
from engines.fastpath import gpu_arch
from engines.spec import MemorySettings
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.interface import SamplingParams, SessionSpec, to_completion
from engines.model.prefill import Prefill, VoicePrompt, build_prefill
from engines.checkpoints.random_model import build_random_engine, fill_random_
from engines.checkpoints.voices import random_voice_data

log = logging.getLogger("engines.tools.bench")


def typical_voice(cfg: LMConfig, frames: int = 60, seed: int = 2) -> VoicePrompt:
    """A voice prompt of the real format: ``frames`` frames of random embeddings."""
    data = random_voice_data(cfg.dim, cfg.initial_tokens(), frames, seed)
    return VoicePrompt("bench.pt", data["embeddings"], data["cache"])


def full_window_prefill(engine: PersonaPlexEngine, base: Prefill) -> Prefill:
    """``base``'s token state, moved to a position past the window, with random keys/values
    for every position the window holds: the cost of a session after 4 minutes."""
    cfg = engine.cfg
    C = engine.kv.capacity
    shift = 4 * math.ceil(max(0, C + 1 - base.offset) / 4)  # keeps the 4-slot token ring aligned
    offset = base.offset + shift
    positions = offset - 1
    shape = (cfg.num_layers, cfg.num_heads, min(positions, C), cfg.head_dim)
    keys = torch.randn(shape, device=engine.device, dtype=engine.lm.dtype) * 0.1
    return Prefill(keys, torch.randn_like(keys), positions - shape[2], base.token_cache, base.token_provided, offset)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q, method="linear"))


# The sessions the ticks are timed with: greedy, as the baseline's LMGen decodes; or sampling
# with the server's defaults (top-k from the softmax with hash noise: ``--sampled-batch-sizes``).
GREEDY_SESSION = SessionSpec(sampling=SamplingParams(greedy=True), seed=0)
SAMPLED_SESSION = SessionSpec(seed=0)


def bench_ours(engine: PersonaPlexEngine, batch_sizes: list[int], ticks: int, warmup: int,
               prefill: Prefill, speech: np.ndarray, spec: SessionSpec = GREEDY_SESSION) -> list[dict]:
    results = []
    for B in batch_sizes:
        for slot in engine.open_slots():
            engine.close_slot(slot)
        try:
            results.append(_bench_one(engine, B, spec, ticks, warmup, prefill, speech))
        except torch.cuda.OutOfMemoryError as exc:
            # torch's message says how much was asked for, free, held by tensors and reserved.
            error = f"out of memory: {str(exc).splitlines()[0]}"
            log.warning("ours B=%d: %s", B, error)
            results.append({"batch": B, "error": error})
    for slot in engine.open_slots():
        engine.close_slot(slot)
    return results


def _bench_one(engine: PersonaPlexEngine, B: int, spec: SessionSpec, ticks: int, warmup: int,
               prefill: Prefill, speech: np.ndarray) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    slots = [engine.open_slot(spec, prefill=prefill) for _ in range(B)]
    totals, stages, host = [], {}, {}
    for t in range(warmup + ticks):
        start = (t * FRAME_SAMPLES) % (speech.shape[0] - FRAME_SAMPLES)
        pcm = np.repeat(speech[None, start : start + FRAME_SAMPLES], B, axis=0)
        engine.clock.enabled = t >= warmup
        t0 = time.perf_counter()
        engine.step(slots, pcm)  # returns host numpy: includes the hand-back sync
        elapsed = (time.perf_counter() - t0) * 1e3
        if t >= warmup:
            totals.append(elapsed)
            for name, ms in engine.clock.durations_ms().items():
                stages.setdefault(name, []).append(ms)
            for name, ms in engine.clock.host_durations_ms().items():
                host.setdefault(name, []).append(ms)
    engine.clock.enabled = False
    row = {
        "batch": B,
        "tick_ms_p50": _percentile(totals, 50),
        "tick_ms_p99": _percentile(totals, 99),
        "stages_ms_p50": {k: _percentile(v, 50) for k, v in stages.items()},
        "stages_ms_p99": {k: _percentile(v, 99) for k, v in stages.items()},
        # Host wall time per phase of engine.step (inputs, launch, wait for the GPU, copy out,
        # building the outputs): where the time outside the GPU's goes.
        "host_ms_p50": {k: _percentile(v, 50) for k, v in host.items()},
        "host_ms_p99": {k: _percentile(v, 99) for k, v in host.items()},
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        # What the allocator held at its peak, and what was left of the device: the headroom
        # that says how far the memory wall is from this B.
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        "device_free_gb": torch.cuda.mem_get_info()[0] / 1e9,
        "ticks": len(totals),
    }
    log.info("ours B=%d: tick p50 %.2f ms p99 %.2f ms %s", B, row["tick_ms_p50"], row["tick_ms_p99"],
             {k: round(v, 2) for k, v in row["stages_ms_p50"].items()})
    return row


def bench_prefill(engine: PersonaPlexEngine, voice: VoicePrompt, persona_tokens: list[int]) -> dict:
    """Cold prefill of one (voice, persona): the host-side token plan, then the GPU pass.

    ``gpu_ms`` (CUDA events around the embedding, the transformer pass and the export of its
    keys/values, after the plan; replayed from a prefill graph when the engine has them and
    the prompt is one piece) is the device time a joining session costs; ``total_ms`` is host
    wall time of the whole ``build_prefill``.
    """
    from engines.model.prefill import plan_prompt, prefill_pieces

    cfg = engine.cfg
    for _ in range(3):  # the first calls pay allocator, kernel and compile warm-up
        t0 = time.perf_counter()
        plan = plan_prompt(cfg, voice, persona_tokens)
        plan_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        p = to_completion(prefill_pieces(engine.lm, voice, plan, engine.options.window, engine.kv.capacity,
                                         engine.options.prefill_chunk, engine.prefill_graphs))
        end.record()
        end.synchronize()
        total_ms = (time.perf_counter() - t0) * 1e3 + plan_ms
    return {"voice_frames": voice.frames, "persona_tokens": len(persona_tokens), "positions": p.positions,
            "plan_cpu_ms": plan_ms, "gpu_ms": start.elapsed_time(end), "total_ms": total_ms}


def kv_attention_error(kv_cache: str = "fp8", batch: int = 8, heads: int = 32, capacity: int = 3000,
                       head_dim: int = 128, seed: int = 0, device: str = "cuda") -> dict:
    """Decode attention over a full 7B-shaped window: an 8-bit cache (``kv_cache`` "fp8" or
    "int8") against bf16, on random activations with per-head magnitudes spread over two
    decades (as real K/V have).  The same data for both kinds at one seed.  (On a CPU the
    kernel runs only under Triton's interpreter, at small shapes: ``tests/test_kv_int8.py``.)"""
    from engines.fastpath.attention import decode_attention
    from engines.state.kv_ring import SCALED_STORAGE

    quantize = SCALED_STORAGE[kv_cache][1]
    g = torch.Generator(device=device).manual_seed(seed)
    spread = torch.logspace(-1, 1, heads, device=device).view(1, heads, 1, 1)
    keys = (torch.randn(batch, heads, capacity, head_dim, device=device, generator=g) * spread).bfloat16()
    values = (torch.randn(batch, heads, capacity, head_dim, device=device, generator=g) * spread).bfloat16()
    q = torch.randn(batch, heads, head_dim, device=device, generator=g).bfloat16()
    slots = torch.arange(batch, device=device)
    q_pos = torch.full((batch,), 10 * capacity, device=device, dtype=torch.long)
    lo = q_pos - capacity + 2
    exact = decode_attention(q, keys, values, slots, q_pos, lo).float()
    kq, ks = quantize(keys)
    vq, vs = quantize(values)
    approx = decode_attention(q, kq, vq, slots, q_pos, lo, scales=(ks, vs)).float()
    err = (approx - exact).norm(dim=-1) / exact.norm(dim=-1)
    return {"shape": [batch, heads, capacity, head_dim], "relative_error_mean": float(err.mean()),
            "relative_error_max": float(err.max())}


def fp8_linear_shapes(cfg: LMConfig) -> dict[str, tuple[int, int]]:
    """[N, K] of each linear layer whose weight may be fp8 (``model.fp8_weights``), at
    ``cfg``'s shapes: the temporal layers', ``depformer_in`` and the depformer layers'."""
    d, h, dd, dh = cfg.dim, cfg.ffn_hidden, cfg.depformer_dim, cfg.depformer_ffn_hidden
    return {"in_proj": (3 * d, d), "out_proj": (d, d), "ffn_in": (2 * h, d), "ffn_out": (d, h),
            "depformer_in": (dd, d), "depformer.in_proj": (3 * dd, dd), "depformer.out_proj": (dd, dd),
            "depformer.ffn_in": (2 * dh, dd), "depformer.ffn_out": (dd, dh)}


def fp8_weight_error(device: str = "cuda", rows: int = 64, seed: int = 0) -> dict:
    """Each 7B linear layer's output with fp8 weights against bf16 weights, on random
    activations, for both products (``layers.linear``): W8A16, and W8A8 with a scale per
    token.  Weights: N(0, 0.02) with output channels spread over a decade; activations:
    N(0, 1), and again with 8 input features 30x larger (LLM activations have such outlier
    features, which per-token scales pass on to every other feature of the token)."""
    from engines.model.fp8_weights import quantize_weight
    from engines.model.layers import linear

    g = torch.Generator(device=device).manual_seed(seed)
    out: dict = {"rows": rows, "layers": {}}
    for name, (n, k) in fp8_linear_shapes(LMConfig()).items():
        spread = torch.logspace(-0.5, 0.5, n, device=device).view(-1, 1)
        w = (torch.randn(n, k, device=device, generator=g) * 0.02 * spread).bfloat16()
        q = quantize_weight(w)
        result = {}
        for case in ("plain", "outliers"):
            x = torch.randn(rows, k, device=device, generator=g)
            if case == "outliers":
                x[:, torch.randperm(k, device=device, generator=g)[:8]] *= 30
            x = x.bfloat16()
            exact = (x.float() @ w.float().t())
            for matmul in ("w8a16", "scaled_mm"):
                got = linear(x, q.data, q.scale, matmul).float()
                result[f"{case}.{matmul}"] = round(float((got - exact).norm() / exact.norm()), 5)
            result[f"{case}.bf16"] = round(float((linear(x, w).float() - exact).norm() / exact.norm()), 5)
        out["layers"][name] = result
    return out


def bench_baseline(batch_sizes: list[int], ticks: int, warmup: int, speech: np.ndarray) -> list[dict]:
    """Upstream moshi 0.2.13 at PersonaPlex shapes: LMGen (CUDA graphs, 16 depformer steps,
    greedy) + streaming Mimi encode/decode, random bf16 weights."""
    import os

    os.environ.setdefault("NO_TORCH_COMPILE", "1")
    from moshi.models import loaders
    from moshi.models.lm import LMModel

    kwargs = dict(loaders._lm_kwargs, dep_q=16)
    with torch.device("meta"):
        lm = LMModel(dtype=torch.bfloat16, **kwargs)
    lm = lm.to_empty(device="cuda")
    fill_random_(lm, 3)
    lm.eval()
    mimi = loaders.get_mimi(None, device="cuda")
    results = []
    for B in batch_sizes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            results.append(_baseline_one(lm, mimi, B, ticks, warmup, speech))
        except torch.cuda.OutOfMemoryError:
            log.warning("baseline B=%d: out of GPU memory", B)
            results.append({"batch": B, "error": "out of memory"})
        torch.cuda.empty_cache()
    return results


def _baseline_one(lm, mimi, B: int, ticks: int, warmup: int, speech: np.ndarray) -> dict:
    from moshi.models import LMGen

    gen = LMGen(lm, use_sampling=False)
    totals = []
    with torch.no_grad(), gen.streaming(B), mimi.streaming(B):
        for t in range(warmup + ticks):
            start = (t * FRAME_SAMPLES) % (speech.shape[0] - FRAME_SAMPLES)
            pcm = torch.from_numpy(np.repeat(speech[None, None, start : start + FRAME_SAMPLES], B, axis=0)).cuda()
            t0 = time.perf_counter()
            codes = mimi.encode(pcm)
            out = gen.step(codes[:, :0])  # PersonaPlex shapes: 16 depformer steps, no user rows
            if out is not None:
                mimi.decode(out[:, 1:9].clamp(0, 2047)).cpu()
            else:
                torch.cuda.synchronize()
            if t >= warmup:
                totals.append((time.perf_counter() - t0) * 1e3)
    row = {"batch": B, "tick_ms_p50": _percentile(totals, 50), "tick_ms_p99": _percentile(totals, 99),
           "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
           "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
           "device_free_gb": torch.cuda.mem_get_info()[0] / 1e9, "ticks": len(totals)}
    log.info("baseline B=%d: tick p50 %.2f ms p99 %.2f ms", B, row["tick_ms_p50"], row["tick_ms_p99"])
    return row


def git_revision() -> str:
    import os

    if os.environ.get("BENCH_GIT_REVISION"):  # runs on a copy of the tree without .git
        return os.environ["BENCH_GIT_REVISION"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# The words of a ``--configs`` item, joined by "+" in any order: the KV cache ("bf16", the
# default, "fp8" or "int8"), the weights ("fp8w": fp8 with the device's product; "fp8w-w8a16": fp8,
# dequantized before a bf16 GEMM) and "compile".
CONFIG_WORDS = {"bf16": ("kv_cache", "auto"), "fp8": ("kv_cache", "fp8"), "int8": ("kv_cache", "int8"),
                "fp8w": ("weights", "auto"),
                "fp8w-w8a16": ("weights", "w8a16"), "compile": ("compile", True),
                "serial": ("overlap_encode", False)}


@dataclass(frozen=True)
class BenchConfig:
    """One engine variant: KV cache storage, weight storage and whether the blocks are compiled."""

    name: str
    kv_cache: str  # EngineOptions.kv_cache
    compile: bool
    weights: str = "auto"  # EngineOptions.weights
    fp8_matmul: str = "auto"  # EngineOptions.fp8_matmul, for fp8 weights
    overlap_encode: bool = True  # EngineOptions.overlap_encode ("serial": False)

    @classmethod
    def parse(cls, text: str) -> "BenchConfig":
        chosen: dict = {}
        for word in text.split("+"):
            if word not in CONFIG_WORDS or CONFIG_WORDS[word][0] in chosen:
                raise ValueError(f"bad config {text!r}: expected words of {', '.join(CONFIG_WORDS)} joined by '+', "
                                 "at most one for the KV cache and one for the weights")
            field, value = CONFIG_WORDS[word]
            chosen[field] = value
        matmul = chosen.get("weights")
        return cls(text, chosen.get("kv_cache", "auto"), chosen.get("compile", False),
                   weights="auto" if matmul is None else "fp8", fp8_matmul=matmul or "auto",
                   overlap_encode=chosen.get("overlap_encode", True))


# GPU memory kept free beside the sessions' windows: the 7B weights (~16 GB in bf16 with 8
# depformer steps, ~8.5 GB in fp8) and 14 GB for the rest.  The rest measured 9.9 GB at
# B = 144 (H200, 2026-12-03: peak 142.9 GB less 15.4 GB of LM weights and 145 fp8 windows):
# Mimi's and the token ring's per-slot state, activations, graph pools, the bounded prefill
# cache.  With 8 GB for it, the engine sized to the wall ran out of memory at its first tick
# (2026-12-04).
RESERVE_GB = {"auto": 30.0, "fp8": 22.5}


def slots_that_fit(cfg: LMConfig, config: BenchConfig, wanted: int) -> int:
    """How many slots (+ the scratch slot) of full KV windows fit beside the weights."""
    from engines.state.kv_ring import kv_bytes_per_slot

    per_slot = kv_bytes_per_slot(cfg.num_layers, cfg.num_heads, cfg.context, cfg.head_dim, torch.bfloat16,
                                 config.kv_cache)
    torch.cuda.empty_cache()  # blocks the allocator keeps but no tensor holds are free
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(wanted, int((free - RESERVE_GB[config.weights] * 1e9) // per_slot) - 1))


# ``--batch-sizes wall``: as many sessions as there are slots of full windows (the memory wall).
WALL = -1


def parse_batch_sizes(text: str) -> list[int]:
    items = [b.strip() for b in text.split(",") if b.strip()]
    if not items or not all(b == "wall" or (b.isdigit() and int(b) >= 1) for b in items):
        raise ValueError(f"bad --batch-sizes {text!r}: expected positive integers or 'wall', comma-separated")
    return [WALL if b == "wall" else int(b) for b in items]


def run_config(config: BenchConfig, batch_sizes: list[int], args, tokenizer: Path, speech: np.ndarray) -> dict:
    t0 = time.perf_counter()
    slots = slots_that_fit(LMConfig(), config, 1 << 20 if WALL in batch_sizes else max(batch_sizes))
    batch_sizes = sorted({slots if b == WALL else b for b in batch_sizes})
    engine = build_random_engine(slots, "cuda", tokenizer, steps=args.depformer_steps,
                                 cuda_graphs=not args.no_cuda_graphs, kv_cache=config.kv_cache,
                                 compile=config.compile, weights=config.weights, fp8_matmul=config.fp8_matmul,
                                 overlap_encode=config.overlap_encode,
                                 # Sized here (slots_that_fit), not by the server's memory plan.
                                 options=EngineOptions(memory=MemorySettings(enabled=False), gpu_arch=args.gpu_arch))
    weights_gb = engine.lm.weight_bytes() / 1e9
    log.info("%s: built a 7B-shaped engine with %d slots in %.1f s (LM weights %s)", config.name,
             slots, time.perf_counter() - t0, engine.lm.describe_weights())
    voice = typical_voice(engine.cfg)
    persona = list(range(100, 200))  # a 100-token persona
    out = {"slots": slots, "lm_weights_gb": round(weights_gb, 2), "fp8_matmul": engine.lm.fp8_matmul,
           "prefill": bench_prefill(engine, voice, persona)}
    log.info("%s: prefill %s", config.name, out["prefill"])
    base = build_prefill(engine.lm, voice, persona, engine.options.window, engine.kv.capacity)
    fitting = [b for b in batch_sizes if b <= slots]
    prefill = full_window_prefill(engine, base)
    out["ours"] = bench_ours(engine, fitting, args.ticks, args.warmup, prefill, speech)
    out["ours"] += [{"batch": b, "error": f"does not fit: {slots} slots of full windows fit"}
                    for b in batch_sizes if b > slots]
    sampled = [b for b in args.sampled_batch_sizes if b <= slots]
    if sampled:
        out["ours_sampled"] = bench_ours(engine, sampled, args.ticks, args.warmup, prefill, speech, SAMPLED_SESSION)
    # The tick graphs refer back to the engine (a cycle): collect it before the next config.
    del engine, base, prefill
    gc.collect()
    torch.cuda.empty_cache()
    # And drop the compiled functions' variants: the next config's engine (other weights)
    # compiles its own anyway, and dynamo's search for why the old variants' guards failed
    # raised inside itself (TypeError: 'NoneType' object is not subscriptable, H200, torch 2.11,
    # 2026-12-04: the bf16-weight engine after the fp8-weight one, at its first tick).
    torch._dynamo.reset()
    return out


def print_table(report: dict) -> None:
    base_rows = {r["batch"]: r for r in report.get("baseline", []) if "error" not in r}
    for name, result in report["configs"].items():
        print(f"== {name}: {result['slots']} slots of full windows fit beside {result['lm_weights_gb']:.1f} GB of "
              f"LM weights; prefill {result['prefill']['gpu_ms']:.1f} ms GPU "
              f"(+ {result['prefill']['plan_cpu_ms']:.1f} ms host plan)")
        print(f"{'B':>4} {'ours p50':>9} {'ours p99':>9} {'base p50':>9} {'base p99':>9} {'ratio':>6} {'mem GB':>7}")
        for r in result["ours"]:
            if "error" in r:
                print(f"{r['batch']:>4} {r['error']}")
                continue
            b = base_rows.get(r["batch"])
            ratio = f"{b['tick_ms_p50'] / r['tick_ms_p50']:.2f}" if b else "-"
            print(f"{r['batch']:>4} {r['tick_ms_p50']:>9.2f} {r['tick_ms_p99']:>9.2f} "
                  f"{(b['tick_ms_p50'] if b else float('nan')):>9.2f} {(b['tick_ms_p99'] if b else float('nan')):>9.2f} "
                  f"{ratio:>6} {r['peak_memory_gb']:>7.1f}")
        for r in result.get("ours_sampled", []):
            if "error" not in r:
                print(f"{r['batch']:>4} sampling sessions: p50 {r['tick_ms_p50']:.2f} ms, p99 {r['tick_ms_p99']:.2f} ms")
    for kind in SCALED_KV_CACHES:
        if f"{kind}_error" in report:
            print(f"{kind} KV attention error at 7B shapes: {report[f'{kind}_error']}")
    for layer, errors in report.get("fp8_weight_error", {}).get("layers", {}).items():
        print(f"fp8 weights, {layer}: " + ", ".join(f"{case} {value:.4f}" for case, value in errors.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        help="comma-separated B values (default 1,8,32,64); 'wall' is the most slots of full "
                             "windows that fit in the GPU's memory beside that config's weights")
    parser.add_argument("--configs", default="bf16",
                        help="comma-separated engine variants, each words joined by '+': bf16 (default), fp8 "
                             "or int8 for the KV cache; fp8w for fp8 weights with the GPU's fp8 GEMMs, fp8w-w8a16 "
                             "for fp8 weights dequantized before a bf16 GEMM; compile for torch.compile'd blocks; "
                             "e.g. bf16,fp8+compile,fp8w+fp8+compile.  B values whose full windows do not fit in "
                             "memory are reported as such")
    parser.add_argument("--ticks", type=int, default=100, help="timed ticks per B (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed ticks per B first (default 5)")
    parser.add_argument("--depformer-steps", type=int, choices=(8, 16), default=8)
    parser.add_argument("--baseline", action="store_true", help="also run the upstream moshi package (must be importable)")
    parser.add_argument("--baseline-batch-sizes", default=None, help="B values for the baseline (default: --batch-sizes)")
    parser.add_argument("--sampled-batch-sizes", default="",
                        help="B values timed a second time with sessions that sample (the server's default "
                             "settings) instead of greedy ones, whose ticks skip the sampler (default: none)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run ticks eagerly (gives the per-stage split; graphed ticks report the whole tick)")
    parser.add_argument("--speech", default=None, help="24 kHz speech WAV fed as user audio (default: synthetic)")
    parser.add_argument("--gpu-arch", choices=GPU_ARCH_MODES, default=os.environ.get(gpu_arch.SETTING, "auto"),
                        help="the GPU capability the engine takes, as the server's PERSONAPLEX_GPU_ARCH (its "
                             "default): auto, or sm80 to time on this GPU what an A100 would run")
    parser.add_argument("--output", required=True, help="JSON file to write (rewritten after each section)")
    args = parser.parse_args(argv)
    # Timestamps: a device call's log tells where its minutes went (compilation, captures).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        configs = [BenchConfig.parse(c.strip()) for c in args.configs.split(",") if c.strip()]
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        base_sizes = [int(b) for b in args.baseline_batch_sizes.split(",")] if args.baseline_batch_sizes else \
            [b for b in batch_sizes if b != WALL]
        args.sampled_batch_sizes = [int(b) for b in args.sampled_batch_sizes.split(",") if b.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA device", file=sys.stderr)
        return 2
    gpu_arch.configure(args.gpu_arch)  # before the first kernel is chosen (the KV error below)
    if args.speech:
        from engines.audio_io import read_audio

        speech = read_audio(args.speech)
    else:
        speech = (0.1 * np.sin(np.arange(24000 * 4) * 2 * np.pi * 220 / 24000)).astype(np.float32)
    import tempfile

    from engines.checkpoints.tiny import train_tokenizer

    # Text pieces are only looked up, never timed: the tiny tokenizer does.
    tokenizer = Path(tempfile.mkdtemp()) / "tokenizer.model"
    train_tokenizer(tokenizer)
    report = {
        "command": " ".join([sys.executable, "-m", "engines.tools.bench", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "gpu": torch.cuda.get_device_name(),
        "gpu_arch": gpu_arch.describe(torch.device("cuda")),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "parameters": vars(args),
        "configs": {},
    }
    output = Path(args.output)

    def save() -> None:
        output.write_text(json.dumps(report, indent=2, allow_nan=False))

    for kind in SCALED_KV_CACHES:  # "fp8_error", "int8_error": the same method and data for both
        if any(c.kv_cache == kind for c in configs):
            report[f"{kind}_error"] = kv_attention_error(kind)
            log.info("%s KV attention error at 7B shapes: %s", kind, report[f"{kind}_error"])
    if any(c.weights == "fp8" for c in configs):
        report["fp8_weight_error"] = fp8_weight_error()
        log.info("fp8 weight error per 7B layer: %s", report["fp8_weight_error"])
    for config in configs:
        report["configs"][config.name] = run_config(config, batch_sizes, args, tokenizer, speech)
        save()
    if args.baseline:
        report["baseline"] = bench_baseline(base_sizes, args.ticks, args.warmup, speech)
    save()
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
