"""Checkpoints by Hugging Face repo id (engines/checkpoints/hub.py), with the real ``huggingface_hub``
client against a local cache in the standard layout and a Hub stand-in on loopback: only
the needed files, revisions, offline mode, the gated / forbidden / missing messages,
``voices.tgz`` unpacked once, and the tools' ``--hf-repo``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.audio_io import write_wav
from engines.errors import CheckpointError
from engines.checkpoints.hub import RepoRef, local_checkpoint, parse_repo_ref, resolve_checkpoint
from engines.checkpoints.tiny import ensure_tiny_checkpoint
from tests.hub_support import COMMIT, FakeHub, write_hub_cache

REPO = "nvidia/personaplex-7b-v1"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_files() -> dict[str, Path]:
    """The tiny checkpoint's files by name, plus what a real repository also holds and a
    checkpoint does not need (the web client, a README)."""
    tiny = ensure_tiny_checkpoint()
    files = {p.name: p for p in tiny.iterdir() if p.is_file()}
    assert {"config.json", "voices.tgz", "mimi_config.json"} <= set(files)
    extra = tiny.parent / "hub-extra"
    extra.mkdir(exist_ok=True)
    (extra / "dist.tgz").write_bytes(b"web client" * 1000)
    files.update({"dist.tgz": extra / "dist.tgz"})
    return files


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import (engines/checkpoints/hub.py reads it at each
    # call): a test that went offline must not leave the library offline for the next.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved token from the machine
    return tmp_path / "hub-cache"


def test_repo_references_are_told_from_paths(tmp_path: Path):
    assert parse_repo_ref(REPO) == RepoRef(REPO)
    assert parse_repo_ref(f"{REPO}@v1.0") == RepoRef(REPO, "v1.0")
    assert parse_repo_ref(f"{REPO}@{COMMIT}") == RepoRef(REPO, COMMIT)
    for not_a_repo in ("/abs/path", "plain", "a/b/c", "../x/y", "owner/", "random:personaplex-7b"):
        assert parse_repo_ref(not_a_repo) is None, not_a_repo
    local = tmp_path / "owner" / "name"
    local.mkdir(parents=True)
    assert parse_repo_ref(str(local.relative_to(tmp_path))) is not None  # relative to the test's cwd: not here
    assert resolve_checkpoint(local) == local  # an existing directory is used as it is
    with pytest.raises(CheckpointError, match="neither a directory nor a Hugging Face repo id"):
        resolve_checkpoint(str(tmp_path / "missing"))


def test_offline_from_the_standard_cache_with_voices_unpacked_once(hub_env: Path, tiny_files, monkeypatch):
    snapshot = write_hub_cache(hub_env, REPO, tiny_files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_checkpoint(REPO, cache_dir=hub_env)
    assert resolved == snapshot
    voices = sorted(p.name for p in (snapshot / "voices").iterdir())
    assert voices == ["NATF2.pt", "NATM1.pt", "VARF0.pt"]
    unpacked_at = (snapshot / "voices").stat().st_mtime_ns
    assert resolve_checkpoint(REPO, cache_dir=hub_env) == snapshot
    assert (snapshot / "voices").stat().st_mtime_ns == unpacked_at  # once

    from engines.runtime.factory import create_engine

    engine = create_engine(str(resolved), max_slots=1, device="cpu")
    assert engine.voices() == voices


def test_a_revision_pins_its_snapshot(hub_env: Path, tiny_files, monkeypatch):
    old = "1111111111111111111111111111111111111111"
    write_hub_cache(hub_env, REPO, tiny_files)  # main -> COMMIT
    pinned = write_hub_cache(hub_env, REPO, {k: v for k, v in tiny_files.items() if k != "voices.tgz"},
                             commit=old, revision="v0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_checkpoint(f"{REPO}@{old}", cache_dir=hub_env) == pinned
    assert resolve_checkpoint(f"{REPO}@v0", cache_dir=hub_env) == pinned
    assert not (pinned / "voices").exists()  # that snapshot has no voices.tgz
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_checkpoint(f"{REPO}@v9", cache_dir=hub_env)


def test_offline_without_the_checkpoint_says_what_to_do(hub_env: Path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(REPO, cache_dir=hub_env)
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and str(hub_env) in message
    assert "with network access" in message


def test_download_takes_only_the_files_a_checkpoint_needs(hub_env: Path, tiny_files, monkeypatch):
    hub = FakeHub(REPO, tiny_files)
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        snapshot = resolve_checkpoint(f"{REPO}@main", cache_dir=hub_env)
    finally:
        hub.close()
    needed = {"config.json", "mimi_config.json", "model.safetensors", "voices.tgz",
              "tokenizer_spm_32k_3.model", "tokenizer-e351c8d8-checkpoint125.safetensors"}
    assert needed <= set(tiny_files)
    assert set(hub.sent) == needed  # not the web client, not the README
    assert not (snapshot / "dist.tgz").exists() and (snapshot / "voices" / "NATF2.pt").is_file()
    for name in needed:
        assert (snapshot / name).read_bytes() == tiny_files[name].read_bytes()


@pytest.mark.parametrize("mode, token, expected", [
    ("gated", None, "is gated: accept its licence at http://127.0.0.1:.*/nvidia/personaplex-7b-v1 .*HF_TOKEN is not set"),
    ("gated", "hf_test", "is gated: .*HF_TOKEN is set but has no access"),
    ("forbidden", "hf_test", "access denied \\(403\\).*has not accepted the licence"),
    ("missing", None, "was not found at http://127.0.0.1.*check the name"),
])
def test_refusals_say_how_to_get_access(hub_env: Path, tiny_files, monkeypatch, mode, token, expected):
    hub = FakeHub(REPO, tiny_files, mode=mode)
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(CheckpointError, match=expected):
            resolve_checkpoint(REPO, cache_dir=hub_env)
    finally:
        hub.close()
    assert hub.sent == []


def test_the_tools_take_hf_repo(hub_env: Path, tiny_files, tmp_path: Path):
    """The offline CLI and the voice builder, run as a user would, from the local cache."""
    write_hub_cache(hub_env, REPO, tiny_files)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_env), "PYTHONPATH": str(ROOT),
           "HF_HOME": str(tmp_path / "hf-home")}
    wav = tmp_path / "in.wav"
    write_wav(wav, (0.1 * np.sin(np.arange(24000) / 20)).astype(np.float32), 24000)
    offline = subprocess.run([sys.executable, "-m", "engines.tools.offline", "--hf-repo", REPO, "--input-wav", str(wav),
                              "--output-wav", str(tmp_path / "out.wav"), "--output-text", str(tmp_path / "out.json"),
                              "--greedy", "--no-progress", "--device", "cpu"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert len(json.loads((tmp_path / "out.json").read_text())) == 13  # 1 s = 12.5 frames, rounded up
    voice = tmp_path / "voices" / "ME.pt"
    builder = subprocess.run([sys.executable, "-m", "engines.tools.voice_builder", "--hf-repo", REPO, "--input-wav",
                              str(wav), "--output", str(voice)], env=env, capture_output=True, text=True, timeout=300)
    assert builder.returncode == 0, builder.stderr[-2000:]
    assert voice.is_file() and "PERSONAPLEX_VOICE_DIR" in builder.stderr
    refused = subprocess.run([sys.executable, "-m", "engines.tools.offline", "--hf-repo", "nvidia/absent", "--input-wav",
                              str(wav), "--output-wav", str(tmp_path / "o.wav"), "--output-text", str(tmp_path / "o.json"),
                              "--device", "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("error: nvidia/absent")
    offload = subprocess.run([sys.executable, "-m", "engines.tools.offline", "--cpu-offload", "--input-wav", str(wav),
                              "--output-wav", str(tmp_path / "o.wav"), "--output-text", str(tmp_path / "o.json")],
                             env=env, capture_output=True, text=True, timeout=300)
    assert offload.returncode == 2 and "--cpu-offload is not supported" in offload.stderr


def test_the_offline_start_check_finds_the_lm_file_config_json_names(hub_env: Path, tmp_path: Path, monkeypatch):
    """``local_checkpoint`` (the check before start-up with HF_HUB_OFFLINE) looks for the LM
    file that config.json names, not only the default name."""
    from huggingface_hub import constants

    from orchestrator.settings import Settings, SettingsError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_env))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"moshi_name": "lm-bf16.safetensors"}))
    weights = tmp_path / "lm-bf16.safetensors"
    weights.write_bytes(b"weights")
    snapshot = write_hub_cache(hub_env, REPO, {"config.json": config, "lm-bf16.safetensors": weights})
    assert local_checkpoint(REPO) == snapshot
    Settings(checkpoint=REPO).check_checkpoint_available()  # no error: it is there
    other = "nvidia/other-model"
    write_hub_cache(hub_env, other, {"config.json": config})  # names a file the cache lacks
    assert local_checkpoint(other) is None
    with pytest.raises(SettingsError, match="is not in the local Hugging Face cache"):
        Settings(checkpoint=other).check_checkpoint_available()
