"""The batched engine on the tiny checkpoint: prefill, isolation, reset, sampling, errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engines.checkpoints import loader as ckpt
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.interface import WAITING, InvalidSessionSpec, NoFreeSlot, SamplingParams, SessionSpec, to_completion
from engines.state.prompt_kv import PromptKV
from engines.model.prefill import plan_prompt, prefill_pieces

GREEDY = SamplingParams(greedy=True)
FRAMES = 40


def make_engine(checkpoint, slots: int = 4, **options) -> PersonaPlexEngine:
    return PersonaPlexEngine.from_files(ckpt.locate(checkpoint), slots, EngineOptions(**options))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return make_engine(tiny_checkpoint)


def speech_frames(speech_pcm: np.ndarray, start_s: float, frames: int = FRAMES) -> np.ndarray:
    start = int(start_s * 24000)
    return speech_pcm[start : start + frames * 1920].reshape(frames, 1920)


def run(engine, slots, inputs):
    """Step ``slots`` together; ``inputs`` [len(slots), F, 1920] -> (text ids, pcm) per slot."""
    text = [[] for _ in slots]
    pcm = [[] for _ in slots]
    for f in range(inputs.shape[1]):
        for i, out in enumerate(engine.step(slots, inputs[:, f])):
            text[i].append(out.text_id)
            pcm[i].append(out.pcm)
    return [(t, np.concatenate(p)) for t, p in zip(text, pcm)]


def close_all(engine):
    for slot in engine.open_slots():
        engine.close_slot(slot)


@pytest.fixture(scope="module")
def chunked_engine(tiny_checkpoint):
    """Prefills in pieces of 16 positions: the tiny prompts take ~15 pieces and wrap the window."""
    return make_engine(tiny_checkpoint, prefill_chunk=16)


@pytest.mark.parametrize("which", ["one_pass", "pieces_of_16"])
def test_parallel_prefill_equals_stepwise_prefill(request, which, speech_pcm):
    engine = request.getfixturevalue("engine" if which == "one_pass" else "chunked_engine")
    close_all(engine)
    spec = SessionSpec(voice="NATM1.pt", persona="You enjoy having a good conversation.", sampling=GREEDY)
    a = engine.open_slot(spec)
    b = engine.open_slot(spec)
    engine.prefill_stepwise(b, spec)
    # The prompt is longer than the tiny 32-position window, so the ring wrapped.
    offset = int(engine.tokens.offset[a])
    assert offset == int(engine.tokens.offset[b]) > engine.cfg.context
    assert torch.equal(engine.tokens.cache[a], engine.tokens.cache[b])
    assert torch.equal(engine.tokens.provided[a], engine.tokens.provided[b])
    assert int(engine.kv.length[a]) == int(engine.kv.length[b]) == offset - 1
    ka, va = engine.kv.export(a, offset - 1 - engine.cfg.context, offset - 1)
    kb, vb = engine.kv.export(b, offset - 1 - engine.cfg.context, offset - 1)
    assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    frames = speech_frames(speech_pcm, 3.0)
    (ta, pa), (tb, pb) = run(engine, [a, b], np.stack([frames, frames]))
    assert ta == tb
    assert np.allclose(pa, pb, atol=1e-4)
    close_all(engine)


@pytest.mark.parametrize("chunk", [1, 5, 16, 31, 33, 64])
def test_a_prefill_in_pieces_equals_the_one_pass(engine, chunk):
    """Split into chunks of any size, the prefill gives the one pass's keys/values: each
    chunk's queries see exactly the keys they would have seen, also once the prompt is far
    longer than the window (the tiny model's is 32 positions) and the pieces' cache wraps."""
    window = engine.options.window
    voice = engine.voice_store.load("NATM1.pt")
    persona = engine.tokenizer.persona_tokens("You enjoy having a good conversation about the weather. " * 10)
    plan = plan_prompt(engine.cfg, voice, persona)
    one = to_completion(prefill_pieces(engine.lm, voice, plan, window, engine.cfg.context))
    total = one.positions
    assert total > 3 * engine.cfg.context
    pieces = prefill_pieces(engine.lm, voice, plan, window, engine.cfg.context, chunk)
    count = 1
    while True:
        try:
            next(pieces)
            count += 1
        except StopIteration as done:
            split = done.value
            break
    assert count == -(-total // chunk)
    assert (split.start, split.positions, split.offset) == (one.start, one.positions, one.offset)
    assert torch.allclose(split.keys, one.keys, atol=1e-5) and torch.allclose(split.values, one.values, atol=1e-5)


class OnePieceCache:
    """A CPU stand-in for the GPU's ``PrefillGraphs``: no bucket graphs, and one piece cache
    that one split pass at a time may hold (run eagerly here)."""

    def __init__(self, lm, capacity: int, chunk: int, held: bool) -> None:
        self.lm, self.capacity, self.chunk, self.held, self.claims = lm, capacity, chunk, held, 0

    def run(self, x):
        return None

    def pieces_held(self, chunk: int) -> bool:
        return chunk == self.chunk and self.held

    def claim_pieces(self, chunk: int):
        if self.pieces_held(chunk) or chunk != self.chunk:
            return None
        self.held, self.claims = True, self.claims + 1
        cfg, lm = self.lm.cfg, self.lm
        kv = PromptKV(cfg.num_layers, cfg.num_heads, cfg.head_dim, window=self.capacity,
                      size=self.capacity + chunk - 1, device=lm.device, dtype=lm.dtype)
        sequence = torch.zeros(1, dtype=torch.long)
        return SimpleNamespace(kv=kv, run=lambda piece: lm.temporal(sequence, piece, kv, "reference"))

    def release_pieces(self, pieces) -> None:
        self.held = False


def test_a_split_pass_that_may_wait_waits_for_the_piece_cache(engine):
    """While another pass holds the piece cache, a pass with ``wait`` yields WAITING and
    computes nothing; once it is free it takes it and gives the one pass's keys.  Without
    ``wait`` (a caller that cannot interleave) it runs at once on a cache of its own; run to
    completion, a pass that waits is an error rather than a hang."""
    window, capacity = engine.options.window, engine.cfg.context
    voice = engine.voice_store.load("NATM1.pt")
    plan = plan_prompt(engine.cfg, voice, engine.tokenizer.persona_tokens("You like long walks. " * 10))
    one = to_completion(prefill_pieces(engine.lm, voice, plan, window, capacity))
    graphs = OnePieceCache(engine.lm, capacity, 16, held=True)
    pieces = prefill_pieces(engine.lm, voice, plan, window, capacity, 16, graphs, wait=True)
    assert [next(pieces) for _ in range(3)] == [WAITING] * 3 and graphs.claims == 0
    graphs.release_pieces(None)  # the other pass ended
    split = to_completion(pieces)
    assert graphs.claims == 1 and not graphs.held
    assert torch.allclose(split.keys, one.keys, atol=1e-5) and torch.allclose(split.values, one.values, atol=1e-5)
    graphs.held = True
    eager = to_completion(prefill_pieces(engine.lm, voice, plan, window, capacity, 16, graphs))
    assert graphs.claims == 1 and torch.allclose(eager.keys, one.keys, atol=1e-5)
    with pytest.raises(RuntimeError, match="waited for another one"):
        to_completion(prefill_pieces(engine.lm, voice, plan, window, capacity, 16, graphs, wait=True))


def test_a_join_that_waited_for_the_same_prompt_takes_its_cached_prefill(tiny_checkpoint):
    """Two joins of one voice and persona at once (a burst, a load test): the second waits
    for the piece cache while the first computes, then takes the first's cached prefill
    instead of computing it again."""
    engine = make_engine(tiny_checkpoint, slots=2, prefill_chunk=16)
    engine.prefill_graphs = graphs = OnePieceCache(engine.lm, engine.cfg.context, 16, held=False)
    spec = SessionSpec(voice="NATM1.pt", persona="You like long walks. " * 10, sampling=GREEDY)
    first, second = engine.prepare_in_pieces(spec), engine.prepare_in_pieces(spec)
    for _ in range(3):  # tokenizing and planning a long persona are pieces of their own
        if graphs.held:
            break
        assert next(first) is None
    assert graphs.held  # the first holds the piece cache
    assert WAITING in [next(second) for _ in range(3)]
    done = to_completion(first)
    assert graphs.claims == 1 and not graphs.held
    assert to_completion(second) is done and graphs.claims == 1  # taken from the cache, not computed


def test_batch_equals_sessions_run_alone(tiny_checkpoint, engine, speech_pcm):
    close_all(engine)
    specs = [
        SessionSpec(voice="NATF2.pt", sampling=GREEDY),
        SessionSpec(voice="VARF0.pt", persona="You are a cheerful travel assistant.", seed=11),
        SessionSpec(voice="NATM1.pt", persona="You are a calm and precise assistant.", seed=12),
    ]
    inputs = np.stack([speech_frames(speech_pcm, s) for s in (1.0, 9.0, 17.0)])
    slots = [engine.open_slot(s) for s in specs]
    together = run(engine, slots, inputs)
    close_all(engine)
    alone = []
    for spec, frames in zip(specs, inputs):
        fresh = make_engine(tiny_checkpoint, slots=1)
        alone.append(run(fresh, [fresh.open_slot(spec)], frames[None])[0])
    for (t1, p1), (t2, p2) in zip(together, alone):
        assert t1 == t2
        # Bit for bit: the CPU path is batch-invariant (layers.linear, mimi.ops).
        assert np.array_equal(p1, p2)
    assert together[1][0] != together[2][0]  # the sessions really differ


def test_subset_steps_leave_other_slots_untouched(engine, speech_pcm):
    close_all(engine)
    spec = SessionSpec(sampling=GREEDY)
    a, b = engine.open_slot(spec), engine.open_slot(spec)
    frames = speech_frames(speech_pcm, 5.0)
    reference = run(engine, [a], frames[None])[0]
    engine.restart_slot(a)
    first = run(engine, [a], frames[None, :10])[0]
    run(engine, [b], speech_frames(speech_pcm, 20.0, 15)[None])  # only b advances
    rest = run(engine, [a], frames[None, 10:])[0]
    assert first[0] + rest[0] == reference[0]
    assert np.allclose(np.concatenate([first[1], rest[1]]), reference[1], atol=1e-5)
    close_all(engine)


def test_reset_slot_behaves_like_a_fresh_one(engine, speech_pcm):
    close_all(engine)
    spec = SessionSpec(voice="VARF0.pt", seed=7)
    frames = speech_frames(speech_pcm, 2.0)
    slot = engine.open_slot(spec)
    fresh = run(engine, [slot], frames[None])[0]
    run(engine, [slot], speech_frames(speech_pcm, 30.0)[None])  # more context
    engine.restart_slot(slot)
    again = run(engine, [slot], frames[None])[0]
    assert fresh[0] == again[0]
    assert np.allclose(fresh[1], again[1], atol=1e-6)
    engine.close_slot(slot)
    reopened = engine.open_slot(spec)
    assert run(engine, [reopened], frames[None])[0][0] == fresh[0]
    close_all(engine)


def test_seed_determines_sampling(engine, speech_pcm):
    close_all(engine)
    frames = speech_frames(speech_pcm, 12.0)
    outs = {}
    for seed in (1, 1, 2):
        slot = engine.open_slot(SessionSpec(seed=seed))
        outs.setdefault(seed, []).append(run(engine, [slot], frames[None])[0][0])
        engine.close_slot(slot)
    assert outs[1][0] == outs[1][1]
    assert outs[1][0] != outs[2][0]


def test_outputs_are_whole_finite_frames(engine, speech_pcm):
    close_all(engine)
    slot = engine.open_slot(SessionSpec(seed=3))
    (text, pcm), = run(engine, [slot], speech_frames(speech_pcm, 0.0, 25)[None])
    assert pcm.shape == (25 * 1920,) and pcm.dtype == np.float32
    assert np.isfinite(pcm).all() and pcm.std() > 1e-3
    assert all(0 <= t < engine.cfg.text_card for t in text)
    # The first live frame is the last (forced) prompt frame: PAD text.
    assert text[0] == 3
    close_all(engine)


def test_slot_errors(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, slots=1)
    with pytest.raises(InvalidSessionSpec, match="unknown voice"):
        engine.open_slot(SessionSpec(voice="NOPE.pt"))
    with pytest.raises(InvalidSessionSpec, match="bare"):
        engine.open_slot(SessionSpec(voice="../model.safetensors"))
    slot = engine.open_slot(SessionSpec())
    with pytest.raises(NoFreeSlot):
        engine.open_slot(SessionSpec())
    with pytest.raises(ValueError, match="shape"):
        engine.step([slot], np.zeros((1, 100), np.float32))
    engine.close_slot(slot)
    assert engine.free_slots() == 1
    with pytest.raises(ValueError, match="not open"):
        engine.step([slot], np.zeros((1, 1920), np.float32))


@pytest.mark.parametrize("failing", ["sampling.set", "kv.install", "tokens.restore", "kv.reset", "mimi.reset"])
def test_an_open_that_fails_after_taking_its_slot_gives_it_back(tiny_checkpoint, monkeypatch, speech_pcm, failing):
    """Each step of installing a session after its slot is taken, made to raise: the error
    reaches the caller, the slot is free again and serves the next session as a fresh one."""
    engine = make_engine(tiny_checkpoint, slots=1)
    spec = SessionSpec(sampling=GREEDY)
    expected = run(engine, [engine.open_slot(spec)], speech_frames(speech_pcm, 1.0, 4)[None])[0]
    close_all(engine)
    owner_name, method = failing.split(".")
    owner = getattr(engine, owner_name)

    def boom(*args, **kwargs):
        raise RuntimeError(f"{failing} failed")

    with monkeypatch.context() as patch:
        patch.setattr(owner, method, boom)
        with pytest.raises(RuntimeError, match="failed"):
            engine.open_slot(spec)
    assert engine.free_slots() == 1 and engine.open_slots() == []
    again = run(engine, [engine.open_slot(spec)], speech_frames(speech_pcm, 1.0, 4)[None])[0]
    assert again[0] == expected[0] and np.array_equal(again[1], expected[1])


def test_sampling_settings_outside_what_the_engine_stores_are_refused():
    from engines.interface import MAX_TEMPERATURE, MAX_TOP_K

    for bad in (dict(temp_text=1e39), dict(temp_audio=float("nan")), dict(temp_text=-1.0),
                dict(temp_audio=MAX_TEMPERATURE * 2), dict(topk_text=MAX_TOP_K + 1), dict(topk_audio=0),
                dict(topk_text=2.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="persona"):
        SessionSpec(persona="\ud800 hello \udfff")
    SamplingParams(temp_text=MAX_TEMPERATURE, topk_audio=MAX_TOP_K)  # the bounds themselves are fine


def test_sixteen_step_depformer_gives_the_same_agent_audio(tiny_checkpoint, speech_pcm):
    """User-side depformer steps are dead compute: running all 16 changes nothing (greedy)."""
    frames = speech_frames(speech_pcm, 4.0, 20)[None]
    results = []
    for steps in (8, 16):
        eng = make_engine(tiny_checkpoint, slots=1, depformer_steps=steps)
        results.append(run(eng, [eng.open_slot(SessionSpec(sampling=GREEDY))], frames)[0])
    assert results[0][0] == results[1][0]
    assert np.allclose(results[0][1], results[1][1], atol=1e-5)


def test_the_prefill_cache_is_bounded_by_bytes_too():
    """Cached prefills live on the engine's device: beside the entry count, their bytes are
    bounded (least recently used first out), and one larger than the bound is not kept."""
    from engines.model.prefill import Prefill, PrefillCache

    def prefill(positions: int) -> Prefill:
        kv = torch.zeros(1, 1, positions, 4)
        return Prefill(kv, kv.clone(), 0, torch.zeros(17, 4, dtype=torch.long), torch.zeros(17, 4, dtype=torch.bool),
                       positions + 1)

    small = 2 * 10 * 4 * 4 + 17 * 4 * 8 + 17 * 4  # keys + values + token ring + provided flags
    cache = PrefillCache(max_entries=16, max_bytes=3 * small)
    for name in "abc":
        cache.put(name, prefill(10))
    assert len(cache) == 3 and cache.nbytes == 3 * small
    assert cache.get("a") is not None  # now the most recently used
    cache.put("d", prefill(10))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    cache.put("a", prefill(10))  # replaced, not counted twice
    assert cache.nbytes == 3 * small
    cache.put("huge", prefill(1000))
    assert cache.get("huge") is None and cache.nbytes == 3 * small
    assert PrefillCache(max_entries=2).nbytes == 0


def test_the_graph_safe_sampler_draws_what_the_data_dependent_one_draws(tiny_checkpoint, speech_pcm):
    """The GPU's static-width sampler (settings gathered once per frame for the depformer's
    streams, noise always drawn) against the CPU's: the same tokens for sampled sessions of
    different settings and a greedy one stepped together."""
    specs = [SessionSpec(seed=7), SessionSpec(seed=8, sampling=SamplingParams(topk_audio=3, temp_text=1.3)),
             SessionSpec(seed=9, sampling=SamplingParams(greedy=True))]
    frames = np.stack([speech_frames(speech_pcm, start, 12) for start in (3.0, 9.0, 15.0)])
    results = []
    for static in (False, True):
        engine = make_engine(tiny_checkpoint, slots=3)
        engine._static_sampling = static
        slots = [engine.open_slot(spec) for spec in specs]
        results.append(run(engine, slots, frames))
    for (want_text, want_pcm), (got_text, got_pcm) in zip(*results):
        assert got_text == want_text
        np.testing.assert_array_equal(got_pcm, want_pcm)
