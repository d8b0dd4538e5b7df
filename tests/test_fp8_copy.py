"""``convert_checkpoint.py --target torch-fp8``: an fp8 copy of a checkpoint that the PyTorch
engine serves as the same model it quantizes at load, and the errors around it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engines.checkpoints import loader as ckpt
from engines.config import LM_FILE
from engines.export.convert.cli import main
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.errors import CheckpointError
from engines.interface import SamplingParams, SessionSpec
from engines.model.fp8 import FP8_DTYPE
from engines.checkpoints.weights_format import is_fp8_checkpoint
from tests.orch_support import Server, run, streams
from tests.test_kv_fp8 import _tiny_logits


def write_copy(source: Path, out: Path, *extra: str) -> int:
    return main(["--model-dir", str(source), "--target", "torch-fp8", "--output-dir", str(out), "-q", *extra])


@pytest.fixture(scope="module")
def copy16(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8copy") / "tiny-fp8"
    assert write_copy(tiny_checkpoint, out, "--depformer-steps", "16") == 0
    return out


def _ticks(engine: PersonaPlexEngine, pcm: np.ndarray) -> tuple[list, np.ndarray]:
    slots = [engine.open_slot(SessionSpec(voice="NATF2.pt", sampling=SamplingParams(), seed=s)) for s in (7, 8)]
    ticks = [engine.step(slots, pcm[:, f]) for f in range(pcm.shape[1])]
    for slot in slots:
        engine.close_slot(slot)
    return [[o.text_id for o in t] for t in ticks], np.stack([[o.pcm for o in t] for t in ticks])


def test_the_copy_is_the_model_quantized_at_load(tiny_checkpoint, copy16, speech_pcm):
    """Served without any setting, the copy gives the bits of the bf16 checkpoint quantized at
    load: temporal logits, and whole ticks of two sessions with 8 and with 16 depformer steps
    (an engine may run fewer steps than the copy holds)."""
    assert is_fp8_checkpoint(copy16) and not is_fp8_checkpoint(tiny_checkpoint)
    with safe_open(str(copy16 / LM_FILE), framework="pt") as f:
        assert f.metadata()["depformer_steps"] == "16"
        assert f.get_tensor("layers.0.ffn_in").dtype == FP8_DTYPE
        assert f.get_tensor("layers.0.ffn_in_scale").dtype == torch.float32
    assert {p.name for p in copy16.iterdir()} >= {p.name for p in Path(tiny_checkpoint).iterdir()}
    g = torch.Generator().manual_seed(2)
    n = 40
    frames = torch.cat([torch.randint(0, 100, (n, 1), generator=g), torch.randint(0, 50, (n, 16), generator=g)], 1)
    pcm = np.stack([speech_pcm[i * 24000 : i * 24000 + 6 * 1920].reshape(6, 1920) for i in (2, 5)])
    for steps in (8, 16):
        at_load = PersonaPlexEngine.from_files(ckpt.locate(tiny_checkpoint), 2,
                                               EngineOptions(weights="fp8", depformer_steps=steps))
        stored = PersonaPlexEngine.from_files(ckpt.locate(copy16), 2, EngineOptions(depformer_steps=steps))
        assert stored.lm.fp8_matmul == "w8a16" and stored.lm.layers[0].in_proj.dtype == FP8_DTYPE
        assert torch.equal(_tiny_logits(stored, frames), _tiny_logits(at_load, frames))
        want, got = _ticks(at_load, pcm), _ticks(stored, pcm)
        assert want[0] == got[0] and np.array_equal(want[1], got[1])


def test_an_eight_step_copy_refuses_sixteen_steps_and_is_smaller(tiny_checkpoint, copy16, tmp_path):
    out = tmp_path / "eight"
    assert write_copy(tiny_checkpoint, out) == 0
    assert (out / LM_FILE).stat().st_size < (copy16 / LM_FILE).stat().st_size
    with pytest.raises(CheckpointError, match=r"'depformer_in' has shape .* \(it holds 8 depformer steps\)"):
        PersonaPlexEngine.from_files(ckpt.locate(out), 1, EngineOptions(depformer_steps=16))


def test_the_memory_plan_counts_the_smaller_weights(tiny_checkpoint, copy16):
    """The memory plan counts the weights as loaded: an fp8 copy's (and weights quantized at
    load) take fewer bytes than the checkpoint's own, and what they save goes to sessions."""
    from engines.spec import MemorySettings

    memory = MemorySettings(limit_bytes=64 << 20, margin_bytes=0, prefill_cache_bytes=0)
    plans = {}
    for name, files, weights in (("float32", tiny_checkpoint, "auto"), ("copy", copy16, "auto"),
                                 ("at load", tiny_checkpoint, "fp8")):
        engine = PersonaPlexEngine.from_files(ckpt.locate(files), None,
                                              EngineOptions(weights=weights, memory=memory))
        plans[name] = engine.memory_plan
    full = plans["float32"].item("weights").bytes
    for name in ("copy", "at load"):  # (the tiny model's weights are mostly its embeddings and Mimi's)
        assert plans[name].item("weights").bytes < full - (512 << 10), name
        assert plans[name].largest_fit() > plans["float32"].largest_fit(), name


def test_refusals_are_one_line(tiny_checkpoint, copy16, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        write_copy(tiny_checkpoint, copy16)
    assert exit_info.value.code == 2
    assert "exists and is not an empty directory; pass --force" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        write_copy(copy16, tmp_path / "again")
    assert "is already an fp8 copy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        write_copy(tiny_checkpoint, tiny_checkpoint, "--force")
    assert "is the checkpoint itself" in capsys.readouterr().err


def test_a_damaged_copy_is_refused_with_the_tensor_named(copy16, tmp_path):
    """A copy whose fp8 weight was stored in another dtype, or that holds a tensor the model
    does not have, names it instead of loading something else."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in copy16.iterdir():
        if path.is_file() and path.name != LM_FILE:
            (bad / path.name).symlink_to(path)
    (bad / "voices").symlink_to(copy16 / "voices")
    with safe_open(str(copy16 / LM_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    from safetensors.torch import save_file

    tensors["layers.0.out_proj"] = tensors["layers.0.out_proj"].float()
    save_file(tensors, str(bad / LM_FILE), metadata=metadata)
    with pytest.raises(CheckpointError, match="'layers.0.out_proj' is torch.float32, expected torch.float8_e4m3fn"):
        PersonaPlexEngine.from_files(ckpt.locate(bad), 1, EngineOptions())
    tensors["layers.0.out_proj"] = tensors["layers.0.out_proj"].to(FP8_DTYPE)
    tensors["layers.0.extra"] = torch.zeros(2)
    save_file(tensors, str(bad / LM_FILE), metadata=metadata)
    with pytest.raises(CheckpointError, match="tensors this model does not have: \\['layers.0.extra'\\]"):
        PersonaPlexEngine.from_files(ckpt.locate(bad), 1, EngineOptions())


def test_the_weights_format_is_read_from_the_header_alone(tmp_path):
    path = tmp_path / LM_FILE
    header = json.dumps({"__metadata__": {"personaplex_format": "moshi-lm-fp8-v1"}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert is_fp8_checkpoint(tmp_path)
    path.write_bytes(b"\xff" * 16)
    assert not is_fp8_checkpoint(tmp_path)


@pytest.mark.parametrize("how", ["quantized at load", "stored"])
def test_a_real_server_streams_with_fp8_weights(tiny_checkpoint, copy16, how):
    """hypercorn with PERSONAPLEX_WEIGHTS=fp8 on the bf16 checkpoint, or with no setting on
    the fp8 copy: a session streams audio and the log says which weights it serves."""
    settings = {"checkpoint": tiny_checkpoint, "weights": "fp8"} if how != "stored" else {"checkpoint": copy16}
    server = Server(max_sessions=2, silence_grace_s=0, **settings)
    try:
        run(streams(server, 8))
        assert f"({how} in fp8, w8a16 products)" in server.logs()
    finally:
        server.stop()
    server.assert_clean_log()
