"""The GPU path (CUDA graphs, Triton attention) against the CPU reference path, tiny model.

Runs only where CUDA is.  In float32 the graphed GPU tick must give the CPU's tokens under
greedy decoding; bf16 (the production dtype) is compared by logits-level agreement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.checkpoints import loader as ckpt
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.interface import SamplingParams, SessionSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPECS = [
    SessionSpec(voice="NATF2.pt", sampling=SamplingParams(greedy=True)),
    SessionSpec(voice="VARF0.pt", persona="You are a cheerful travel assistant.", sampling=SamplingParams(greedy=True)),
    SessionSpec(voice="NATM1.pt", seed=4),
]


def run(engine, frames):
    slots = [engine.open_slot(s) for s in SPECS]
    texts, pcms = [[] for _ in slots], [[] for _ in slots]
    for f in range(frames.shape[1]):
        for i, out in enumerate(engine.step(slots, frames[:, f])):
            texts[i].append(out.text_id)
            pcms[i].append(out.pcm)
    return texts, [np.concatenate(p) for p in pcms]


@pytest.fixture(scope="module")
def frames(speech_pcm):
    return np.stack([speech_pcm[s * 24000 : s * 24000 + 60 * 1920].reshape(60, 1920) for s in (1, 10, 20)])


@pytest.fixture
def no_tf32():
    # cuDNN convolutions default to TF32, which alone moves Mimi's audio by ~1e-3.
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_float32_graphed_gpu_tick_matches_cpu(tiny_checkpoint, frames, no_tf32):
    files = ckpt.locate(tiny_checkpoint)
    cpu = PersonaPlexEngine.from_files(files, 4, EngineOptions())
    gpu = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda", lm_dtype="float32"))
    assert gpu.graphs is not None
    t_cpu, p_cpu = run(cpu, frames)
    t_gpu, p_gpu = run(gpu, frames)
    assert t_cpu[:2] == t_gpu[:2]  # greedy sessions: same tokens
    for a, b in zip(p_cpu[:2], p_gpu[:2]):
        assert np.allclose(a, b, atol=1e-4), np.abs(a - b).max()
    assert t_cpu[2] == t_gpu[2]  # sampled: same seed, same hash noise -> same draws


# bf16 weights and activations against the float32 CPU model, text logits teacher-forced
# over 3 windows: the bf16 model alone measured 1.0 % relative L2 error on the CPU
# (tests/test_fp8_weights.py); the GPU's kernels (Triton attention, cuBLAS) may add rounding of
# their own.  The same comparison against another checkpoint's weights (seed 1) must miss it.
BF16_GPU_LOGIT_ERROR = 0.03
BF16_GPU_ARGMAX_AGREEMENT = 0.9


def test_bf16_gpu_tick_runs_and_stays_close(tiny_checkpoint, frames, tmp_path):
    from engines.checkpoints.tiny import write_tiny_checkpoint
    from tests.test_kv_fp8 import _tiny_logits

    files = ckpt.locate(tiny_checkpoint)
    gpu = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda"))
    texts, pcms = run(gpu, frames)
    assert all(np.isfinite(p).all() for p in pcms)
    assert texts[0][0] == 3  # the forced PAD frame first
    for slot in gpu.open_slots():
        gpu.close_slot(slot)
    cpu = PersonaPlexEngine.from_files(files, 4, EngineOptions())
    other = PersonaPlexEngine.from_files(ckpt.locate(write_tiny_checkpoint(tmp_path / "other", seed=1)), 4,
                                         EngineOptions(device="cuda"))
    cfg = cpu.cfg
    g = torch.Generator().manual_seed(3)
    n = 3 * cfg.context
    forced = torch.cat([torch.randint(0, cfg.text_card, (n, 1), generator=g),
                        torch.randint(0, cfg.card, (n, cfg.num_streams - 1), generator=g)], dim=1)
    want = _tiny_logits(cpu, forced)
    for name, engine, close in (("this checkpoint", gpu, True), ("another checkpoint", other, False)):
        got = _tiny_logits(engine, forced.cuda()).float().cpu()
        rel = float((got - want).norm() / want.norm())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(f"bf16 GPU ({name}) vs float32 CPU, teacher-forced text logits: relative L2 {rel:.4f}, "
              f"argmax agreement {agree:.3f}")
        assert (rel < BF16_GPU_LOGIT_ERROR and agree >= BF16_GPU_ARGMAX_AGREEMENT) == close, (name, rel, agree)


@pytest.mark.parametrize("options", [dict(compile=True), dict(kv_cache="fp8"), dict(kv_cache="fp8", compile=True),
                                     dict(kv_cache="int8"), dict(kv_cache="int8", compile=True)],
                         ids=["compile", "fp8", "fp8+compile", "int8", "int8+compile"])
def test_float32_fast_path_variants_against_cpu(tiny_checkpoint, frames, no_tf32, options):
    """The compiled blocks and the 8-bit caches on the graphed GPU tick, float32 weights.

    Compilation only re-associates float32 arithmetic: the greedy tokens must stay the CPU
    reference's.  The fp8 and int8 caches are lossy: their text logits are compared
    teacher-forced.  (fp8 needs compute capability 8.9; int8 runs on any GPU.)
    """
    from tests.test_kv_fp8 import _tiny_logits

    if options.get("kv_cache") == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability 8.9")
    files = ckpt.locate(tiny_checkpoint)
    cpu = PersonaPlexEngine.from_files(files, 4, EngineOptions())
    gpu = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda", lm_dtype="float32", **options))
    t_cpu, p_cpu = run(cpu, frames)
    t_gpu, p_gpu = run(gpu, frames)
    agree = np.mean([a == b for a, b in zip(t_gpu[0] + t_gpu[1], t_cpu[0] + t_cpu[1])])
    print(f"{options}: greedy text agreement with the CPU path {agree:.3f}")
    if "kv_cache" not in options:
        assert t_cpu[:2] == t_gpu[:2]
        for a, b in zip(p_cpu[:2], p_gpu[:2]):
            assert np.allclose(a, b, atol=1e-3), np.abs(a - b).max()
        return
    g = torch.Generator().manual_seed(3)
    cfg = cpu.cfg
    n = 3 * cfg.context
    forced = torch.cat([torch.randint(0, cfg.text_card, (n, 1), generator=g),
                        torch.randint(0, cfg.card, (n, cfg.num_streams - 1), generator=g)], dim=1)
    for engine in (cpu, gpu):
        for slot in engine.open_slots():
            engine.close_slot(slot)
    want = _tiny_logits(cpu, forced)
    got = _tiny_logits(gpu, forced.cuda()).cpu()
    rel = float((got - want).norm() / want.norm())
    print(f"{options}: teacher-forced text logits, relative error vs the exact CPU cache {rel:.4f}")
    assert rel < 0.03


def test_prefill_graph_replay_equals_the_eager_pass(tiny_checkpoint, no_tf32):
    """A prompt padded to a bucket and replayed from a CUDA graph gives the keys/values of
    the unpadded eager pass (causal pass from an empty cache: padding never leaks back),
    also for a bucket longer than the session window (the window is a mask, not a wrap).
    A split prompt's pieces replayed from the piece graph give the one pass's keys too; a
    second split pass while the first holds that graph runs eagerly to the same result, or,
    allowed to wait, waits and then replays it."""
    from engines.fastpath.prefill_graphs import PrefillGraphs
    from engines.interface import WAITING, to_completion
    from engines.model.prefill import plan_prompt, prefill_pieces

    files = ckpt.locate(tiny_checkpoint)
    engine = PersonaPlexEngine.from_files(files, 2, EngineOptions(device="cuda", lm_dtype="float32"))
    cfg = engine.cfg
    window = engine.options.window
    graphs = PrefillGraphs(engine.lm, window, cfg.context, chunk=64, buckets=(16, 64, 128))
    assert graphs.buckets == (16, 64)  # only prompts of one piece are replayed whole

    def close(a, b) -> bool:
        return (a.start, a.positions) == (b.start, b.positions) and torch.allclose(a.keys, b.keys, atol=1e-5) \
            and torch.allclose(a.values, b.values, atol=1e-5)

    # 14, 26 and 50 positions: buckets 16 and 64 (twice the 32-position window).
    for persona in ([5, 9, 200], list(range(40, 55)), list(range(40, 79))):
        plan = plan_prompt(cfg, None, persona)
        eager = to_completion(prefill_pieces(engine.lm, None, plan, window, cfg.context))
        replay = to_completion(prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs))
        assert close(replay, eager)
    assert sorted(graphs._graphs) == [16, 64]
    assert graphs.run(torch.zeros(65, cfg.dim, device="cuda")) is None  # longer than every bucket
    # 200 positions: four pieces of 64, the last padded; the piece cache (95) wraps.
    plan = plan_prompt(cfg, None, list(range(40, 228)))
    one_pass = to_completion(prefill_pieces(engine.lm, None, plan, window, cfg.context))
    holder = prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs)
    next(holder)  # holds the piece graph
    assert graphs._pieces_claimed
    eager_pieces = to_completion(prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs))
    assert close(eager_pieces, one_pass)
    assert close(to_completion(holder), one_pass)
    assert not graphs._pieces_claimed
    assert close(to_completion(prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs)), one_pass)
    # A pass that may wait (the server's) waits for the graph instead, then replays it.
    holder = prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs)
    next(holder)
    waiter = prefill_pieces(engine.lm, None, plan, window, cfg.context, 64, graphs, wait=True)
    assert next(waiter) is WAITING and next(waiter) is WAITING
    assert close(to_completion(holder), one_pass) and close(to_completion(waiter), one_pass)
    assert not graphs._pieces_claimed


def test_capture_graphs_captures_every_bucket_up_front(tiny_checkpoint):
    """The server calls this before /ready: a first tick at a new batch size must not pay a
    capture (it took 14 s with compiled blocks on the H200 and tripped the watchdog)."""
    engine = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 6, EngineOptions(device="cuda"))
    engine.capture_graphs()
    assert sorted(engine.graphs._graphs) == [(b, greedy) for b in engine.graphs.buckets for greedy in (False, True)]
    assert tuple(sorted(engine.prefill_graphs._graphs)) == engine.prefill_graphs.buckets


@pytest.mark.parametrize("options", [dict(), dict(compile=True, kv_cache="fp8")], ids=["eager-graphs", "compiled-fp8kv"])
def test_fp8_weights_on_the_gpu(tiny_checkpoint, frames, options):
    """fp8 weights on the GPU: the auto product is the fp8 tensor cores' on Hopper; teacher-
    forced text logits of both products stay as close to the exact CPU model as on the CPU
    (tests/test_fp8_weights.py), and whole graphed ticks run."""
    from tests.test_fp8_weights import BF16_LOGIT_ERROR
    from tests.test_kv_fp8 import _tiny_logits

    files = ckpt.locate(tiny_checkpoint)
    g = torch.Generator().manual_seed(3)
    n = 2 * 32
    rows = torch.cat([torch.randint(0, 100, (n, 1), generator=g), torch.randint(0, 50, (n, 16), generator=g)], 1)
    want = _tiny_logits(PersonaPlexEngine.from_files(files, 1, EngineOptions()), rows)
    capability = torch.cuda.get_device_capability()
    products = ["w8a16", "scaled_mm"] if capability >= (8, 9) else ["w8a16"]
    for matmul in products:
        engine = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda", weights="fp8", fp8_matmul=matmul,
                                                                      **options))
        assert engine.lm.fp8_matmul == matmul and engine.lm.layers[0].in_proj.dtype == torch.float8_e4m3fn
        got = _tiny_logits(engine, rows.cuda()).float().cpu()
        rel = float((got - want).norm() / want.norm())
        print(f"fp8 weights on the GPU, {matmul}, {options}: relative L2 error {rel:.4f}")
        assert rel < BF16_LOGIT_ERROR[matmul] + 0.02, rel
        texts, pcms = run(engine, frames)
        assert all(np.isfinite(p).all() for p in pcms) and texts[0][0] == 3
    auto = PersonaPlexEngine.from_files(files, 1, EngineOptions(device="cuda", weights="fp8"))
    assert auto.lm.fp8_matmul == ("scaled_mm" if capability >= (8, 9) else "w8a16")


def test_an_all_greedy_tick_replays_the_argmax_graph_and_gives_the_same_tokens(tiny_checkpoint, frames, no_tf32):
    """Ticks whose sessions are all greedy replay a graph that skips the sampler; their tokens
    and audio are the sampling graph's, and a tick with one sampled session takes the other."""
    files = ckpt.locate(tiny_checkpoint)
    greedy_specs = SPECS[:2]
    outputs = []
    for greedy_ticks in (True, False):
        engine = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda", lm_dtype="float32",
                                                                      greedy_ticks=greedy_ticks))
        slots = [engine.open_slot(s) for s in greedy_specs]
        steps = [engine.step(slots, frames[:2, f]) for f in range(frames.shape[1])]
        audio = np.concatenate([out.pcm for step in steps for out in step])
        outputs.append(([[out.text_id for out in step] for step in steps], audio))
        assert sorted(engine.graphs._graphs) == [(2, greedy_ticks)]
    assert outputs[0][0] == outputs[1][0]
    assert np.isfinite(outputs[0][1]).all() and np.allclose(outputs[0][1], outputs[1][1], atol=1e-5)
    engine = PersonaPlexEngine.from_files(files, 4, EngineOptions(device="cuda", lm_dtype="float32"))
    run(engine, frames[:, :4])  # SPECS: two greedy sessions and a sampled one
    assert sorted(engine.graphs._graphs) == [(4, False)]
