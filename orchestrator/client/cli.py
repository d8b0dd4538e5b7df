"""The command line: parse, check everything that can be checked before connecting, hold
the conversation, write the outputs.

Every expected failure (bad URL, unreachable or refusing server, unreadable WAV, a server
error) is one ``error: ...`` line on stderr and exit status 2, never a traceback.  Outputs
are written whenever a session was opened, also after a failure, so a partial run still
leaves what the model said.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import urllib.parse
import wave
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from engines.config import SAMPLE_RATE

from .conversation import Conversation, Progress, ServerRefused
from .report import Reporter
from .sources import MicSource, SourceError, Speaker, WavSource

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 2, 130
DEFAULT_URL = "ws://127.0.0.1:8000/v1/realtime?duplex=1"
_SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}

EPILOG = """examples:
  python -m orchestrator.client --input-wav question.wav --output-wav answer.wav --transcript answer.txt
  python -m orchestrator.client --url wss://talk.example.com --input-wav in.wav --fast --voice NATM1.pt
  python -m orchestrator.client --mic --output-wav call.wav          (needs: pip install sounddevice)

The model listens and speaks at once: its audio has one 80 ms frame per input frame, so the
output lasts as long as the input plus --tail-s.  Live lines (stderr) show frames each way,
the round trip of the latest frame (sent -> the model's answer to it received) and the text.
Without --transcript the text is printed to stdout at the end.  Exit status: 0 done,
2 error (bad arguments, connection, WAV, or any server error event), 130 interrupted."""


class UsageError(Exception):
    """Something in the arguments or the environment that the user has to fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.client", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Talk to a personaplex-serve server: stream a WAV file (or the microphone), write the "
                    "model's audio and transcript, print live latency.")
    p.add_argument("--url", default=DEFAULT_URL,
                   help="the server's realtime websocket URL (default %(default)s); wss:// for TLS; http(s):// "
                        "and a bare ws://host:port are accepted too")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input-wav", type=Path, metavar="IN",
                        help="WAV (or other sphn-readable) file to send; any rate, first channel")
    source.add_argument("--mic", action="store_true",
                        help="send the default microphone until Ctrl+C and play the model on the speakers "
                             "(needs the sounddevice package)")
    p.add_argument("--output-wav", type=Path, metavar="OUT", help="write the model's audio here (PCM16 mono 24 kHz)")
    p.add_argument("--transcript", type=Path, metavar="OUT.txt", help="write the model's text here")
    p.add_argument("--voice", help="voice prompt, e.g. NATF2.pt (GET /v1/voices lists them); default: the server's")
    p.add_argument("--persona", help="persona text, sent as the session's instructions; default: the server's")
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed, for a reproducible reply (extra_body.seed)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--realtime", dest="fast", action="store_false",
                      help="send the file at real speed, one frame per 80 ms, like a microphone (default)")
    pace.add_argument("--fast", dest="fast", action="store_true",
                      help="send as fast as the server answers, at most --window frames ahead")
    p.set_defaults(fast=False)  # store_false would otherwise make --fast the default
    p.add_argument("--window", type=int, default=25, metavar="FRAMES",
                   help="with --fast: unanswered frames allowed in flight (default %(default)s, 2 s)")
    p.add_argument("--tail-s", type=float, default=2.0, metavar="S",
                   help="silence sent after the file so the model can finish speaking (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("PERSONAPLEX_API_KEY"),
                   help="bearer key if the server requires one (default: $PERSONAPLEX_API_KEY)")
    p.add_argument("--timeout-s", type=float, default=30.0, metavar="S",
                   help="connect and open timeout, and the longest wait for any progress (default %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no live lines; only errors and the summary")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def normalize_url(url: str) -> str:
    """A ws(s):// URL of the realtime endpoint; a bare ``host:port`` base gets ``/v1/realtime``."""
    parts = urllib.parse.urlsplit(url.strip())
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.hostname:
        raise UsageError(f"--url must be a ws:// or wss:// URL such as {DEFAULT_URL}, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise UsageError(f"--url has an invalid port: {url!r}") from None
    path = parts.path if parts.path not in ("", "/") else "/v1/realtime"
    query = parts.query or ("duplex=1" if path == "/v1/realtime" else "")
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, query, ""))


def check_args(args: argparse.Namespace) -> None:
    if args.tail_s < 0 or args.timeout_s <= 0 or args.window < 1 or (args.seed is not None and args.seed < 0):
        raise UsageError("--tail-s and --seed must be >= 0, --timeout-s > 0 and --window >= 1")
    for option, path in (("--output-wav", args.output_wav), ("--transcript", args.transcript)):
        if path is None:
            continue
        if path.is_dir():
            raise UsageError(f"{option} {path} is a directory")
        parent = path.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise UsageError(f"{option}: cannot write to {parent} (missing or read-only directory)")


def session_payload(args: argparse.Namespace) -> dict[str, Any]:
    session: dict[str, Any] = {
        "modalities": ["audio", "text"],
        "input_audio_format": "pcm16",  # what conversation.stream sends
        "sample_rate_hz": SAMPLE_RATE,
        "output_audio_format": "pcm16",
        "turn_detection": None,
    }
    if args.voice:
        session["voice"] = args.voice
    if args.persona is not None:
        session["instructions"] = args.persona
    if args.seed is not None:
        session["extra_body"] = {"seed": args.seed}
    return session


async def open_socket(url: str, api_key: str | None, timeout_s: float) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        # No compression: base64 PCM barely compresses and deflate would cost CPU per frame.
        return await connect(url, additional_headers=headers, open_timeout=timeout_s, max_size=None,
                             compression=None)
    except InvalidStatus as exc:
        body = exc.response.body.decode("utf-8", "replace").strip() if exc.response.body else ""
        raise UsageError(f"the server at {url} refused the websocket: HTTP {exc.response.status_code}"
                         + (f" {body[:300]}" if body else "")) from None
    except InvalidURI as exc:
        raise UsageError(f"--url is not a valid websocket URL: {exc}") from None
    except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise UsageError(f"cannot connect to {url}: {reason} (is the server running, and is the URL right?)") from None


async def converse(args: argparse.Namespace, url: str, source: WavSource | MicSource, speaker: Speaker | None,
                   reporter: Reporter, stop: asyncio.Event) -> tuple[Progress, str | None]:
    """Hold the conversation; returns what happened and the failure message, if any."""
    ws = await open_socket(url, args.api_key, args.timeout_s)
    conversation = Conversation(ws, on_text=reporter.text, on_error=reporter.error,
                                on_audio=speaker.play if speaker else lambda pcm16: None)

    async def ticker() -> None:
        while True:
            reporter.tick(conversation.progress)
            await asyncio.sleep(0.1)

    failure = None
    live = asyncio.ensure_future(ticker())
    try:
        await conversation.open(session_payload(args), args.timeout_s)
        window = args.window if args.fast else None
        await conversation.stream(source.stream(stop, realtime=not args.fast), window=window, stall_s=args.timeout_s)
        await conversation.drain(args.timeout_s)
    except ServerRefused as exc:
        failure = str(exc)
    finally:
        live.cancel()
        reporter.tick(conversation.progress, force=True)
        try:
            await conversation.close(min(args.timeout_s, 5.0))
        except Exception as exc:  # noqa: BLE001 - closing a broken socket: nothing left to do
            log.debug("close failed: %s", exc)
    return conversation.progress, failure


def write_outputs(args: argparse.Namespace, progress: Progress) -> list[str]:
    written = []
    if args.output_wav is not None:
        with wave.open(str(args.output_wav), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(SAMPLE_RATE)
            wav.writeframes(progress.audio().astype("<i2").tobytes())
        written.append(str(args.output_wav))
    if args.transcript is not None:
        args.transcript.write_text(progress.text.strip() + "\n", encoding="utf-8")
        written.append(str(args.transcript))
    return written


def _catch_interrupt(stop: asyncio.Event) -> None:
    """First Ctrl+C: stop sending and finish cleanly; a second one interrupts for real."""
    loop = asyncio.get_running_loop()

    def first() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        pass


async def _run(args: argparse.Namespace, url: str, source: WavSource | MicSource,
               speaker: Speaker | None, reporter: Reporter) -> tuple[Progress, str | None, bool]:
    stop = asyncio.Event()
    _catch_interrupt(stop)
    progress, failure = await converse(args, url, source, speaker, reporter, stop)
    return progress, failure, stop.is_set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    reporter = Reporter(quiet=args.quiet)
    speaker = None
    try:
        url = normalize_url(args.url)
        check_args(args)
        source = MicSource() if args.mic else WavSource(args.input_wav, args.tail_s)
        if args.mic:
            speaker = Speaker()
        progress, failure, interrupted = asyncio.run(_run(args, url, source, speaker, reporter))
    except (UsageError, SourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if speaker is not None:
            speaker.close()
    written = write_outputs(args, progress) if progress.session_id is not None else []
    reporter.summary(progress, written)
    if args.transcript is None and progress.text.strip():
        print(progress.text.strip())
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_ERROR
    if progress.errors:
        print(f"error: the server reported {len(progress.errors)} error(s)", file=sys.stderr)
        return EXIT_ERROR
    if interrupted and not args.mic:
        return EXIT_INTERRUPTED
    return EXIT_OK

