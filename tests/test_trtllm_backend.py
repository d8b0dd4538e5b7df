"""The TensorRT-LLM backend without TensorRT-LLM: selection and start-up errors, the pure
bookkeeping (prompt-table inputs, KV blocks, positions), and the whole tick against the
PyTorch engine with the engine call executed by a plain-PyTorch model of the Llama engine
(tests/trtllm_reference.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engines.checkpoints import loader as ckpt
from engines.export.convert.cli import main as convert_main
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.runtime.factory import create_engine
from engines.interface import NoFreeSlot, SamplingParams, SessionSpec, SlotFault
from engines.runtime.trtllm import BackendUnavailable, check_build
from engines.runtime.trtllm.engine import TrtllmEngine, attention_window
from engines.runtime.trtllm.layout import BuildLayout
from engines.runtime.trtllm.prompt_table import CONTEXT, GENERATION, context_call, decode_call
from engines.runtime.trtllm.kv_blocks import SlotKVBlocks, SlotPositions
from engines.runtime.trtllm.runtime import EngineBindings, TrtllmExecutor
from engines.runtime.trtllm.staging import HOST_TWINS, STAGED_VALUES, NoFence
from engines.runtime.trtllm.temporal import TemporalRunner
from orchestrator.settings import Settings, SettingsError
from tests.trtllm_reference import LlamaReference, PagedExecutor

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
TOKENS_PER_BLOCK = 8


@pytest.fixture(scope="module")
def build(tiny_checkpoint, tmp_path_factory) -> BuildLayout:
    out = tmp_path_factory.mktemp("trtllm") / "tiny32"
    assert convert_main(["--model-dir", str(tiny_checkpoint), "--output-dir", str(out), "--dtype", "float32",
                         "--skip-onnx", "--max-sessions", "4", "--tokens-per-block", str(TOKENS_PER_BLOCK), "-q"]) == 0
    return BuildLayout(out)


def executor(build: BuildLayout, slots: int, window: str = "reference") -> PagedExecutor:
    meta = build.read_meta()
    return PagedExecutor(LlamaReference(build.checkpoint_dir), meta, slots, attention_window(meta.context, window),
                         TOKENS_PER_BLOCK)


# Selection and start-up errors ---------------------------------------------------------------------
@pytest.mark.skipif(HAVE_TRTLLM, reason="TensorRT-LLM is installed here")
def test_missing_tensorrt_llm_is_a_clear_startup_error(build):
    with pytest.raises(BackendUnavailable) as exc:
        create_engine(str(build.root), max_slots=2, backend="trtllm")
    text = str(exc.value)
    assert "PERSONAPLEX_BACKEND=trtllm needs the 'tensorrt_llm' package" in text
    assert "1.2.1" in text and "PERSONAPLEX_BACKEND=torch" in text


def test_build_directory_errors_name_the_step_to_run(build, tmp_path):
    with pytest.raises(BackendUnavailable, match="PERSONAPLEX_CHECKPOINT"):
        check_build(None)
    with pytest.raises(BackendUnavailable, match="convert_checkpoint.py"):
        check_build(tmp_path)
    (tmp_path / "runtime.json").write_text('{"format_version": 1}')
    with pytest.raises(BackendUnavailable, match="runtime.json: missing keys"):
        check_build(tmp_path)
    with pytest.raises(BackendUnavailable, match="trtllm-build command in .*README.md"):
        check_build(build.root)  # converted, not built
    (build.engine_dir).mkdir(exist_ok=True)
    (build.engine_dir / "rank0.engine").write_bytes(b"")
    try:
        assert check_build(build.root).root == build.root
    finally:
        (build.engine_dir / "rank0.engine").unlink()


def test_factory_and_settings_select_the_backend(build):
    with pytest.raises(ValueError, match="trtllm"):
        create_engine(None, max_slots=1, backend="tensorrt")
    settings = Settings.from_mapping({"backend": "trtllm", "checkpoint": str(build.root)})
    assert settings.backend == "trtllm"
    assert settings.resolved_max_sessions("cuda") == 4  # the batch size the build was made for
    with pytest.raises(SettingsError, match="PERSONAPLEX_BACKEND"):
        Settings.from_mapping({"backend": "onnx"})
    with pytest.raises(SettingsError, match="PERSONAPLEX_CHECKPOINT"):
        Settings.from_mapping({"backend": "trtllm"})


# Pure bookkeeping ----------------------------------------------------------------------------------
def test_context_call_reads_its_table_row_by_row():
    table = torch.randn(5, 3)
    call = context_call(2, table, fake_id=100)
    assert call.slots == (2,) and call.is_context and call.num_tokens == 5
    assert call.input_ids.tolist() == [100] * 5 and call.tasks.tolist() == [0, 1, 2, 3, 4]
    assert call.prompt_vocab_size.tolist() == [1] and call.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert call.request_types.tolist() == [CONTEXT] and call.last_token_ids.tolist() == [5]
    assert call.context_lengths.tolist() == [5] and call.sequence_length.tolist() == [5]
    assert all(t.dtype == torch.int32 for t in (call.input_ids, call.tasks, call.last_token_ids))
    with pytest.raises(ValueError):
        context_call(0, torch.zeros(0, 3), 100)


def test_decode_call_has_one_token_per_slot():
    call = decode_call([3, 0], past_lengths=[40, 7], context_lengths=[30, 5], embeddings=torch.randn(2, 3), fake_id=9)
    assert call.batch == 2 and call.tokens_per_sequence() == [1, 1] and not call.is_context
    assert call.position_ids.tolist() == [40, 7] and call.past_key_value_lengths.tolist() == [40, 7]
    assert call.sequence_length.tolist() == [41, 8] and call.context_lengths.tolist() == [30, 5]
    assert call.request_types.tolist() == [GENERATION] * 2 and call.last_token_ids.tolist() == [1, 2]
    assert call.tasks.tolist() == [0, 1] and call.input_ids.tolist() == [9, 9]
    with pytest.raises(ValueError, match="once"):
        decode_call([1, 1], [0, 0], [0, 0], torch.zeros(2, 3), 9)
    with pytest.raises(ValueError):
        decode_call([1], [0, 0], [0], torch.zeros(1, 3), 9)


def test_kv_blocks_are_static_per_slot():
    blocks = SlotKVBlocks(num_slots=3, window=2999, tokens_per_block=64, num_layers=32)
    assert blocks.blocks_per_slot == 47 and blocks.num_blocks == 141
    off = blocks.offsets([2, 0])
    assert off.shape == (1, 2, 2, 47) and off.dtype == torch.int32
    # K of block b at b * layers * 2, V right after (TensorRT-LLM's pool layout).
    assert off[0, 1, 0, :3].tolist() == [0, 64, 128] and off[0, 1, 1, 0] == 1
    assert off[0, 0, 0, 0] == 2 * 47 * 64
    everything = blocks.offsets([0, 1, 2]).flatten().tolist()
    assert len(set(everything)) == len(everything)  # no two slots share a block
    with pytest.raises(ValueError):
        blocks.offsets([3])


def test_slot_positions():
    pos = SlotPositions(num_slots=2, max_positions=10)
    pos.start(1, 8)
    pos.advance([1])
    assert pos.length.tolist() == [0, 9] and pos.context.tolist() == [0, 8]
    assert pos.full([0, 1]) == []
    pos.advance([1])
    assert pos.full([0, 1]) == [1] and pos.full([1, 0]) == [1]
    pos.reset(1)
    assert pos.length.tolist() == [0, 0]
    with pytest.raises(ValueError):
        pos.start(0, 11)


def test_runner_over_a_paged_ring_matches_a_full_forward(build):
    """Prefill + decode steps through the paged executor = one full causal forward."""
    meta = build.read_meta()
    ex = executor(build, 2, window="full")
    runner = TemporalRunner(ex, meta, 2, window=meta.context)
    x = 0.3 * torch.randn(12, meta.hidden_size, generator=torch.Generator().manual_seed(1))
    runner.prefill(1, x[:9])
    outs = [runner.step([1], x[t: t + 1]) for t in range(9, 12)]
    full = ex.ref.forward(x)
    for t, (text, hidden) in zip(range(9, 12), outs):
        torch.testing.assert_close(text[0], full[t, : meta.text_vocab], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden[0], full[t, meta.text_vocab:], rtol=1e-4, atol=1e-4)
    assert runner.positions.length[1] == 12
    assert ex.calls[0].is_context and not ex.calls[1].is_context


class RecordingExecutor:
    """Records each call's position inputs and block offsets; returns zero logits."""

    def __init__(self, tokens_per_block: int, vocab: int) -> None:
        self.tokens_per_block, self.vocab = tokens_per_block, vocab
        self.seen: list[tuple[tuple[int, ...], list[int], list[int], list[int], list]] = []

    def run(self, call, block_offsets: torch.Tensor) -> torch.Tensor:
        self.seen.append((call.slots, call.position_ids.tolist(), call.context_lengths.tolist(),
                          call.sequence_length.tolist(), block_offsets.tolist()))
        return torch.zeros(call.batch, self.vocab)


def test_vectorised_bookkeeping_matches_a_per_slot_reference(build):
    """Positions, the full-slot check and the block table, each computed for a call's slots
    at once, against a per-slot loop written here, over random slot states and calls."""
    meta = build.read_meta()
    rng = np.random.default_rng(5)
    for _ in range(30):
        num_slots, tpb, window = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 40))
        limit = int(rng.integers(4, 30))
        runner = TemporalRunner(RecordingExecutor(tpb, meta.vocab_size), replace(meta, max_positions=limit,
                                                                               max_prefill=limit), num_slots, window)
        bps = -(-window // tpb)
        length, context = [0] * num_slots, [0] * num_slots  # the per-slot reference

        def block_row(slot: int) -> list[list[int]]:
            k = [(slot * bps + j) * 2 * meta.num_layers for j in range(bps)]
            return [k, [e + 1 for e in k]]

        for _ in range(25):
            slots = [int(s) for s in rng.permutation(num_slots)[: int(rng.integers(1, num_slots + 1))]]
            assert runner.blocks.offsets(slots).tolist() == [[block_row(s) for s in slots]]
            full = [s for s in slots if length[s] >= limit]
            assert runner.full_slots(slots) == full
            if rng.random() < 0.2:  # a slot (re)starts: a context call of a window at most, then one per position
                slot, n = slots[0], int(rng.integers(1, limit + 1))
                runner.prefill(slot, torch.zeros(n, meta.hidden_size))
                length[slot], context[slot] = n, min(n, window)
            elif full:
                with pytest.raises(SlotFault) as fault:
                    runner.step(slots, torch.zeros(len(slots), meta.hidden_size))
                assert list(fault.value.slots) == full and fault.value.outputs is None
            else:
                runner.step(slots, torch.zeros(len(slots), meta.hidden_size))
                want = [length[s] for s in slots]
                assert runner.executor.seen[-1] == (tuple(slots), want, [context[s] for s in slots],
                                                    [n + 1 for n in want], [[block_row(s) for s in slots]])
                for s in slots:
                    length[s] += 1
            assert runner.positions.length.tolist() == length and runner.positions.context.tolist() == context


# What an engine call binds (EngineBindings._bindings, TrtllmExecutor's own) ----------------------------
def test_bindings_are_the_inputs_the_engine_declares(build):
    """The real ``_bindings`` for a context call and a decode call: every name, dtype, shape
    and host/device place the reference engine declares (tests/trtllm_reference.py), and the
    values the engine must read."""
    meta = build.read_meta()
    assert TrtllmExecutor._bindings is EngineBindings._bindings  # the method the executor binds with
    ex = executor(build, 3)
    window, bindings = ex.bindings.window, ex.bindings
    blocks = SlotKVBlocks(3, window, TOKENS_PER_BLOCK, meta.num_layers)
    prompt = torch.randn(5, meta.hidden_size)
    context = context_call(2, prompt, meta.vocab_size)
    inputs = bindings._bindings(context, blocks.offsets([2]))
    ex.check(inputs)
    assert inputs["input_ids"].tolist() == [meta.vocab_size] * 5 and inputs["tasks"].tolist() == [0, 1, 2, 3, 4]
    assert inputs["position_ids"].tolist() == [0, 1, 2, 3, 4] and inputs["prompt_vocab_size"].tolist() == [1]
    assert inputs["host_request_types"].tolist() == [CONTEXT] and inputs["last_token_ids"].tolist() == [5]
    assert inputs["context_lengths"].tolist() == [5] and inputs["sequence_length"].tolist() == [5]
    assert inputs["host_past_key_value_lengths"].tolist() == [5]
    assert torch.equal(inputs["kv_cache_block_offsets"], blocks.offsets([2]))
    assert inputs["prompt_embedding_table"].data_ptr() == prompt.data_ptr()  # already in the engine's dtype

    table = torch.randn(2, meta.hidden_size)
    decode = decode_call([2, 0], [40, 7], [30, 5], table, meta.vocab_size)
    inputs = bindings._bindings(decode, blocks.offsets([2, 0]))
    ex.check(inputs)
    assert inputs["input_ids"].tolist() == [meta.vocab_size] * 2 and inputs["tasks"].tolist() == [0, 1]
    assert inputs["position_ids"].tolist() == [40, 7] and inputs["host_past_key_value_lengths"].tolist() == [40, 7]
    assert inputs["sequence_length"].tolist() == [41, 8] and inputs["context_lengths"].tolist() == [30, 5]
    assert inputs["host_request_types"].tolist() == [GENERATION] * 2 and inputs["last_token_ids"].tolist() == [1, 2]
    assert torch.equal(inputs["kv_cache_block_offsets"], blocks.offsets([2, 0]))
    assert inputs["prompt_embedding_table"].data_ptr() == table.data_ptr()
    assert int(inputs["host_kv_cache_pool_pointers"][0, 0]) == ex.pool.data_ptr()
    assert inputs["host_max_attention_window_sizes"].tolist() == [window] * meta.num_layers
    assert inputs["host_runtime_perf_knobs"].tolist() == [1] + [-1] * 15
    with pytest.raises(ValueError, match="kv_cache_block_offsets"):  # a wrong shape is refused, not broadcast
        bindings._bindings(decode, blocks.offsets([2]))


class OpLog(TorchDispatchMode):
    """Every ATen operation run inside it, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[torch._ops.OpOverload, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


def test_bindings_stage_through_one_copy_and_allocate_nothing(build):
    """A call's inputs are views of two buffers allocated once; building them writes the host
    buffer and makes ONE copy of its device part, with no other tensor operation than views."""
    meta = build.read_meta()
    ex = executor(build, 3)
    staging = ex.bindings.staging
    blocks = SlotKVBlocks(3, ex.bindings.window, TOKENS_PER_BLOCK, meta.num_layers)
    ex.bindings._bindings(context_call(1, torch.randn(6, meta.hidden_size), meta.vocab_size), blocks.offsets([1]))
    calls = [decode_call([2, 0, 1], [40, 7, 9], [30, 5, 6], torch.randn(3, meta.hidden_size), meta.vocab_size)
             for _ in range(2)]
    offsets = blocks.offsets([2, 0, 1])
    seen = []
    for call in calls:
        with OpLog() as log:
            inputs = ex.bindings._bindings(call, offsets)
        seen.append({name: t.data_ptr() for name, t in inputs.items() if name != "prompt_embedding_table"})
        others = [func for func, _ in log.ops if not func.is_view and func is not torch.ops.aten.copy_.default]
        assert others == [], others
        copies = [args for func, args in log.ops if func is torch.ops.aten.copy_.default]
        to_device = [(dst, src) for dst, src, *_ in copies if same_storage(dst, staging.device_buffer)]
        assert len(to_device) == 1, f"{len(to_device)} copies to the device buffer"
        assert same_storage(to_device[0][1], staging.host)
        for name in STAGED_VALUES + tuple(HOST_TWINS):
            buffer = staging.host if name.startswith("host_") else staging.device_buffer
            assert same_storage(inputs[name], buffer), name
            assert (inputs[name].data_ptr() - buffer.data_ptr()) % 256 == 0, name  # TensorRT's alignment
        ex.check(inputs)
    assert seen[0] == seen[1]  # the same memory every call of a shape


def same_storage(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class SnapshotFence:
    """Logs ``record``s and ``wait``s; at each wait, what the host buffer held."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.host_at_wait: list[torch.Tensor] = []
        self.staging = None

    def record(self) -> None:
        self.log.append("record")

    def wait(self) -> None:
        self.log.append("wait")
        self.host_at_wait.append(self.staging.host.clone())


def test_the_host_buffer_is_rewritten_only_after_the_previous_copy(build):
    """Pinned-buffer hazard: a call's host buffer is rewritten only after waiting on the fence
    recorded after the previous call's copy, never before."""
    meta = build.read_meta()
    fence = SnapshotFence()
    pool = torch.zeros(8, meta.num_layers, 2, meta.num_heads, TOKENS_PER_BLOCK, meta.hidden_size // meta.num_heads)
    bindings = EngineBindings(meta, 2, 31, TOKENS_PER_BLOCK, pool, fence=fence)
    fence.staging = bindings.staging
    blocks = SlotKVBlocks(2, 31, TOKENS_PER_BLOCK, meta.num_layers)
    table = torch.randn(2, meta.hidden_size)
    bindings._bindings(decode_call([0, 1], [10, 20], [3, 4], table, meta.vocab_size), blocks.offsets([0, 1]))
    first = bindings.staging.host.clone()
    bindings._bindings(decode_call([1, 0], [21, 11], [4, 3], table, meta.vocab_size), blocks.offsets([1, 0]))
    assert fence.log == ["wait", "record", "wait", "record"]
    assert torch.equal(fence.host_at_wait[1], first), "the second call wrote the host buffer before its wait"
    assert not torch.equal(bindings.staging.host, first)
    assert isinstance(EngineBindings(meta, 2, 31, TOKENS_PER_BLOCK, pool).staging.fence, NoFence)  # CPU: no wait


# The whole tick against the PyTorch engine ----------------------------------------------------------
def test_tick_matches_the_pytorch_engine(build, tiny_checkpoint):
    """Two sessions (different voices, one sampled) through the TensorRT-LLM backend's tick,
    with a prompt longer than the tiny model's window (the KV ring wraps), against the
    PyTorch engine: same text tokens and audio."""
    trt = TrtllmEngine.from_build(build, executor(build, 2), num_slots=2, device="cpu")
    ref = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 2, EngineOptions(device="cpu"))
    assert trt.info.backend == "trtllm" and trt.voices() == ref.voices()
    specs = [SessionSpec(voice="NATF2.pt", sampling=SamplingParams(greedy=True)),
             SessionSpec(voice="VARF0.pt", persona="You are a calm and precise assistant.", seed=7)]
    slots_trt = [trt.open_slot(s) for s in specs]
    slots_ref = [ref.open_slot(s) for s in specs]
    window = attention_window(trt.cfg.context, "reference")
    assert trt.temporal.positions.length[slots_trt[0]] > window
    # A prompt longer than the window: one context call of a window, then generation calls.
    contexts = [call.num_tokens for call in trt.temporal.executor.calls if call.is_context]
    assert contexts == [window, window] and len(trt.temporal.executor.calls) > 2
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(5):
        pcm = (0.1 * rng.standard_normal((2, 1920))).astype(np.float32)
        got, want = trt.step(slots_trt, pcm), ref.step(slots_ref, pcm)
        for g, w in zip(got, want):
            assert g.text_id == w.text_id
            np.testing.assert_allclose(g.pcm, w.pcm, rtol=0, atol=1e-4)
        texts.append(got[0].text_id)
    # Restart replays the prompt: the same frames come out again.
    trt.restart_slot(slots_trt[0])
    ref.restart_slot(slots_ref[0])
    pcm = np.zeros((1, 1920), np.float32)
    assert trt.step(slots_trt[:1], pcm)[0].text_id == ref.step(slots_ref[:1], pcm)[0].text_id
    trt.close_slot(slots_trt[1])
    assert trt.free_slots() == 1 and trt.temporal.positions.length[slots_trt[1]] == 0
    trt.open_slot(specs[0])
    with pytest.raises(NoFreeSlot):
        trt.open_slot(specs[0])


def test_a_slot_at_max_positions_fails_alone(build, tiny_checkpoint):
    """A session that reached the engine's --max-positions fails alone: SlotFault names its
    slot only and carries the other slot's output, the PyTorch engine's frame; once the
    caller has restarted the failed slot (as the scheduler does), both step again."""
    trt = TrtllmEngine.from_build(build, executor(build, 2), num_slots=2, device="cpu")
    ref = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 2, EngineOptions(device="cpu"))
    specs = [SessionSpec(voice="NATF2.pt", sampling=SamplingParams(greedy=True)), SessionSpec(voice="VARF0.pt", seed=7)]
    a, b = (trt.open_slot(s) for s in specs)
    ref_a, ref_b = (ref.open_slot(s) for s in specs)
    rng = np.random.default_rng(2)

    def frames(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal((n, 1920))).astype(np.float32)

    def same(got, want) -> None:
        assert got.text_id == want.text_id
        np.testing.assert_allclose(got.pcm, want.pcm, rtol=0, atol=1e-4)

    pcm = frames(2)
    for got, want in zip(trt.step([a, b], pcm), ref.step([ref_a, ref_b], pcm), strict=True):
        same(got, want)
    trt.temporal.positions.length[a] = trt.meta.max_positions  # as after 43 minutes of conversation
    pcm = frames(2)
    with pytest.raises(SlotFault) as fault:
        trt.step([b, a], pcm)
    assert fault.value.slots == (a,) and "max-positions" in str(fault.value)
    assert fault.value.outputs[1] is None
    same(fault.value.outputs[0], ref.step([ref_b], pcm[:1])[0])
    trt.restart_slot(a)
    ref.restart_slot(ref_a)
    pcm = frames(2)
    for got, want in zip(trt.step([a, b], pcm), ref.step([ref_a, ref_b], pcm), strict=True):
        same(got, want)


@pytest.mark.parametrize("advanced", [True, False], ids=["with-outputs", "none-advanced"])
def test_a_fault_of_the_other_slots_joins_the_full_slot_s(build, monkeypatch, advanced):
    """While a full slot is left out, the others' own step fails too: one SlotFault names
    both, its outputs aligned with the tick's slots (or none, if the others did not advance)."""
    trt = TrtllmEngine.from_build(build, executor(build, 2), num_slots=2, device="cpu")
    a, b = (trt.open_slot(SessionSpec(voice="NATF2.pt", sampling=SamplingParams(greedy=True))) for _ in range(2))
    trt.temporal.positions.length[a] = trt.meta.max_positions
    whole = trt.step

    def step(slots, pcm):
        if a in slots:
            return whole(slots, pcm)
        raise SlotFault("the other slot's own fault", list(slots), [None] * len(slots) if advanced else None)

    monkeypatch.setattr(trt, "step", step)
    with pytest.raises(SlotFault) as fault:
        trt.step([b, a], np.zeros((2, 1920), dtype=np.float32))
    assert fault.value.slots == (a, b) and "max-positions" in str(fault.value) and "own fault" in str(fault.value)
    assert fault.value.outputs == ([None, None] if advanced else None)


def test_an_install_that_fails_gives_the_slot_back(build, monkeypatch):
    """The engine's context call for a new session raises: the caller hears it, the slot and
    its block ring are free again, and the next open gets the slot."""
    trt = TrtllmEngine.from_build(build, executor(build, 1), num_slots=1, device="cpu")

    def boom(*args, **kwargs):
        raise RuntimeError("context call failed")

    with monkeypatch.context() as patch:
        patch.setattr(trt.temporal, "prefill", boom)
        with pytest.raises(RuntimeError, match="context call failed"):
            trt.open_slot(SessionSpec(voice="NATF2.pt"))
    assert trt.free_slots() == 1 and trt.open_slots() == [] and trt.temporal.positions.length[0] == 0
    assert trt.open_slot(SessionSpec(voice="NATF2.pt")) == 0


def test_both_backends_run_one_tick():
    """The tick, the slots' life cycle and the step are the shared runtime's; a backend only
    says how its temporal transformer is called and holds a slot's context."""
    from engines.runtime.engine_runtime import EngineRuntime

    shared = {"step", "live_tick", "step_tokens", "lm_call", "open_slot", "close_slot", "restart_slot", "_install",
              "_reset"}
    for backend in (PersonaPlexEngine, TrtllmEngine):
        assert issubclass(backend, EngineRuntime) and not shared & set(vars(backend)), backend
        assert {"temporal_call", "install_context", "release_context"} <= set(vars(backend))


class ModuleGraph:
    """An exported graph's own PyTorch module (what ``torch.onnx.export`` traces), run with
    the named-tensor contract of its TensorRT plan (engines.runtime.trtllm.plans.Graph)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.layout = module.eval(), module.layout

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            values = self.module(*(feeds[name] for name in self.layout.input_names))
        return dict(zip(self.layout.output_names, values if isinstance(values, tuple) else (values,), strict=True))


def test_tick_with_mimi_and_depformer_graphs(build, tiny_checkpoint):
    """The plan adapters (per-slot state slabs, in-graph sampling fed the engine's noise) on
    the graphs' own modules give the PyTorch engine's frames."""
    from engines.export.onnx.depformer_graph import DepformerGraph
    from engines.export.onnx.mimi_graph import MimiDecoderGraph, MimiEncoderGraph
    from engines.runtime.trtllm.plans import GraphDepformer, GraphMimi

    trt = TrtllmEngine.from_build(build, executor(build, 2), num_slots=2, device="cpu")
    codec = trt.mimi
    trt.mimi = GraphMimi(ModuleGraph(MimiEncoderGraph(codec)), ModuleGraph(MimiDecoderGraph(codec)), 2, trt.device)
    trt.graph_depformer = GraphDepformer(ModuleGraph(DepformerGraph(trt.lm, 8)), 8, trt.cfg.card)
    ref = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 2, EngineOptions(device="cpu"))
    specs = [SessionSpec(voice="NATM1.pt", seed=3), SessionSpec(voice="NATF2.pt", seed=4)]
    slots = [trt.open_slot(s) for s in specs], [ref.open_slot(s) for s in specs]
    rng = np.random.default_rng(1)

    def check(which: list[int]) -> None:
        pcm = (0.1 * rng.standard_normal((len(which), 1920))).astype(np.float32)
        got = trt.step([slots[0][i] for i in which], pcm)
        want = ref.step([slots[1][i] for i in which], pcm)
        for g, w in zip(got, want, strict=True):
            assert g.text_id == w.text_id
            np.testing.assert_allclose(g.pcm, w.pcm, rtol=0, atol=1e-4)

    for which in ([0, 1], [1], [0, 1]):
        check(which)
    trt.restart_slot(slots[0][1])  # its Mimi state rows are zeroed, the other slot's kept
    ref.restart_slot(slots[1][1])
    check([1, 0])
