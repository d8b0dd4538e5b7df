"""What a front-end worker's Opus work does to its timing: one event loop with the worker's
codec threads (``orchestrator/frontend/codec_threads.py``) and SESSIONS native streams, no
network, no model.

Every 80 ms period, as a worker sees it under load: each client's next Ogg page arrives (spread
evenly over the period) and is handed to the decoder, and once a period a tick's worth of
output frames (one per session) is handed to the encoder.  Measured on the loop: how long a
page takes from arrival to its PCM being back on the loop (input that comes back late misses
its tick), how long a tick's encodes take to come back, and how late a 2 ms loop timer fires
(everything else the loop does waits that long).  Prints a table, writes JSON.

    python -m tests.e2e.online_serving.opus_worker_bench --sessions 32 --seconds 20 --codec libopus \
        --encode-threads 2 --audio noise --output opus.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[3]
FRAME = 1920
PERIOD_S = 0.08
TIMER_S = 0.002


def speech_frames(count: int) -> np.ndarray:
    """``count`` frames of real speech (float32 [count, 1920]), looped as needed."""
    from orchestrator.load_driver.audio import read_wav_float32

    pcm = read_wav_float32(REPO / "tests" / "data" / "input_assistant.wav")
    pcm = np.tile(pcm, int(np.ceil(count * FRAME / len(pcm))))[: count * FRAME]
    return pcm.reshape(count, FRAME).astype(np.float32)


def client_pages(frames: np.ndarray) -> list[bytes]:
    """The Ogg pages a client sends, one message per frame (the headers with the first)."""
    from orchestrator.protocol.ogg_opus import OggOpusEncoder

    encoder = OggOpusEncoder()
    return [b"".join(encoder.encode(frame)) for frame in frames]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    array = np.asarray(values) * 1000
    return {"p50": round(float(np.percentile(array, 50)), 2), "p99": round(float(np.percentile(array, 99)), 2),
            "max": round(float(array.max()), 2)}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads by OS name (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


async def run(sessions: int, seconds: float, codec_name: str = "libopus", encode_threads: int = 1,
              audio: str = "speech") -> dict[str, Any]:
    """``audio``: what the model's frames are (speech, or noise: the random model's output);
    the clients send speech."""
    from orchestrator.frontend.codec_threads import CodecThreads

    from .opus_codec_bench import noise_frames

    periods = int(seconds / PERIOD_S)
    frames = speech_frames(periods + sessions)
    pages = [client_pages(frames[i:i + periods]) for i in range(sessions)]
    if audio == "noise":
        frames = noise_frames(len(frames))
    loop = asyncio.get_running_loop()
    codec = CodecThreads(loop, codec=codec_name, encode_threads=encode_threads)
    decoders = [codec.new_decoder() for _ in range(sessions)]
    encoders = [codec.new_encoder() for _ in range(sessions)]
    decode_s: list[float] = []
    encode_s: list[float] = []
    timer_late_s: list[float] = []
    decoded = [0] * sessions
    waiting: list[list[float]] = [[] for _ in range(sessions)]  # arrival times of pages not yet decoded

    def on_pcm(i: int):
        def done(pcm: Any) -> None:
            if isinstance(pcm, Exception):
                raise pcm
            now = time.perf_counter()
            decoded[i] += len(pcm)
            while waiting[i] and decoded[i] >= FRAME:  # one page = one frame of PCM
                decode_s.append(now - waiting[i].pop(0))
                decoded[i] -= FRAME
        return done

    callbacks = [on_pcm(i) for i in range(sessions)]

    def arrive(i: int, k: int) -> None:
        waiting[i].append(time.perf_counter())
        codec.decode(decoders[i], pages[i][k], callbacks[i])

    def tick(k: int) -> None:
        asked = time.perf_counter()
        left = [sessions]

        def done(result: Any) -> None:
            left[0] -= 1
            if not left[0]:
                encode_s.append(time.perf_counter() - asked)
        for i in range(sessions):
            codec.encode(encoders[i], frames[(k + i) % len(frames)], done)

    start = loop.time() + 0.2
    for k in range(periods):
        for i in range(sessions):
            loop.call_at(start + k * PERIOD_S + i * PERIOD_S / sessions, arrive, i, k)
        loop.call_at(start + k * PERIOD_S + PERIOD_S / 2, tick, k)
    cpu_before = thread_cpu_s()
    end = start + periods * PERIOD_S
    due = loop.time() + TIMER_S
    while due < end:
        await asyncio.sleep(max(0.0, due - loop.time()))
        timer_late_s.append(max(0.0, loop.time() - due))
        due += TIMER_S
    await asyncio.sleep(0.5)
    cpu_after = thread_cpu_s()
    codec.stop()
    for decoder in decoders:
        decoder.close()
    wall = periods * PERIOD_S
    cpu = {name: round((cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0)) / wall, 3) for name in cpu_after}
    return {"pages_decoded": len(decode_s), "pages_sent": periods * sessions, "ticks": len(encode_s),
            "decode_latency_ms": percentiles(decode_s), "tick_encode_ms": percentiles(encode_s),
            "loop_timer_late_ms": percentiles(timer_late_s),
            "cpu_cores_by_thread": {k: v for k, v in sorted(cpu.items()) if v > 0.005}}


def revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32, help="native streams on this worker (default 32)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to run (default 20)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="set the interpreter's switch interval (default: as the worker leaves it)")
    parser.add_argument("--codec", choices=("libopus", "sphn"), default="libopus", help="default libopus")
    parser.add_argument("--encode-threads", type=int, default=1, help="encoding threads (default 1)")
    parser.add_argument("--audio", choices=("speech", "noise"), default="speech",
                        help="the model's frames to encode (default speech; noise: the random model's output)")
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.seconds <= 0:
        parser.error("--sessions and --seconds must be positive")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    import sphn

    result = asyncio.run(run(args.sessions, args.seconds, args.codec, args.encode_threads, args.audio))
    result.update({"command": " ".join([sys.executable, "-m", __spec__.name if __spec__ else __file__,
                                        *(argv if argv is not None else sys.argv[1:])]),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "git_revision": revision(), "host": platform.node(), "cpus": os.cpu_count(),
                   "sphn": getattr(sphn, "__version__", "?"), "sessions": args.sessions, "codec": args.codec,
                   "encode_threads": args.encode_threads, "audio": args.audio,
                   "switch_interval_ms": sys.getswitchinterval() * 1000})
    print(f"{'':24s} {'p50':>8s} {'p99':>8s} {'max':>8s}  (ms)")
    for key in ("decode_latency_ms", "tick_encode_ms", "loop_timer_late_ms"):
        row = result[key]
        print(f"{key:24s} {row['p50']:8.2f} {row['p99']:8.2f} {row['max']:8.2f}")
    print(f"pages decoded {result['pages_decoded']}/{result['pages_sent']}, ticks {result['ticks']}; "
          f"cores by thread: {result['cpu_cores_by_thread']}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
