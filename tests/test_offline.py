"""The offline CLI (flag-compatible with the reference's ``moshi.offline``) and the voice builder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.tools import offline, voice_builder
from engines.audio_io import read_audio, write_wav

SECONDS = 4.0


@pytest.fixture(scope="module")
def speech_clip(tmp_path_factory, speech_pcm) -> Path:
    path = tmp_path_factory.mktemp("audio") / "clip.wav"
    write_wav(path, speech_pcm[int(2 * 24000) : int((2 + SECONDS) * 24000)])
    return path


def run_cli(tmp_path, checkpoint, *extra, input_wav):
    out_wav, out_json = tmp_path / "out.wav", tmp_path / "out.json"
    code = offline.main([
        "--checkpoint", str(checkpoint), "--input-wav", str(input_wav),
        "--output-wav", str(out_wav), "--output-text", str(out_json), "--no-progress", *extra,
    ])
    return code, out_wav, out_json


def test_offline_writes_audio_of_input_length_and_per_frame_text(tmp_path, tiny_checkpoint, speech_clip):
    code, out_wav, out_json = run_cli(tmp_path, tiny_checkpoint, "--greedy", input_wav=speech_clip)
    assert code == 0
    pcm = read_audio(out_wav)
    assert pcm.shape[0] == int(SECONDS * 24000)
    assert np.isfinite(pcm).all() and pcm.std() > 1e-3
    labels = json.loads(out_json.read_text())
    assert len(labels) == -(-pcm.shape[0] // 1920)
    assert all(isinstance(x, str) for x in labels)
    assert labels[0] == "PAD"  # the first output is the last prompt frame
    # Greedy runs are reproducible.
    (tmp_path / "again").mkdir()
    again = run_cli(tmp_path / "again", tiny_checkpoint, "--greedy", input_wav=speech_clip)
    assert json.loads(again[2].read_text()) == labels
    assert np.array_equal(read_audio(again[1]), pcm)


def test_fp8_weights_flag(tmp_path, tiny_checkpoint, speech_clip, capsys):
    """``--weights fp8`` loads the quantized model (its greedy audio is not the default's; the
    engine's own numerics are tests/test_fp8_weights.py's) and other values are refused."""
    runs = []
    for weights in ("auto", "fp8"):
        (tmp_path / weights).mkdir()
        code, out_wav, out_json = run_cli(tmp_path / weights, tiny_checkpoint, "--greedy", "--weights", weights,
                                          input_wav=speech_clip)
        assert code == 0
        runs.append(read_audio(out_wav))
    assert runs[1].shape == runs[0].shape and np.isfinite(runs[1]).all() and runs[1].std() > 1e-3
    assert not np.array_equal(runs[0], runs[1])
    with pytest.raises(SystemExit):
        run_cli(tmp_path, tiny_checkpoint, "--weights", "int4", input_wav=speech_clip)
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_other_rates_and_stereo_are_resampled_and_reduced_to_the_first_channel(tmp_path, tiny_checkpoint, speech_pcm):
    import sphn

    clip = speech_pcm[: int(SECONDS * 24000)]
    mono16 = np.asarray(sphn.resample(clip[None], src_sample_rate=24000, dst_sample_rate=16000), np.float32)[0]
    stereo = np.stack([mono16, np.random.default_rng(0).standard_normal(mono16.shape[0]).astype(np.float32) * 0.3])
    sphn.write_wav(str(tmp_path / "stereo16k.wav"), stereo, 16000)
    sphn.write_wav(str(tmp_path / "mono16k.wav"), mono16[None], 16000)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code_s, wav_s, json_s = run_cli(tmp_path / "a", tiny_checkpoint, "--greedy", input_wav=tmp_path / "stereo16k.wav")
    code_m, wav_m, json_m = run_cli(tmp_path / "b", tiny_checkpoint, "--greedy", input_wav=tmp_path / "mono16k.wav")
    assert code_s == code_m == 0
    assert read_audio(wav_s).shape[0] == read_audio(tmp_path / "stereo16k.wav").shape[0]
    assert json.loads(json_s.read_text()) == json.loads(json_m.read_text())


def test_sampling_flags_and_seed(tmp_path, tiny_checkpoint, speech_clip):
    outs = []
    for i, seed in enumerate(("5", "5", "6")):
        d = tmp_path / str(i)
        d.mkdir()
        code, _, out_json = run_cli(d, tiny_checkpoint, "--seed", seed, "--temp-text", "1.0", "--topk-text", "50",
                                    input_wav=speech_clip)
        assert code == 0
        outs.append(json.loads(out_json.read_text()))
    assert outs[0] == outs[1] != outs[2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--voice-prompt", "NOPE.pt"], "unknown voice 'NOPE.pt'"),
        (["--voice-prompt", "../x.pt"], "invalid voice"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--voice-prompt-dir", "/nonexistent"], "not found"),
    ],
)
def test_bad_arguments_give_one_clear_message(tmp_path, tiny_checkpoint, speech_clip, capsys, args, message):
    if message == "CUDA is not available" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, _ = run_cli(tmp_path, tiny_checkpoint, *args, input_wav=speech_clip)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bad_input_files(tmp_path, tiny_checkpoint, capsys):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"RIFF....WAVEfmt nonsense")
    for wav, message in ((tmp_path / "missing.wav", "audio file not found"), (garbage, "cannot decode")):
        code, _, _ = run_cli(tmp_path, tiny_checkpoint, input_wav=wav)
        assert code == 2 and message in capsys.readouterr().err
    code = offline.main(["--checkpoint", str(tmp_path / "nope"), "--input-wav", str(garbage),
                         "--output-wav", str(tmp_path / "o.wav"), "--output-text", str(tmp_path / "nodir" / "o.json")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_cli_process_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "engines.tools.offline", "--checkpoint", str(tmp_path / "missing"),
         "--input-wav", "x.wav", "--output-wav", str(tmp_path / "o.wav"), "--output-text", str(tmp_path / "o.json")],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


# Voice builder -----------------------------------------------------------------------------
def test_voice_builder_writes_the_reference_format(tmp_path, tiny_checkpoint, speech_pcm):
    clip = speech_pcm[24000 : 24000 + 30 * 1920 + 500]  # 31 frames, the last one partial
    write_wav(tmp_path / "me.wav", clip)
    out = tmp_path / "ME.pt"
    assert voice_builder.main(["--checkpoint", str(tiny_checkpoint), "--input-wav", str(tmp_path / "me.wav"),
                               "--output", str(out)]) == 0
    data = torch.load(out, weights_only=True)
    assert data["embeddings"].shape == (30, 1, 1, 64) and data["embeddings"].dtype == torch.bfloat16
    assert data["cache"].shape == (1, 17, 4) and data["cache"].dtype == torch.int64
    # Refuses to overwrite.
    with pytest.raises(SystemExit):
        voice_builder.main(["--checkpoint", str(tiny_checkpoint), "--input-wav", str(tmp_path / "me.wav"), "--output", str(out)])
    # Loudness normalisation makes the recording level irrelevant.
    write_wav(tmp_path / "quiet.wav", clip * 0.05)
    quiet = tmp_path / "QUIET.pt"
    assert voice_builder.main(["--checkpoint", str(tiny_checkpoint), "--input-wav", str(tmp_path / "quiet.wav"),
                               "--output", str(quiet)]) == 0
    q = torch.load(quiet, weights_only=True)
    assert torch.equal(q["cache"], data["cache"])
    assert torch.allclose(q["embeddings"].float(), data["embeddings"].float(), atol=1e-2)
    # The new voice works in the offline CLI from a voice directory.
    (tmp_path / "run").mkdir()
    code, out_wav, _ = run_cli(tmp_path / "run", tiny_checkpoint, "--voice-prompt", "ME.pt",
                               "--voice-prompt-dir", str(tmp_path), input_wav=tmp_path / "me.wav")
    assert code == 0 and read_audio(out_wav).shape[0] == clip.shape[0]


def test_voice_from_wav_directly_in_the_offline_cli(tmp_path, tiny_checkpoint, speech_clip):
    code, out_wav, _ = run_cli(tmp_path, tiny_checkpoint, "--voice-prompt", str(speech_clip), input_wav=speech_clip)
    assert code == 0 and read_audio(out_wav).shape[0] == int(SECONDS * 24000)


def test_silent_voice_is_refused(tmp_path, tiny_checkpoint, capsys):
    write_wav(tmp_path / "silence.wav", np.zeros(24000, np.float32))
    assert voice_builder.main(["--checkpoint", str(tiny_checkpoint), "--input-wav", str(tmp_path / "silence.wav"),
                               "--output", str(tmp_path / "S.pt")]) == 2
    assert "silent" in capsys.readouterr().err
