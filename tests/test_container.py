"""The container image, built and run for real: the Dockerfile on a base made here from Debian's
packages (no image registry is reachable: ``debootstrap`` plus Debian's python3, passed as
``BASE_IMAGE``), torch from this machine's CPU wheel, the rest from the package index; then the
image runs with ``--network host`` on loopback: ``--help`` is the server's own, ``/ready`` says
ready, a client session streams speech and gets audio back, the server runs as the image's
non-root user, and ``docker stop`` drains it and ends it with status 0.

Needs a Docker engine (``dockerd``) and ``debootstrap``: ``.ci/run`` installs and starts both,
and builds the image in the background while the rest of the suite runs
(``tests/container_image.py``); run alone, the test builds it.
Without them the test skips, saying so; with ``PERSONAPLEX_TEST_CONTAINER=require`` (CI) it
fails instead.  It costs minutes (docs/DEPLOYMENT.md, "The container image", has the figure).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests import container_image
from tests.orch_support import Client, answers_ready, f32_append, free_port, run, speech_frames

REQUIRED = os.environ.get("PERSONAPLEX_TEST_CONTAINER") == "require"


def _unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (dockerd)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap"
    if container_image.torch_wheel() is None:
        return "no torch wheel to bring into the image (/opt/wheels or PERSONAPLEX_TEST_TORCH_WHEEL)"
    return None


def _docker(*args: str, timeout: float = 1200, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return container_image.docker(*args, timeout=timeout, check=check)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """The image: the one ``.ci/run`` builds in the background while the suite runs (waited
    for here), or built now."""
    why = _unavailable()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"PERSONAPLEX_TEST_CONTAINER=require but {why}")
        pytest.skip(why)
    prebuilt = os.environ.get(container_image.PREBUILT)
    tag = prebuilt or f"personaplex-test-{uuid.uuid4().hex[:8]}"
    try:
        if prebuilt:
            try:
                container_image.wait_for(tag, Path(os.environ[container_image.PREBUILT_DIR]))
            except RuntimeError as exc:
                raise AssertionError(str(exc)) from None
        else:
            container_image.build(tag, tmp_path_factory.mktemp("container"))
        yield tag
    finally:
        container_image.remove(tag)


def test_the_image_explains_itself(image: str):
    """``docker run IMAGE --help``: the server's own help, every setting in it."""
    done = _docker("run", "--rm", "--network", "none", image, "--help", timeout=120)
    assert done.stdout.startswith("usage: personaplex-serve"), done.stdout[:500]
    assert "--checkpoint / PERSONAPLEX_CHECKPOINT" in done.stdout and "PERSONAPLEX_MAX_SESSIONS" in done.stdout


def test_the_image_serves_a_session_as_a_non_root_user_and_drains_on_stop(image: str):
    port = free_port()
    name = f"{image}-run"
    _docker("run", "-d", "--network", "host", "--name", name, "-e", "PERSONAPLEX_MAX_SESSIONS=2",
            "-e", "PERSONAPLEX_CPU_THREADS=1", image, "--bind", f"127.0.0.1:{port}", "--workers", "2",
            "--graceful-timeout", "5")
    try:
        deadline = time.monotonic() + 300
        while not answers_ready(f"http://127.0.0.1:{port}"):
            state = _docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                done = _docker("logs", name, check=False)
                raise AssertionError(f"not ready (running: {state}):\n{(done.stdout + done.stderr)[-4000:]}")
            time.sleep(0.5)

        async def session() -> None:
            client = await Client.connect(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
            await client.open(temperature=0)
            for frame in speech_frames(8):
                await client.send(f32_append(frame))
            pcm = await client.wait_audio_frames(8, timeout=120)
            assert len(pcm) >= 8 * 1920
            await client.close()

        run(session())
        # The server's processes run as the image's user, not root.
        users = _docker("exec", "--user", "root", name, "sh", "-c",
                        "for p in /proc/[0-9]*; do [ $p = /proc/$$ ] || stat -c %U $p; done").stdout.split()
        assert users and set(users) == {"personaplex"}, users
        started = time.monotonic()
        _docker("stop", "-t", "30", name)
        assert time.monotonic() - started < 30  # drained and ended, not killed at the timeout
        assert _docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() == "0"
        done = _docker("logs", name)
        logs = done.stdout + done.stderr
        assert "draining" in logs and "Traceback" not in logs, logs[-4000:]
    finally:
        _docker("rm", "-f", name, check=False)
