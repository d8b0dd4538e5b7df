"""Shared fixtures.  Orchestrator fixtures are prefixed ``orch_``; their helpers live in
``orch_support.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import orch_support
from tests.busy import busy_processes
from tests.orch_support import SPEECH_WAV, Server


def pytest_addoption(parser):
    parser.addoption("--busy-processes", type=int, default=0, metavar="N",
                     help="run N busy-looping processes beside the tests for the whole session: the suite "
                          "must pass on a machine others share (the 2-core CI machine with N=2: "
                          "docs/RELIABILITY.md, \"Tests on a busy machine\")")


@pytest.fixture(scope="session", autouse=True)
def busy_beside_the_tests(request):
    """``--busy-processes N``: N processes that compute for as long as the tests run."""
    with busy_processes(request.config.getoption("--busy-processes")) as hogs:
        yield hogs


# Lines of each server's log a failing test's report shows.
FAILURE_LOG_LINES = 200
# How many servers had started when a test's call began.
_SERVERS_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails with servers of its own gets their logs' last lines in its report:
    a failure seen once in CI (a server that never closed its sessions) is then explained
    by its own run, not by a rerun that passes."""
    report = (yield).get_result()
    if report.when == "setup":
        item.stash[_SERVERS_BEFORE] = len(orch_support.STARTED)
    elif report.when == "call" and report.failed:
        for server in orch_support.STARTED[item.stash.get(_SERVERS_BEFORE, 0):]:
            lines = list(server.log)[-FAILURE_LOG_LINES:]
            report.sections.append((f"server pid {server.proc.pid}: last {len(lines)} log lines", "\n".join(lines)))


@pytest.fixture(scope="session")
def orch_server():
    """The main server: two sessions, silence feeding off (so a session's output depends on
    its own input only), a short first-message timeout for the handshake tests; two front-end
    workers sharing one engine process, so the acceptance, error and lifecycle tests hold
    for the multi-worker layout (the other servers run the one-worker default)."""
    server = Server(max_sessions=2, silence_grace_s=0, first_message_timeout_s=1.0, workers=2)
    yield server
    server.stop()
    server.assert_clean_log()


@pytest.fixture(scope="session")
def orch_tuned_server():
    """A server with small limits: silence after 0.5 s, a 256 KiB outbox, 64 frames of queued
    input, API keys, two frames per audio delta."""
    server = Server(max_sessions=2, silence_grace_s=0.5, max_output_buffer_bytes=256 * 1024,
                    max_pending_input_bytes=64 * 1920 * 4, close_timeout_s=1.0, api_keys="test-key-1,test-key-2",
                    frames_per_delta=2)
    yield server
    server.stop()
    server.assert_clean_log()


# Engine fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint, written once per test session."""
    from engines.checkpoints.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def speech_wav() -> Path:
    return SPEECH_WAV


@pytest.fixture(scope="session")
def speech_pcm(speech_wav):
    """The 40 s real speech sample, 24 kHz mono float32."""
    from engines.audio_io import read_audio

    return read_audio(speech_wav)


# End-to-end driver fixtures (tests/e2e/) ------------------------------------------------------
@pytest.fixture(scope="session")
def e2e_duplex_server():
    """A real server for the load-driver end-to-end tests: two sessions (the lifecycle's
    admission limit and the N=2 load), silence feeding off so a session's output frames are
    exactly its input frames even when a slow machine needs a long drain.  Two front-end
    workers: the driver's contract holds whichever worker takes each socket."""
    server = Server(max_sessions=2, silence_grace_s=0, workers=2)
    yield server
    server.stop()
    server.assert_clean_log()


# Browser page and command-line client fixtures (test_web_page.py, test_client_cli.py) -------
@pytest.fixture(scope="session")
def orch_page_server():
    """A one-session server for the page and the CLI client: a second caller is refused
    (server full), and with silence feeding off the output frames are exactly the input
    frames (the CLI's output length is checked)."""
    server = Server(max_sessions=1, silence_grace_s=0)
    yield server
    server.stop()
    server.assert_clean_log()
