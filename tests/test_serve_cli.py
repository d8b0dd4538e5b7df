"""``personaplex-serve`` explains itself: ``--help`` lists every setting (flag, environment
variable, default, one line), the settings are flags too (the environment wins where both are
set), and hypercorn's own options stay reachable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from orchestrator.serve import apply_setting_flags
from orchestrator.settings import Settings, SettingsError, env_name
from orchestrator.settings_help import FLAGLESS, GROUPS, flag_name, setting_flags
from tests.orch_support import REPO, Server


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSONAPLEX_")}
    return subprocess.run([sys.executable, "-m", "orchestrator.serve", *args], cwd=REPO,
                          env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)


def test_every_setting_has_one_line_of_help():
    named = [name for _, entries in GROUPS for name, _ in entries]
    assert sorted(named) == sorted(f.name for f in fields(Settings))  # each once, none unknown
    assert all(text and "\n" not in text for _, entries in GROUPS for _, text in entries)


def test_help_lists_every_setting_and_is_ours():
    done = _serve("--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("usage: personaplex-serve")
    for f in fields(Settings):
        assert env_name(f.name) in text, f.name
        if f.name not in FLAGLESS:
            assert f"{flag_name(f.name)} / {env_name(f.name)}" in text
    assert "--max-sessions / PERSONAPLEX_MAX_SESSIONS (default auto)" in text
    assert "--memory-margin-gb / PERSONAPLEX_MEMORY_MARGIN_GB (default 1.0)" in text
    assert max(len(line) for line in text.splitlines()) <= 110
    hypercorn = _serve("--help-hypercorn")
    assert hypercorn.returncode == 0 and "--keyfile" in hypercorn.stdout and "--graceful-timeout" in hypercorn.stdout


def test_setting_flags_go_to_the_environment_and_the_environment_wins():
    environ = {"PERSONAPLEX_MODEL_NAME": "from-env"}
    rest = apply_setting_flags(["orchestrator:app", "--max-sessions", "3", "--workers", "2", "--model-name=flag",
                                "--checkpoint=/models/x", "--bind", "0.0.0.0:8000"], environ)
    assert rest == ["orchestrator:app", "--workers", "2", "--bind", "0.0.0.0:8000"]  # hypercorn's own stay
    assert environ == {"PERSONAPLEX_MODEL_NAME": "from-env", "PERSONAPLEX_MAX_SESSIONS": "3",
                       "PERSONAPLEX_CHECKPOINT": "/models/x"}
    with pytest.raises(SettingsError, match="--max-sessions needs a value"):
        apply_setting_flags(["--max-sessions"], {})
    assert "--bind" not in setting_flags()  # hypercorn's: it makes the sockets


def test_a_bad_flag_value_is_one_line_and_exit_3():
    done = _serve("--max-sessions", "lots", "--bind", "127.0.0.1:0")
    assert done.returncode == 3
    errors = [line for line in (done.stdout + done.stderr).splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "PERSONAPLEX_MAX_SESSIONS must be int, got 'lots'" in errors[0], done.stderr


def test_flags_reach_the_server():
    """A real server started with flags: its admission and model id are the flags'; a variable
    set in the environment beside a flag wins."""
    server = Server(launcher="personaplex", cli=["--max-sessions", "3", "--model-name", "flagged",
                                                 "--silence-grace-s", "0"], max_sessions=2, workers=2)
    try:
        assert server.get("/ready")[1]["max_sessions"] == 2  # PERSONAPLEX_MAX_SESSIONS=2 wins over the flag
        assert [model["id"] for model in server.get("/v1/models")[1]["data"]] == ["flagged"]
        # The master started the engine host (before its workers), and one worker speaks for the server.
        hosts = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if "orchestrator.engine_host host" in _cmdline(pid)
                 and _cmdline(pid).split()[-2:] == ["--watch-pid", str(server.proc.pid)]]
        assert len(hosts) == 1, hosts
        parent = next(line for line in Path(f"/proc/{hosts[0]}/status").read_text().splitlines()
                      if line.startswith("PPid:"))
        assert int(parent.split()[1]) == server.proc.pid
        deadline = time.monotonic() + 30  # the speaker announces once it has seen the engine ready
        while " ready: 2 session(s)" not in server.logs() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # room for a second announcement, were there two speakers
    finally:
        server.stop()
    assert "PERSONAPLEX_MAX_SESSIONS='2' from the environment wins over --max-sessions '3'" in server.logs()
    assert len([line for line in server.logs().splitlines() if " ready: 2 session(s)" in line]) == 1


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
