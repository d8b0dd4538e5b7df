"""Start-up as an operator meets it, on loopback with the real server and the tiny model:

- a setting that cannot work is one ERROR line (what, which setting, how to fix) and a
  nonzero exit status, from ``hypercorn orchestrator:app`` and from ``personaplex-serve``;
  a port in use likewise;
- a checkpoint named by Hugging Face repo id comes from the local cache (offline), voices
  from ``PERSONAPLEX_VOICE_DIR`` are listed and spoken with, and once ready the log says
  where the page and the websocket are;
- a voice file that cannot be read keeps the server up with ``/health`` naming it, in one
  log line and no traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from engines.runtime.factory import create_torch_engine
from engines.spec import EngineSpec
from engines.checkpoints.tiny import ensure_tiny_checkpoint
from engines.checkpoints.voices import build_voice_prompt
from tests.hub_support import write_hub_cache
from tests.orch_support import REPO, Client, Server, f32_append, run, speech, speech_frames

HUB_REPO = "nvidia/personaplex-7b-v1"
START_FAILED = 3  # orchestrator/frontend/start_failure.py


def _launch(launcher: str, env: dict[str, str], bind: str = "127.0.0.1:0") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PERSONAPLEX_", "HF_"))}
    clean.update(env, PYTHONPATH=str(REPO))
    command = {"hypercorn": [sys.executable, "-m", "hypercorn", "orchestrator:app"],
               "personaplex-serve": [sys.executable, "-m", "orchestrator.serve"]}[launcher]
    return subprocess.run([*command, "--bind", bind], cwd=REPO, env=clean, capture_output=True, text=True,
                          timeout=120)


def _one_error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    return errors[0]


BAD_SETTINGS = [
    ({"PERSONAPLEX_MAX_SESSIONS": "abc"}, "PERSONAPLEX_MAX_SESSIONS must be int, got 'abc'"),
    ({"PERSONAPLEX_CHECKPOINT": "/nonexistent/ckpt"},
     "PERSONAPLEX_CHECKPOINT='/nonexistent/ckpt' is neither a directory nor a Hugging Face repo id"),
    ({"PERSONAPLEX_VOICE_DIR": "/nonexistent/voices"}, "PERSONAPLEX_VOICE_DIR='/nonexistent/voices' is not a directory"),
    ({"PERSONAPLEX_AUTH": "required"}, "PERSONAPLEX_AUTH=required but no API keys are configured"),
    ({"PERSONAPLEX_WEIGHTS": "int4"}, "PERSONAPLEX_WEIGHTS must be one of auto, fp8, got 'int4'"),
    ({"PERSONAPLEX_DEVICE": "cuda"}, "PERSONAPLEX_DEVICE=cuda but CUDA is not available here"),
    ({"PERSONAPLEX_CHECKPOINT": HUB_REPO, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent/hub"},
     f"PERSONAPLEX_CHECKPOINT='{HUB_REPO}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
    ({"PERSONAPLEX_CPU_THREADS": "-1"}, "PERSONAPLEX_CPU_THREADS must be >= 0, got -1"),
]


@pytest.mark.parametrize("cpu_threads", [1, 0])
def test_an_engine_on_the_cpu_runs_torch_with_the_configured_threads(cpu_threads):
    """PERSONAPLEX_CPU_THREADS reaches the engine's torch (the server's engines are built with
    Settings.engine_spec); 0 leaves torch's own default."""
    script = ("import torch\n"
              "from engines.runtime.factory import build_engine\n"
              "from orchestrator.settings import Settings\n"
              "default = torch.get_num_threads()\n"
              f"build_engine(Settings.from_mapping({{'cpu_threads': {cpu_threads}}}).engine_spec('cpu'))\n"
              "print(default, torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    default, used = map(int, done.stdout.split()[-2:])
    assert used == (cpu_threads or default), done.stdout


@pytest.mark.parametrize("env, message", BAD_SETTINGS, ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_hypercorn_says_a_bad_setting_in_one_line_and_exits_nonzero(env, message):
    if "PERSONAPLEX_DEVICE" in env and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _launch("hypercorn", env)
    # hypercorn's master would report 0 (pgjones/hypercorn#269): the worker ends it with SIGUSR1.
    assert proc.returncode == -signal.SIGUSR1, (proc.returncode, proc.stderr[-3000:])
    line = _one_error_line(proc.stdout + proc.stderr)
    assert "cannot start: " in line and message in line
    assert "Running on" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("env, message", [BAD_SETTINGS[0], BAD_SETTINGS[-2], BAD_SETTINGS[-1]],
                         ids=["in the master", "a checkpoint not in the offline cache", "in a worker"])
def test_personaplex_serve_says_it_in_one_line_and_exits_3(env, message):
    if "PERSONAPLEX_DEVICE" in env and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _launch("personaplex-serve", env)
    assert proc.returncode == START_FAILED, proc.stderr[-3000:]
    assert message in _one_error_line(proc.stdout + proc.stderr)


def test_a_port_in_use_is_one_line_with_personaplex_serve():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ours = _launch("personaplex-serve", {}, bind=f"127.0.0.1:{port}")
        theirs = _launch("hypercorn", {}, bind=f"127.0.0.1:{port}")
    assert ours.returncode == START_FAILED
    line = _one_error_line(ours.stdout + ours.stderr)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line and "--bind" in line
    assert theirs.returncode != 0  # hypercorn's own master binds before any code of ours runs: its traceback


@pytest.fixture(scope="module")
def my_voice_dir(tmp_path_factory) -> tuple:
    """A voice made by the voice builder from real speech, saved under the name a client asks for."""
    engine = create_torch_engine(EngineSpec(max_slots=1, device="cpu"))
    voices = tmp_path_factory.mktemp("my-voices")
    torch.save(build_voice_prompt(engine, speech(3.0, offset_s=3.0)), voices / "ME.pt")
    return voices


def test_repo_id_from_the_cache_voice_dir_and_the_ready_line(my_voice_dir, tmp_path, monkeypatch):
    tiny = ensure_tiny_checkpoint()
    write_hub_cache(tmp_path / "hub", HUB_REPO, {p.name: p for p in tiny.iterdir() if p.is_file()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    server = Server(checkpoint=HUB_REPO, voice_dir=my_voice_dir, max_sessions=2, silence_grace_s=0)
    try:
        status, body = server.get("/v1/voices")
        names = [voice["id"] for voice in body["data"]]
        assert status == 200 and {"ME.pt", "NATF2.pt"} <= set(names), body

        async def scenario() -> None:
            client = await Client.connect(server.ws + "/v1/realtime?duplex=1")
            opened = await client.open(voice="ME.pt", temperature=0)
            assert opened["voice"] == "ME.pt"
            for frame in speech_frames(6):
                await client.send(f32_append(frame))
            await client.wait_audio_frames(6)
            await client.close()

        run(scenario())
        logs = server.logs()
        assert "serving 1 voice(s) from" in logs
        assert f"checkpoint {HUB_REPO}: looking in the local cache only (HF_HUB_OFFLINE)" in logs
        # Served under the repo id it was named by (vLLM's convention), not the engine's name.
        assert [model["id"] for model in server.get("/v1/models")[1]["data"]] == [HUB_REPO]
        # Said once the worker has seen the engine ready (it looks every 0.2 s).
        ready_line = f"talk page http://127.0.0.1:{server.port}/ , websocket ws://127.0.0.1:{server.port}/v1/realtime"
        deadline = time.monotonic() + 10
        while ready_line not in server.logs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready_line in server.logs()
    finally:
        server.stop()
    server.assert_clean_log()


def test_an_unreadable_voice_keeps_the_server_up_and_names_the_file(tmp_path):
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "BROKEN.pt").write_bytes(b"not a voice")
    server = Server(voice_dir=voices, wait_ready=False)
    try:
        health = None
        for _ in range(300):
            status, body = server.get("/health")
            if status == 503 and "BROKEN.pt" in str(body):
                health = body
                break
            time.sleep(0.1)
        assert health is not None, server.logs()[-3000:]
        assert "voice file" in health["reason"] and str(voices / "BROKEN.pt") in health["reason"]
        assert server.get("/ready")[0] == 503
    finally:
        server.stop()
    line = _one_error_line(server.logs())
    assert "engine failed to load" in line and "BROKEN.pt" in line



def test_a_host_that_writes_its_error_and_exits_between_two_looks_is_reported_by_its_error(tmp_path, monkeypatch):
    """The race CI met once: the worker found no layout, then the host wrote its error and
    exited, then the worker saw no host and said only "not running". Here the host's whole
    failure happens inside the worker's look at the lock."""
    import json

    from orchestrator.engine_host import launch
    from orchestrator.ipc.endpoints import layout_path, write_atomic

    def host_fails_meanwhile(run_dir):
        write_atomic(layout_path(run_dir), json.dumps({"host_pid": 1, "engines": [], "error": "the real reason"}))
        return False

    monkeypatch.setattr(launch, "_host_running", host_fails_meanwhile)
    with pytest.raises(launch.HostStartError, match="the real reason"):
        launch._wait_layout(tmp_path)


def test_a_host_that_fails_before_the_worker_sees_it_start_is_reported_by_its_error(tmp_path, monkeypatch):
    """The same race one step earlier: the host took its lock, wrote its error and exited
    before the starting worker's first look at the lock."""
    import json

    from orchestrator.engine_host import launch
    from orchestrator.ipc.endpoints import layout_path, write_atomic
    from orchestrator.settings import Settings

    class FailedAtOnce:
        def __init__(self, *args, **kwargs):
            write_atomic(layout_path(tmp_path), json.dumps({"host_pid": 1, "engines": [], "error": "the real reason"}))
            self.pid, self.returncode = 1, 2

        def poll(self):
            return self.returncode

    monkeypatch.setattr(launch.subprocess, "Popen", FailedAtOnce)
    with pytest.raises(launch.HostStartError, match="the real reason"):
        launch.ensure_host(Settings.from_mapping({}), tmp_path, watch_pid=os.getpid())
