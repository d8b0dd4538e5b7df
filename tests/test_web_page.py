"""The browser page served at ``/``, driven in real headless Chromium against a real server.

Chromium's fake microphone plays real speech from a WAV (``--use-file-for-fake-audio-capture``:
24 kHz mono PCM16 works as is; we write a copy that starts where the speech starts), the page
streams it over the websocket, and the test reads what a user sees: status, transcript and
the stats panel (its raw numbers are in ``data-value``; ``window.personaplexStats`` holds the
same).  The page screenshot is saved to ``$PERSONAPLEX_TEST_ARTIFACTS/web-page.png`` (default:
pytest's temporary directory; the path is logged).

Needs Chromium (Debian ``chromium``; ``$PERSONAPLEX_CHROMIUM`` names another binary) and the
``playwright`` Python package (the ``test`` extra); without them these tests skip.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
import subprocess
import threading
import wave
from pathlib import Path

import numpy as np
import pytest

from engines.audio_io import read_audio
from tests.orch_support import Server

log = logging.getLogger(__name__)

BASE_ARGS = [
    "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--use-fake-device-for-media-stream",
]
SPEECH_START_S = 3.0  # the shared sample is silent before ~3.2 s
LIVE_TIMEOUT_MS = 60_000  # a loaded 2-core machine steps the tiny model slower than real time


def chromium_path() -> str | None:
    named = os.environ.get("PERSONAPLEX_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def playwright():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                   "(pip install -e '.[test]')")
    if chromium_path() is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set PERSONAPLEX_CHROMIUM)")
    with sync_api.sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def fake_mic_wav(speech_wav, tmp_path_factory) -> Path:
    """6 s of the shared speech as 24 kHz mono PCM16 (Chromium loops it)."""
    pcm = read_audio(speech_wav)[int(SPEECH_START_S * 24000):int((SPEECH_START_S + 6) * 24000)]
    path = tmp_path_factory.mktemp("fake-mic") / "speech.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        out.writeframes(np.clip(np.rint(pcm * 32767), -32768, 32767).astype("<i2").tobytes())
    return path


def launch(playwright, *extra: str):
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=BASE_ARGS + list(extra))


@pytest.fixture(scope="module")
def browser(playwright, fake_mic_wav):
    """Chromium with the microphone allowed and fed from the speech WAV."""
    browser = launch(playwright, "--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={fake_mic_wav}",
                     "--ignore-certificate-errors")  # the TLS test's certificate is self-signed
    yield browser
    browser.close()


@pytest.fixture()
def page(browser, orch_page_server: Server):
    orch_page_server.wait_free_slots(1)
    page = browser.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.goto(orch_page_server.http + "/")
    page.wait_for_selector("#connect:enabled", timeout=20_000)
    yield page
    page.close()
    assert not problems, problems


def artifact_path(tmp_path_factory, name: str) -> Path:
    root = os.environ.get("PERSONAPLEX_TEST_ARTIFACTS")
    folder = Path(root) if root else tmp_path_factory.getbasetemp() / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def stat(page, name: str) -> float | None:
    value = page.get_attribute(f"#stat-{name}", "data-value")
    return float(value) if value else None


def wait_stats(page, condition: str, timeout: float = LIVE_TIMEOUT_MS) -> None:
    page.wait_for_function(f"() => {{ const s = window.personaplexStats; return {condition}; }}", timeout=timeout)


def test_voices_endpoint_and_static_files(orch_page_server: Server):
    status, body = orch_page_server.get("/v1/voices")
    assert status == 200
    ids = [voice["id"] for voice in body["data"]]
    assert ids == sorted(ids) and "NATF2.pt" in ids and all(i.endswith(".pt") for i in ids)
    assert [v["id"] for v in body["data"] if v["default"]] == [body["default_voice"]] == ["NATF2.pt"]
    assert body["default_persona"] in body["personas"]
    assert body["max_sessions"] == 1 and body["demo"] is True and body["model"]

    status, html = orch_page_server.get("/")
    assert status == 200 and "<title>PersonaPlex" in html and "/static/app.js" in html
    for name in ("app.js", "audio.js", "realtime.js", "worklets.js", "resampler.js", "style.css"):
        status, _ = orch_page_server.get(f"/static/{name}")
        assert status == 200, name
    assert orch_page_server.get("/static/%2e%2e/web.py")[0] == 404
    assert orch_page_server.get("/static/nothing.js")[0] == 404
    # Names the file system cannot take (too long, a NUL, a directory) are 404s too, not 500s.
    for name in ("a" * 300, "a/" * 200 + "x.js", "%00.js", "x%00/../app.js", "", "."):
        assert orch_page_server.get(f"/static/{name}")[0] == 404, name


def test_page_talks_to_the_model(page, orch_page_server: Server, tmp_path_factory):
    """Speak through the fake microphone: audio deltas come back and are played, the
    transcript fills, the stats move; cancel starts a fresh reply; disconnect frees the slot."""
    assert page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)") == \
        [v["id"] for v in orch_page_server.get("/v1/voices")[1]["data"]]
    page.select_option("#voice", "NATM1.pt")
    page.select_option("#persona-preset", "1")
    assert page.input_value("#persona") == "You are a concise and helpful assistant."

    page.click("#connect")
    page.wait_for_selector("#status[data-state=live]", timeout=30_000)
    assert "NATM1.pt" in page.inner_text("#status")
    assert orch_page_server.get("/ready")[1]["live_sessions"] == 1

    # Audio flows both ways: speech reaches the server, deltas come back and are played.
    wait_stats(page, "s.micRms > 0.01")
    wait_stats(page, "s.deltas >= 6 && s.playedMs > 0 && s.rttMs !== null && s.bufferMs !== null")
    page.wait_for_function("document.querySelector('#transcript').textContent.trim().length > 0",
                           timeout=LIVE_TIMEOUT_MS)
    page.wait_for_timeout(300)  # one more render of the stats panel (every 250 ms)
    assert stat(page, "deltas") >= 6 and stat(page, "played") > 0 and stat(page, "sent") >= 6
    assert stat(page, "rtt") > 0 and stat(page, "buffer") >= 0 and stat(page, "underruns") >= 0
    assert stat(page, "mic") is not None and stat(page, "tick") > 0
    assert "ms" in page.inner_text("#stat-rtt") and page.is_hidden("#notice")

    # Cancel: the reply is cut and a new epoch's audio follows.
    before = page.evaluate("window.personaplexStats.deltas")
    page.click("#cancel")
    assert "reply cancelled" in page.inner_text("#transcript")
    wait_stats(page, f"s.deltas >= {before + 3}")

    shot = artifact_path(tmp_path_factory, "web-page.png")
    page.screenshot(path=str(shot), full_page=True)
    log.warning("page screenshot saved to %s", shot)
    assert shot.stat().st_size > 10_000

    page.click("#disconnect")
    page.wait_for_selector("#status[data-state=idle]", timeout=20_000)
    assert "client_close" in page.inner_text("#status")
    assert page.is_enabled("#connect") and page.is_hidden("#notice")
    orch_page_server.wait_free_slots(1)


def test_page_says_when_the_server_is_full(page, orch_page_server: Server):
    """With the only slot taken, Connect shows the refusal (resource_exhausted) in words."""
    from websockets.sync.client import connect

    with connect(orch_page_server.ws + "/v1/realtime?duplex=1", proxy=None) as holder:
        holder.send(json.dumps({"type": "session.update", "session": {}}))
        while json.loads(holder.recv(timeout=30))["type"] != "session.created":
            pass
        page.click("#connect")
        page.wait_for_selector("#notice:not([hidden])", timeout=30_000)
        notice = page.inner_text("#notice")
        assert "server is full" in notice and "resource_exhausted" in notice, notice
        page.wait_for_selector("#status[data-state=idle]", timeout=10_000)
        assert page.is_enabled("#connect")
        holder.send(json.dumps({"type": "session.close"}))
    orch_page_server.wait_free_slots(1)


def test_page_says_when_the_microphone_is_denied(playwright, orch_page_server: Server):
    """Without the fake permission UI, headless Chromium denies the microphone: the page
    explains it and never opens a session."""
    denied = launch(playwright)
    try:
        page = denied.new_page()
        page.goto(orch_page_server.http + "/")
        page.wait_for_selector("#connect:enabled", timeout=20_000)
        page.click("#connect")
        page.wait_for_selector("#notice:not([hidden])", timeout=10_000)
        assert "Microphone access was denied" in page.inner_text("#notice")
        assert page.is_enabled("#connect")
        assert orch_page_server.get("/ready")[1]["live_sessions"] == 0
    finally:
        denied.close()


def test_page_resampler_is_band_limited(page):
    """The worklets' resampler: 48 kHz -> 24 kHz keeps a 1 kHz tone (level and phase) and
    removes a 15 kHz one instead of folding it to 9 kHz; 24 -> 44.1 kHz keeps the tone too;
    nothing is lost or invented but the look-ahead."""
    result = page.evaluate("""async () => {
        const { StreamResampler } = await import("/static/resampler.js");
        const run = (inRate, outRate, freq) => {
            const r = new StreamResampler(inRate, outRate);
            const out = [];
            let pushed = 0;
            for (let start = 0; start < inRate; start += 128, pushed += 128) {  // 1 s in render quanta
                const block = new Float32Array(128);
                for (let i = 0; i < 128; i++) block[i] = 0.5 * Math.sin(2 * Math.PI * freq * (start + i) / inRate);
                out.push(...r.push(block));
            }
            let err = 0, energy = 0, n = 0;
            for (let k = 2000; k < out.length - 2000; k++) {
                const ideal = 0.5 * Math.sin(2 * Math.PI * freq * k / outRate);
                err += (out[k] - ideal) ** 2; energy += out[k] ** 2; n++;
            }
            return { count: out.length, expected: pushed * outRate / inRate, rms: Math.sqrt(energy / n), err: Math.sqrt(err / n) };
        };
        return { down: run(48000, 24000, 1000), alias: run(48000, 24000, 15000), up: run(24000, 44100, 1000) };
    }""")
    for case in ("down", "up"):
        assert abs(result[case]["rms"] - 0.5 / np.sqrt(2)) < 1e-3 and result[case]["err"] < 1e-3, result
    assert result["alias"]["rms"] < 1e-3, result
    for case in result.values():  # only the kernel's look-ahead (< 32 output samples) is held back
        assert 0 <= case["expected"] - case["count"] < 32, result


def test_page_sends_the_api_key(browser, orch_tuned_server: Server):
    """A server that requires keys: without one the page explains the refusal; with the key
    (sent as the subprotocol, the only way a browser can) the conversation goes live."""
    orch_tuned_server.wait_free_slots(1)
    page = browser.new_page()
    try:
        page.goto(orch_tuned_server.http + "/")
        page.wait_for_selector("#connect:enabled", timeout=20_000)
        page.click("#connect")
        page.wait_for_selector("#notice:not([hidden])", timeout=20_000)
        assert "API key" in page.inner_text("#notice")
        page.wait_for_selector("#connect:enabled", timeout=10_000)

        page.click("summary")
        page.fill("#api-key", "test-key-2")
        page.click("#connect")
        page.wait_for_selector("#status[data-state=live]", timeout=30_000)
        wait_stats(page, "s.deltas >= 1")
        page.click("#disconnect")
        page.wait_for_selector("#status[data-state=idle]", timeout=20_000)
    finally:
        page.close()
    orch_tuned_server.wait_free_slots(2)


class TlsProxy:
    """A TLS-terminating TCP proxy on 127.0.0.1 in front of the plain server, as a deployment
    behind TLS looks to the browser (the page comes over https://, so its socket is wss://)."""

    def __init__(self, target_port: int, certfile: Path, keyfile: Path) -> None:
        self.target_port = target_port
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certfile, keyfile)
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        ready = threading.Event()

        def serve() -> None:
            self.server = self.loop.run_until_complete(asyncio.start_server(self._forward, "127.0.0.1", 0, ssl=context))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the TLS proxy did not start"

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)

    def close(self) -> None:
        async def shutdown() -> None:  # the browser may still hold keep-alive connections
            self.server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_page_over_tls_uses_wss(page, browser, orch_page_server: Server, tmp_path):
    """The websocket URL comes from the page's location: ws:// on plain http (the other tests),
    wss:// on https, here through a TLS proxy with a self-signed certificate."""
    assert page.evaluate("import('/static/realtime.js').then(m => m.realtimeUrl(window.location))") == \
        orch_page_server.ws + "/v1/realtime?duplex=1"
    page.close()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no openssl to make a test certificate: {exc}")
    proxy = TlsProxy(orch_page_server.port, cert, key)
    secure = browser.new_page()
    try:
        secure.goto(f"https://localhost:{proxy.port}/")
        secure.wait_for_selector("#connect:enabled", timeout=20_000)
        assert secure.evaluate("import('/static/realtime.js').then(m => m.realtimeUrl(window.location))") == \
            f"wss://localhost:{proxy.port}/v1/realtime?duplex=1"
        secure.click("#connect")
        secure.wait_for_selector("#status[data-state=live]", timeout=30_000)
        wait_stats(secure, "s.deltas >= 2 && s.playedMs > 0")
        secure.click("#disconnect")
        secure.wait_for_selector("#status[data-state=idle]", timeout=20_000)
        assert "client_close" in secure.inner_text("#status")
    finally:
        secure.close()
        proxy.close()
    orch_page_server.wait_free_slots(1)
