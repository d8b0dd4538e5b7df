"""The TensorRT-LLM backend without TensorRT-LLM: selection and start-up errors, the pure
bookkeeping (prompt-table inputs, KV blocks, positions), and the whole tick against the
PyTorch engine with the engine call executed by a plain-PyTorch model of the Llama engine
(tests/trtllm_reference.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engines.checkpoints import loader as ckpt
from engines.export.convert.cli import main as convert_main
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.runtime.factory import create_engine
from engines.interface import NoFreeSlot, SamplingParams, SessionSpec
from engines.runtime.trtllm import BackendUnavailable, check_build
from engines.runtime.trtllm.engine import TrtllmEngine, attention_window
from engines.runtime.trtllm.layout import BuildLayout
from engines.runtime.trtllm.prompt_table import CONTEXT, GENERATION, context_call, decode_call
from engines.runtime.trtllm.kv_blocks import SlotKVBlocks, SlotPositions
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
    w = attention_window(meta.context, window)
    return PagedExecutor(LlamaReference(build.checkpoint_dir), slots * -(-w // TOKENS_PER_BLOCK), TOKENS_PER_BLOCK, w)


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
    assert pos.length == [0, 9] and pos.context == [0, 8]
    pos.advance([1])
    with pytest.raises(ValueError, match="max-positions"):
        pos.check_room([1])
    pos.reset(1)
    assert pos.length == [0, 0]
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
    assert trt.temporal.positions.length[slots_trt[0]] > attention_window(trt.cfg.context, "reference")
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
