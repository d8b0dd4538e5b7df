"""``python -m orchestrator.client`` against a real server: the happy path (output WAV length
and format, transcript, live latency lines) and every error path ending in one clear
``error:`` line with exit status 2 and no traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from engines.audio_io import read_audio, write_wav
from orchestrator.client.cli import main, normalize_url
from tests.orch_support import FRAME, REPO, Server


@pytest.fixture(scope="module")
def question_wav(speech_wav, tmp_path_factory) -> Path:
    """1.5 s of real speech (at 16 kHz, so the client's resampling is exercised)."""
    pcm = read_audio(speech_wav, sample_rate=16000)[int(3.2 * 16000):int(4.7 * 16000)]
    path = tmp_path_factory.mktemp("cli") / "question.wav"
    write_wav(path, pcm, 16000)
    return path


def frames_for(path: Path, tail_s: float) -> int:
    """Input frames the client sends for ``path``: the speech rounded up, plus the tail."""
    samples = len(read_audio(path))
    return -(-samples // FRAME) + round(tail_s / 0.08)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_streams_a_file_and_writes_audio_and_transcript(orch_page_server: Server, question_wav, tmp_path):
    """The module entry point, as a user runs it (--fast): the output WAV is PCM16 mono 24 kHz
    with exactly one 80 ms frame per input frame; the transcript holds the model's text."""
    orch_page_server.wait_free_slots(1)
    out_wav, out_txt = tmp_path / "answer.wav", tmp_path / "answer.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.client", "--url", orch_page_server.ws, "--input-wav", str(question_wav),
         "--output-wav", str(out_wav), "--transcript", str(out_txt), "--voice", "VARF0.pt", "--persona",
         "You are a calm and precise assistant.", "--seed", "7", "--tail-s", "0.4", "--fast", "--window", "8"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with wave.open(str(out_wav)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.getnframes() == frames_for(question_wav, 0.4) * FRAME
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert np.abs(pcm).max() > 0
    text = out_txt.read_text()
    assert text.endswith("\n") and text.strip(), text
    assert "received" in proc.stderr and "latency median" in proc.stderr and f"wrote {out_wav}" in proc.stderr
    assert proc.stdout == ""  # the transcript went to the file


def test_realtime_pacing_prints_transcript_to_stdout(orch_page_server: Server, question_wav, capsys):
    """--realtime (the default) sends one frame per 80 ms; without --transcript the text is
    printed to stdout at the end."""
    orch_page_server.wait_free_slots(1)
    frames = frames_for(question_wav, 0.0)
    started = time.monotonic()
    code, out, err = run_main(capsys, "--url", orch_page_server.http, "--input-wav", str(question_wav),
                              "--tail-s", "0", "--seed", "3")
    assert code == 0, err
    assert time.monotonic() - started >= (frames - 1) * 0.08
    assert f"sent {frames} frames, received {frames}" in err and "latency" in err
    assert out.strip()  # the transcript


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1/v1/realtime", "--url must be a ws:// or wss:// URL"),
    ("not a url", "--url must be a ws:// or wss:// URL"),
    ("ws://127.0.0.1:99999", "--url has an invalid port"),
])
def test_bad_url(url, message, question_wav, capsys):
    code, _, err = run_main(capsys, "--url", url, "--input-wav", str(question_wav))
    assert code == 2 and f"error: {message}" in err


def test_normalize_url():
    assert normalize_url("ws://h:1") == "ws://h:1/v1/realtime?duplex=1"
    assert normalize_url("https://h/") == "wss://h/v1/realtime?duplex=1"
    assert normalize_url("wss://h/v1/duplex") == "wss://h/v1/duplex"
    assert normalize_url("ws://h:1/v1/realtime?model=m") == "ws://h:1/v1/realtime?model=m"


def test_refused_connection(question_wav, capsys):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, err = run_main(capsys, "--url", f"ws://127.0.0.1:{port}", "--input-wav", str(question_wav))
    assert code == 2 and f"error: cannot connect to ws://127.0.0.1:{port}/v1/realtime?duplex=1" in err
    assert "is the server running" in err


def test_bad_wav(tmp_path, capsys):
    garbage = tmp_path / "garbage.wav"
    garbage.write_text("this is not audio")
    code, _, err = run_main(capsys, "--input-wav", str(garbage))
    assert code == 2 and "error: cannot decode audio file" in err
    code, _, err = run_main(capsys, "--input-wav", str(tmp_path / "missing.wav"))
    assert code == 2 and "error: audio file not found" in err


def test_bad_arguments(question_wav, tmp_path, capsys):
    code, _, err = run_main(capsys, "--input-wav", str(question_wav), "--output-wav", str(tmp_path / "no" / "a.wav"))
    assert code == 2 and "error: --output-wav: cannot write to" in err
    code, _, err = run_main(capsys, "--input-wav", str(question_wav), "--tail-s", "-1")
    assert code == 2 and "error: --tail-s" in err
    with pytest.raises(SystemExit) as exit_info:  # argparse: neither --input-wav nor --mic
        main([])
    assert exit_info.value.code == 2 and "one of the arguments --input-wav --mic is required" in capsys.readouterr().err


def test_server_errors(orch_page_server: Server, question_wav, tmp_path, capsys):
    """A refused session (an unknown voice; the server full) is the server's code and message;
    no output file is written for a session that never opened."""
    orch_page_server.wait_free_slots(1)
    out_wav = tmp_path / "never.wav"
    code, _, err = run_main(capsys, "--url", orch_page_server.ws, "--input-wav", str(question_wav),
                            "--voice", "NOBODY.pt", "--output-wav", str(out_wav))
    assert code == 2 and "error: the server refused the session: invalid_voice" in err and not out_wav.exists()

    from websockets.sync.client import connect

    with connect(orch_page_server.ws + "/v1/realtime?duplex=1", proxy=None) as holder:
        holder.send(json.dumps({"type": "session.update", "session": {}}))
        while json.loads(holder.recv(timeout=30))["type"] != "session.created":
            pass
        code, _, err = run_main(capsys, "--url", orch_page_server.ws, "--input-wav", str(question_wav))
        holder.send(json.dumps({"type": "session.close"}))
    assert code == 2 and "error: the server refused the session: resource_exhausted (rate_limit_error)" in err
    orch_page_server.wait_free_slots(1)


def test_api_key_refusal(orch_tuned_server: Server, question_wav, capsys):
    """A server that requires keys: a wrong key is the HTTP status in one line."""
    code, _, err = run_main(capsys, "--url", orch_tuned_server.ws, "--input-wav", str(question_wav),
                            "--api-key", "wrong-key")
    assert code == 2 and "refused the websocket: HTTP 401" in err


def test_refused_frames_are_reported_and_not_awaited(orch_tuned_server: Server, speech_wav, tmp_path, capsys):
    """Errors during the stream: --fast with a window far above the server's input limit
    (64 queued frames) gets input_backpressure for some appends.  Each is reported, the
    refused frames are not waited for, the audio of the others is written, and the exit
    status is 2."""
    orch_tuned_server.wait_free_slots(2)
    long_wav = tmp_path / "long.wav"
    write_wav(long_wav, read_audio(speech_wav)[3 * 24000:int(8.6 * 24000)])  # 70 frames
    out_wav = tmp_path / "partial.wav"
    code, _, err = run_main(capsys, "--url", orch_tuned_server.ws, "--api-key", "test-key-1", "--input-wav",
                            str(long_wav), "--output-wav", str(out_wav), "--fast", "--window", "1000",
                            "--tail-s", "0", "--timeout-s", "20")
    assert code == 2, err
    assert "server error: input_backpressure" in err and "error: the server reported" in err
    with wave.open(str(out_wav)) as wav:
        answered = wav.getnframes() // FRAME
    refused = err.count("server error: input_backpressure")
    assert 0 < answered and answered + refused >= 70  # silence feeding may add frames, never lose one


def test_microphone_needs_sounddevice(capsys):
    """--mic without the optional package: the guarded import's message, not a traceback."""
    try:
        import sounddevice  # noqa: F401
    except (ImportError, OSError):
        code, _, err = run_main(capsys, "--mic")
        assert code == 2 and "error: the microphone needs the 'sounddevice' package" in err
    else:
        pytest.skip("sounddevice is installed; the guarded import path cannot be shown here")
