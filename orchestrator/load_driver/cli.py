"""The load driver's command line: ``personaplex-load`` (console script), also reachable as
``python -m orchestrator.load_driver`` and, under the reference driver's name,
``python -m tests.e2e.online_serving.personaplex_realtime_duplex``.

Same interface, checks, metrics and ``load-result.json`` schema as the reference driver
(vLLM-Omni's ``tests/e2e/online_serving/personaplex_realtime_duplex.py``, spec
realtime-duplex.md §7), so published measurements compare; what it adds (the real-time gate,
``--processes``, server-fed frames) only adds fields.  Run ``--help`` for the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from . import options as defaults
from .acceptance import Thresholds
from .lifecycle import RESULT_NAME as LIFECYCLE_RESULT
from .lifecycle import run_lifecycle
from .load import RESULT_NAME as LOAD_RESULT
from .run import run_load
from .options import Options, OptionsError
from .report import lifecycle_summary, load_summary

EXIT_OK, EXIT_NOT_OK, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
Drive a PersonaPlex realtime duplex server over its websocket, as a client would.

Two modes:
  lifecycle (default, no --sessions)
      A primary and a secondary session (different personas) run in parallel; one session
      over --admission-limit must be refused with resource_exhausted; the primary closes and
      a replacement with a third persona gets a fresh id and no leaked state.  Writes
      result.json plus <session>-events.jsonl and <session>-output.wav per session.
      The server's max_sessions must equal --admission-limit (default: the one the server
      advertises in its capabilities, else 2).  The secondary
      sends nothing while the primary is recycled (about --drain-s plus a close and an
      open), so a server that feeds silence to idle sessions needs a longer grace than that.
  load (--sessions N)
      N sessions open first, then stream the input on one shared start, each on a fixed 80 ms
      grid without catch-up bursts, for a fixed --drain-s window; then the acceptance checks,
      the real-time gate and session.close.  The sessions are split over --processes worker
      processes (default: one per %(per)d sessions, at most one per CPU) that share the start.
      Writes load-result.json (never overwrites one) with a row per session: stream lag
      (output frame k received minus input frame k sent minus 80 ms) p50/p99, the longest
      gap between output packets, packet intervals (linear p99), first audio after stream
      start, client and server stream RTF, send lateness, frame deficit and coverage,
      server-fed frames, voiced frames, RMS, underruns, playout stalls and invalid packets;
      and the same lag and lateness pooled over the run.  No credentials and no audio are
      exported.

The real-time gate: a load session fails when its stream lag p99 exceeds
--max-stream-lag-ms or a gap between its output packets exceeds --max-gap-ms.  The summary
also counts the sessions that "hold" real time by the capacity rule (lag p99 <= %(hold_lag)g ms
and no gap over %(hold_gap)g ms), and says when the client itself fell behind (pooled send
lateness p99 over %(client)g ms: add --processes; the run then measures the client too).

Frames the server makes from its own silence after the client's last frame (a server that
keeps a session clocked through a stall) are counted as server_fed_frames, not as a
deficit: from the deltas' metadata.timing.silence_input_frames (or silence_input) when the
server sends it, else those past the input's count that arrive after the last send.

Every audio packet is checked strictly: base64, whole PCM16 samples, 24 kHz, a response id.
Both response.output_audio.delta and the legacy response.audio.delta are accepted.

A summary table goes to stdout, progress and diagnostics to stderr.  The result fields are
those of the reference driver (shared spec realtime-duplex.md §7), plus protocol_violations and
scheduler_data_plane per load row; a worked N=8 example is in docs/PERFORMANCE.md, "CPU: paced
load driver, N=8".

Exit status: 0 ok, 1 the run was not ok, 2 bad arguments or input, or an existing
load-result.json in --output-dir.
""" % {"per": defaults.SESSIONS_PER_PROCESS, "hold_lag": defaults.HOLD_STREAM_LAG_P99_MS,
       "hold_gap": defaults.HOLD_MAX_GAP_MS, "client": defaults.CLIENT_LATENESS_LIMIT_MS}

EPILOG = """\
examples:
  # lifecycle acceptance against a server started with PERSONAPLEX_MAX_SESSIONS=2
  personaplex-load --model tiny-v1 --input-wav tests/data/input_assistant.wav \\
      --output-dir /tmp/lifecycle

  # 8 paced sessions of 20 s each, with a lag-over-time plot
  personaplex-load --model tiny-v1 --input-wav tests/data/input_assistant.wav \\
      --sessions 8 --load-frames 250 --server-revision "$(git rev-parse --short HEAD)" \\
      --server-hardware "2-core CPU" --plot --output-dir /tmp/load-n8

  # a capacity point: 128 full-window sessions (3000 frames, 4 minutes) from 8 processes
  personaplex-load --model personaplex-7b --input-wav input_assistant.wav --sessions 128 \\
      --load-frames 3000 --tail-s 200 --processes 8 --plot --output-dir /tmp/n128
"""


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr (what is wrong, where help is) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog or "personaplex-load", description=DESCRIPTION,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    conn = parser.add_argument_group("connection and input")
    conn.add_argument("--url", metavar="URL", default=defaults.DEFAULT_URL,
                      help="websocket URL of the realtime endpoint; duplex=1, model and autostart=0 are added to its "
                           "query (default: %(default)s)")
    conn.add_argument("--model", metavar="NAME", required=True, help="model name sent in the URL and in session.update")
    conn.add_argument("--input-wav", metavar="WAV", required=True, type=Path,
                      help="PCM WAV to send (any rate and channel count: mixed to mono, resampled to 24 kHz by "
                           "linear interpolation)")
    conn.add_argument("--expected-input-sha256", metavar="HEX",
                      help="refuse to run when the input WAV has another SHA-256")
    conn.add_argument("--output-dir", metavar="DIR", type=Path, default=Path(defaults.DEFAULT_OUTPUT_DIR),
                      help="where results go (default: %(default)s)")
    conn.add_argument("--api-key-env", metavar="VAR",
                      help="send 'Authorization: Bearer $VAR' (the key is read from that environment variable, so "
                           "it never appears in the command line or the results)")

    voice = parser.add_argument_group("voice and personas")
    voice.add_argument("--voice", metavar="NAME", default=defaults.DEFAULT_VOICE,
                       help="voice prompt (default: %(default)s)")
    voice.add_argument("--persona", metavar="TEXT", default=defaults.DEFAULT_PERSONA,
                       help="persona of the primary session and of every load session (default: %(default)r)")
    voice.add_argument("--secondary-persona", metavar="TEXT", default=defaults.DEFAULT_SECONDARY_PERSONA,
                       help="lifecycle: persona of the secondary session (default: %(default)r)")
    voice.add_argument("--replacement-persona", metavar="TEXT", default=defaults.DEFAULT_REPLACEMENT_PERSONA,
                       help="lifecycle: persona of the replacement session (default: %(default)r)")

    timing = parser.add_argument_group("timing")
    timing.add_argument("--tail-s", metavar="S", type=float, default=2.0,
                        help="seconds of silence appended to the input: output only advances while input arrives "
                             "(default: %(default)s)")
    timing.add_argument("--drain-s", metavar="S", type=float, default=2.0,
                        help="fixed wait after the last frame before the checks; audio after it is not counted "
                             "(default: %(default)s)")
    timing.add_argument("--timeout-s", metavar="S", type=float, default=180.0,
                        help="limit for each open, send and wait (default: %(default)s)")
    timing.add_argument("--cleanup-timeout-s", metavar="S", type=float, default=5.0,
                        help="budget shared by session.close and its session.closed, and the websocket close "
                             "handshake's limit (default: %(default)s)")
    timing.add_argument("--progress-s", metavar="S", type=float, default=5.0,
                        help="load mode: seconds between progress lines (default: %(default)s)")

    checks = parser.add_argument_group("acceptance")
    checks.add_argument("--max-frame-deficit", metavar="N", type=int, default=4,
                        help="allowed input frames minus output frames after the drain; multi-frame chunking may "
                             "hold up to 4 frames (default: %(default)s)")
    checks.add_argument("--voiced-frame-rms-threshold", metavar="RMS", type=float, default=1e-3,
                        help="an output frame with this RMS or more is voiced (default: %(default)s)")
    checks.add_argument("--min-voiced-frames", metavar="N", type=int, default=5,
                        help="voiced output frames each session needs (default: %(default)s)")
    checks.add_argument("--minimum-audio-chunks", metavar="N", type=int, default=2,
                        help="non-empty audio packets each session needs (default: %(default)s)")
    checks.add_argument("--require-scheduler-data-plane", action="store_true",
                        help="fail sessions whose deltas never carry vLLM-Omni's metadata.vllm_omni scheduler-data-"
                             "plane block.  Off by default: the check then only reports (scheduler_data_plane in "
                             "each row), because personaplex-serve sends its own metadata and does not claim "
                             "vLLM-Omni's identity.  Turn it on to reproduce the reference acceptance against a "
                             "vLLM-Omni server")
    checks.add_argument("--replacement-frames", metavar="N", type=int, default=0,
                        help="lifecycle: frames streamed after the slot is recycled; 0 = the whole input "
                             "(default: %(default)s)")
    checks.add_argument("--admission-limit", metavar="N", type=int, default=None,
                        help="lifecycle: the server's max_sessions; that many sessions must be admitted and one more "
                             "refused with resource_exhausted (default: the max_sessions the server advertises in its "
                             "capabilities, as personaplex-serve does; else 2, the reference deployment's)")

    load = parser.add_argument_group("load mode")
    load.add_argument("--sessions", metavar="N", type=int,
                      help=f"run the paced load with N sessions (1..{defaults.MAX_LOAD_SESSIONS}); omit for the "
                           "lifecycle mode.  Sessions the server refuses are kept as failed rows")
    load.add_argument("--protocol", choices=defaults.PROTOCOLS, default="realtime",
                      help="realtime (default): the Realtime events on --url; native: PersonaPlex's /api/chat on "
                           "--url's host (Ogg/Opus both ways, --voice and --persona in the query; what NVIDIA's "
                           "clients speak)")
    load.add_argument("--processes", metavar="P", type=int,
                      help=f"driver worker processes sharing the sessions and one start (1..{defaults.MAX_PROCESSES}, "
                           f"at most N; default: one per {defaults.SESSIONS_PER_PROCESS} sessions, at most the CPU "
                           "count)")
    load.add_argument("--start-spread-ms", metavar="MS", type=float, default=0.0,
                      help="spread the sessions' starts over this many ms after the shared start (0..80), as real "
                           "clients send at arbitrary phases of the 80 ms period; 0, the reference's, starts "
                           "every session on the same instant, which lets a server batch them trivially "
                           "(default: %(default)s)")
    load.add_argument("--max-stream-lag-ms", metavar="MS", type=float, default=defaults.DEFAULT_MAX_STREAM_LAG_MS,
                      help="fail sessions whose stream lag p99 exceeds this (default: %(default)s)")
    load.add_argument("--max-gap-ms", metavar="MS", type=float, default=defaults.DEFAULT_MAX_GAP_MS,
                      help="fail sessions with a gap between output packets longer than this (default: %(default)s)")
    load.add_argument("--load-frames", metavar="F", type=int, default=1000,
                      help=f"at most this many 80 ms frames per session, tail included; the input is truncated, "
                           f"never looped (1..{defaults.MAX_LOAD_FRAMES}, default: %(default)s)")
    load.add_argument("--max-client-rtf", metavar="RTF", type=float,
                      help="fail sessions whose client_stream_rtf exceeds this")
    load.add_argument("--max-stream-rtf", metavar="RTF", type=float,
                      help="fail sessions whose server_stream_rtf exceeds this")
    load.add_argument("--max-lag-drift-ms", metavar="MS", type=float,
                      help="fail sessions whose stream_lag_drift_ms exceeds this")
    load.add_argument("--server-revision", metavar="R", help="recorded as reported_server.revision (not verified)")
    load.add_argument("--server-hardware", metavar="H", help="recorded as reported_server.hardware (not verified)")

    out = parser.add_argument_group("output")
    out.add_argument("--plot", action="store_true",
                     help="also write a timeline PNG (load-timeline.png or lifecycle-timeline.png): per-session audio "
                          "arrival against the send schedule, and send lateness; needs matplotlib")
    out.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    out.add_argument("-q", "--quiet", action="store_true", help="warnings only (no progress lines)")
    return parser


def options_from_args(args: argparse.Namespace) -> Options:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise OptionsError(f"--api-key-env: the environment variable {args.api_key_env} is not set")
    opts = Options(
        model=args.model, input_wav=args.input_wav, url=args.url, output_dir=args.output_dir,
        expected_input_sha256=args.expected_input_sha256, api_key=api_key, protocol=args.protocol, voice=args.voice,
        persona=args.persona,
        secondary_persona=args.secondary_persona, replacement_persona=args.replacement_persona, tail_s=args.tail_s,
        drain_s=args.drain_s, timeout_s=args.timeout_s, cleanup_timeout_s=args.cleanup_timeout_s,
        progress_s=args.progress_s,
        thresholds=Thresholds(max_frame_deficit=args.max_frame_deficit, min_voiced_frames=args.min_voiced_frames,
                              minimum_audio_chunks=args.minimum_audio_chunks,
                              voiced_frame_rms_threshold=args.voiced_frame_rms_threshold,
                              require_scheduler_data_plane=args.require_scheduler_data_plane),
        replacement_frames=args.replacement_frames, admission_limit=args.admission_limit, sessions=args.sessions,
        load_frames=args.load_frames, max_client_rtf=args.max_client_rtf, max_stream_rtf=args.max_stream_rtf,
        max_lag_drift_ms=args.max_lag_drift_ms, max_stream_lag_ms=args.max_stream_lag_ms,
        max_gap_ms=args.max_gap_ms, start_spread_ms=args.start_spread_ms, processes=args.processes, server_revision=args.server_revision,
        server_hardware=args.server_hardware, plot=args.plot)
    opts.validate()
    return opts


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        opts = options_from_args(args)
    except OptionsError as exc:
        parser.error(str(exc))  # exits with EXIT_USAGE
    if not opts.input_wav.is_file():
        parser.error(f"--input-wav {opts.input_wav} is not a file")
    try:
        if opts.load_mode:
            result = run_load(opts)
            print(load_summary(result, opts.output_dir / LOAD_RESULT))
        else:
            result = asyncio.run(run_lifecycle(opts))
            print(lifecycle_summary(result, opts.output_dir / LIFECYCLE_RESULT))
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError) as exc:  # unreadable WAV, checksum mismatch, output dir not writable
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted: no result written", file=sys.stderr)
        return EXIT_NOT_OK
    return EXIT_OK if result["ok"] else EXIT_NOT_OK


if __name__ == "__main__":
    sys.exit(main())
