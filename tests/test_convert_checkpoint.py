"""convert_checkpoint.py: the TensorRT-LLM checkpoint against an independent model of the
engine's Llama semantics, the native artifacts against the PyTorch engine, and the CLI
(resume, refusal, clear errors)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engines.checkpoints import loader as ckpt
from engines.config import DEFAULT_PERSONA, LMConfig
from engines.export.convert import llama, readme
from engines.export.convert.cli import main
from engines.export.convert.safetensors_stream import TensorSpec, write_streaming
from engines.model.lm import MoshiLM
from engines.state.kv_ring import SlotKVRing, WindowMode
from engines.runtime.trtllm.layout import BuildLayout
from tests.trtllm_reference import LlamaReference

REPO = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--skip-onnx", "--max-sessions", "4", "--tokens-per-block", "8", "-q"]


def convert(model_dir: Path, out: Path, *extra: str) -> None:
    assert main(["--model-dir", str(model_dir), "--output-dir", str(out), *TINY_ARGS, *extra]) == 0


@pytest.fixture(scope="module")
def build32(tiny_checkpoint, tmp_path_factory) -> BuildLayout:
    """The tiny checkpoint converted in float32 (exact comparisons)."""
    out = tmp_path_factory.mktemp("convert") / "tiny32"
    convert(tiny_checkpoint, out, "--dtype", "float32")
    return BuildLayout(out)


@pytest.fixture(scope="module")
def moshi_lm(tiny_checkpoint) -> MoshiLM:
    files = ckpt.locate(tiny_checkpoint)
    lm = MoshiLM(files.lm_config, 1)
    tensors = ckpt.load_lm_tensors(ckpt.SafetensorsReader(files.lm_weights), files.lm_config, 1, convert=lambda t: t.float())
    lm.load_state_dict(tensors, strict=True, assign=True)
    return lm.eval()


# The checkpoint ---------------------------------------------------------------------------------
def test_config_json_describes_a_llama_with_moshis_numbers(build32):
    c = json.loads((build32.checkpoint_dir / "config.json").read_text())
    cfg = LMConfig.from_moshi_kwargs(json.loads(build32.lm_config.read_text()))
    assert c["architecture"] == "LlamaForCausalLM"
    assert c["dtype"] == "float32" and c["logits_dtype"] == "float32"
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == \
        (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_heads)
    assert c["head_size"] == cfg.head_dim and c["intermediate_size"] == cfg.ffn_hidden
    assert c["hidden_act"] == "silu" and c["norm_epsilon"] == 1e-8
    assert c["position_embedding_type"] == "rope_gpt_neox" and c["rotary_base"] == 10000.0
    assert c["vocab_size"] == cfg.text_card + cfg.dim  # text logits + the hidden-state rows
    assert c["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert c["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}


def test_7b_layout():
    """PersonaPlex 7B numbers (spec/trtllm.md 2.4) without touching 16 GB of weights."""
    cfg = LMConfig()
    c = llama.llama_config(cfg, dtype="bfloat16", kv_cache_dtype="fp8", max_positions=32768)
    assert (c["vocab_size"], c["intermediate_size"], c["head_size"]) == (32000 + 4096, 11264, 128)
    assert c["quantization"]["kv_cache_quant_algo"] == "FP8"
    specs = {s.name: s for s in llama.tensor_specs(cfg, "bfloat16", "fp8")}
    assert specs["transformer.layers.31.attention.qkv.weight"].shape == (12288, 4096)
    assert specs["transformer.layers.0.mlp.fc.weight"].shape == (11264, 4096)
    assert specs["transformer.layers.0.mlp.proj.weight"].shape == (4096, 11264)
    assert specs["lm_head.weight"].shape == (36096, 4096)
    assert specs["transformer.layers.7.attention.kv_cache_scaling_factor"].dtype == torch.float32
    assert len(specs) == 1 + 32 * 8 + 2
    assert 13.5e9 < sum(s.nbytes for s in specs.values()) < 14.0e9


def test_weights_are_mapped_by_trtllm_names(build32, tiny_checkpoint):
    files = ckpt.locate(tiny_checkpoint)
    cfg = files.lm_config
    src = load_file(str(files.lm_weights))
    w = load_file(str(build32.checkpoint_dir / "rank0.safetensors"))
    assert set(w) == {s.name for s in llama.tensor_specs(cfg, "float32", "auto")}
    h, d = cfg.ffn_hidden, cfg.dim
    linear_in = src["transformer.layers.1.gating.linear_in.weight"].float()
    # Moshi applies SiLU to the first half of linear_in; TRT-LLM applies it to mlp.fc.
    assert torch.equal(w["transformer.layers.1.mlp.fc.weight"], linear_in[:h])
    assert torch.equal(w["transformer.layers.1.mlp.gate.weight"], linear_in[h:])
    in_proj = src["transformer.layers.1.self_attn.in_proj_weight"].float()
    qkv = w["transformer.layers.1.attention.qkv.weight"]
    assert torch.equal(qkv[2 * d:], in_proj[2 * d:])  # v untouched
    hd = cfg.head_dim
    assert torch.equal(qkv[hd: hd + hd // 2], in_proj[hd: 2 * hd: 2])  # head 1 of q: even dims first
    assert torch.equal(w["lm_head.weight"][: cfg.text_card], src["text_linear.weight"].float())
    assert torch.equal(w["lm_head.weight"][cfg.text_card:], torch.eye(d))
    assert torch.equal(w["transformer.ln_f.weight"], src["out_norm.alpha"].float().view(d))


def test_trtllm_llama_semantics_reproduce_the_temporal_transformer(build32, moshi_lm):
    """The converted checkpoint, run with TensorRT-LLM's Llama semantics, gives our
    engine's text logits and normed hidden state for the same input embeddings."""
    cfg = moshi_lm.cfg
    steps = 6  # < context: full attention over every step
    gen = torch.Generator().manual_seed(3)
    tokens = torch.stack([torch.randint(0, cfg.text_card, (1, steps), generator=gen)] +
                         [torch.randint(0, cfg.card, (1, steps), generator=gen) for _ in range(cfg.n_q)], dim=-1)
    with torch.no_grad():
        x = moshi_lm.embed_tokens(tokens)  # [1, steps, D]
        kv = SlotKVRing(cfg.num_layers, 1, cfg.num_heads, cfg.context, cfg.head_dim)
        slots = torch.tensor([0])
        hidden = torch.cat([moshi_lm.temporal(slots, x[:, t: t + 1], kv, WindowMode.FULL) for t in range(steps)], 1)[0]
        ours = moshi_lm.text_logits(hidden)
        ref = LlamaReference(build32.checkpoint_dir)
        # The same embeddings through the prompt table: fake id vocab_size, one task per token.
        fed = ref.embed(torch.full((steps,), ref.vocab), torch.arange(steps), torch.ones(1, dtype=torch.int32), x[0])
        logits = ref.forward(fed)
    assert torch.equal(fed, x[0])
    torch.testing.assert_close(logits[:, : cfg.text_card], ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[:, cfg.text_card:], hidden, rtol=1e-5, atol=1e-5)
    assert (logits[:, : cfg.text_card].argmax(-1) == ours.argmax(-1)).all()


def test_fp8_kv_cache_fields(tiny_checkpoint, tmp_path):
    convert(tiny_checkpoint, tmp_path / "fp8", "--kv-cache-dtype", "fp8", "--kv-cache-scale", "0.5")
    c = json.loads((tmp_path / "fp8" / "trtllm_checkpoint" / "config.json").read_text())
    assert c["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8"} and c["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "fp8" / "trtllm_checkpoint" / "rank0.safetensors"), "pt") as f:
        scale = f.get_tensor("transformer.layers.0.attention.kv_cache_scaling_factor")
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert scale.dtype == torch.float32 and scale.tolist() == [0.5]
    assert json.loads((tmp_path / "fp8" / "runtime.json").read_text())["kv_cache_dtype"] == "fp8"


def test_streaming_writer_refuses_mismatches(tmp_path):
    spec = [TensorSpec("a", (2,), torch.float32)]
    write_streaming(tmp_path / "ok.safetensors", spec, [("a", torch.ones(2))], metadata={"k": "v"})
    assert torch.equal(load_file(str(tmp_path / "ok.safetensors"))["a"], torch.ones(2))
    with pytest.raises(ValueError, match="declared"):
        write_streaming(tmp_path / "bad.safetensors", spec, [("a", torch.ones(3))])
    with pytest.raises(ValueError, match="never produced"):
        write_streaming(tmp_path / "bad.safetensors", spec, [])


# Native artifacts and the build README ----------------------------------------------------------
def test_native_artifacts_match_the_pytorch_engine(build32, tiny_checkpoint):
    from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
    from engines.interface import SessionSpec
    from engines.runtime.trtllm.native import load_prefills

    files = ckpt.locate(tiny_checkpoint)
    src = load_file(str(files.lm_weights))
    emb = load_file(str(build32.embeddings))
    assert torch.equal(emb["emb"][3], src["emb.3.weight"].float())
    assert torch.equal(emb["text_emb"], src["text_emb.weight"].float())
    dep = load_file(str(build32.depformer))
    assert dep["linears"].shape[0] == 8 and "depformer_layers.1.ffn_in" in dep
    engine = PersonaPlexEngine.from_files(files, 1, EngineOptions(device="cpu"))
    stored = load_prefills(build32.prefill)
    persona = tuple(engine.tokenizer.persona_tokens(DEFAULT_PERSONA))
    assert {v for v, _ in stored} == set(engine.voices())
    for voice in engine.voices():
        ours = engine.prepare(SessionSpec(voice=voice))
        prefill = stored[(voice, persona)]
        assert prefill.positions == ours.positions and prefill.offset == ours.offset
        assert torch.equal(prefill.token_cache, ours.token_cache)
    # Mimi with its codebooks precomputed encodes exactly like the original file.
    from engines.model.mimi import MimiCodec

    mimi_cfg = files.mimi_config
    a = MimiCodec.from_state_dict(mimi_cfg, load_file(str(build32.mimi)), 1)
    b = MimiCodec.from_state_dict(mimi_cfg, load_file(str(files.mimi_weights)), 1)
    pcm = 0.1 * torch.randn(1, 1920, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.encode_step([0], pcm), b.encode_step([0], pcm))
    assert not any(".vq.layers.7." in k for k in load_file(str(build32.mimi)))  # unused levels dropped


def test_readme_has_the_build_commands(build32):
    text = build32.readme.read_text()
    for flag in ("trtllm-build", "--checkpoint_dir", "--max_prompt_embedding_table_size 1024", "--kv_cache_type paged",
                 "--remove_input_padding enable", "--gpt_attention_plugin float32", "--logits_dtype float32",
                 "--max_batch_size 4", "--tokens_per_block 8", "--max_beam_width 1"):
        assert flag in text, flag
    meta = build32.read_meta()
    # No gather flag: the engine must return one row of logits per sequence.
    assert not any("gather" in arg for arg in readme.trtllm_build_args(build32, meta))
    assert meta.prompt_table_size >= meta.max_sessions and meta.vocab_size == meta.text_vocab + meta.hidden_rows


# CLI ------------------------------------------------------------------------------------------------
def test_rerun_resumes_and_refuses_other_options(build32, tiny_checkpoint, caplog):
    rank0 = build32.checkpoint_dir / "rank0.safetensors"
    before = rank0.stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        assert main(["--model-dir", str(tiny_checkpoint), "--output-dir", str(build32.root),
                     "--dtype", "float32", *TINY_ARGS[:-1]]) == 0
    assert "trtllm_checkpoint: already done, skipped" in caplog.text
    assert rank0.stat().st_mtime_ns == before
    with pytest.raises(SystemExit) as exc:
        main(["--model-dir", str(tiny_checkpoint), "--output-dir", str(build32.root), "--dtype", "bfloat16", *TINY_ARGS])
    assert exc.value.code == 2


def test_an_interrupted_step_is_redone(tiny_checkpoint, tmp_path):
    out = tmp_path / "b"
    convert(tiny_checkpoint, out)
    depformer = out / "native" / "depformer.safetensors"
    depformer.write_bytes(b"truncated")  # a damaged artifact, as after a crash mid-write
    (out / "native" / ".embeddings.safetensors.partial").write_bytes(b"leftover")
    convert(tiny_checkpoint, out)
    assert load_file(str(depformer))["linears"].shape[0] == 8
    assert not (out / "native" / ".embeddings.safetensors.partial").exists()


def test_force_overwrites(tiny_checkpoint, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's")
    with pytest.raises(SystemExit):
        convert(tiny_checkpoint, out)
    convert(tiny_checkpoint, out, "--force")
    assert (out / "runtime.json").is_file()


def _expect_error(capsys, argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2
    assert err.startswith("convert_checkpoint.py: error:") and needle in err, err
    assert "\n" not in err and "Traceback" not in err


def test_bad_inputs_exit_2_with_one_line(tiny_checkpoint, tmp_path, capsys):
    out = str(tmp_path / "out")
    _expect_error(capsys, ["--model-dir", str(tmp_path / "missing"), "--output-dir", out], "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(capsys, ["--model-dir", str(empty), "--output-dir", out], "LM weights not found")
    _expect_error(capsys, ["--model-dir", str(tiny_checkpoint), "--output-dir", out, "--dtype", "int4"], "--dtype")
    _expect_error(capsys, ["--model-dir", str(tiny_checkpoint), "--output-dir", out, "--max-sessions", "0"],
                  "positive integer")
    _expect_error(capsys, ["--model-dir", str(tiny_checkpoint)], "--output-dir")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_checkpoint.iterdir():
        (broken / f.name).symlink_to(f)
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    _expect_error(capsys, ["--model-dir", str(broken), "--output-dir", out], "model.safetensors")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _expect_error(capsys, ["--model-dir", str(tiny_checkpoint), "--output-dir", str(a_file), "--skip-onnx"],
                  "not a directory")
    assert not Path(out).exists()  # nothing written by a failed run


def test_cli_choices_are_the_converters():
    from engines.export.convert import cli

    choices = {action.dest: action.choices for action in cli.build_parser()._actions}
    assert set(choices["dtype"]) == set(llama.DTYPES) and tuple(choices["kv_cache_dtype"]) == llama.KV_CACHE_DTYPES
    assert "int8" not in llama.KV_CACHE_DTYPES  # the torch engine's int8 cache has no converter counterpart


def test_command_line_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, str(REPO / "convert_checkpoint.py"), "--help"], check=False, capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0 and "trtllm-build" in run.stdout and "--kv-cache-dtype" in run.stdout
    run = subprocess.run([sys.executable, str(REPO / "convert_checkpoint.py"), "--model-dir", str(tmp_path / "nope"),
                          "--output-dir", str(tmp_path / "o")], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
