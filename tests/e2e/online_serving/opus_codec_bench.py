"""What one Ogg/Opus stream costs, per codec (``libopus``: our binding, ``sphn``), for speech
and for noise (the random model's output is noise, the dearest audio to encode):

- CPU per session-second: the encoding (and decoding) thread's own CPU time per 80 ms frame,
  over FRAMES frames of one stream, divided by 80 ms: the cores one session's Opus takes;
- how long the interpreter lock is held while encoding: a second thread spins on its own
  clock (``orchestrator/own_clock.py``: wall time less its waits for a CPU, so that a busy
  machine does not count) while the first encodes FRAMES frames back to back; the longest
  and the 99th percentile of the spinner's gaps are what an event loop would wait for the
  lock (the switch interval is set to 0.5 ms, as a worker with sphn has it);
- the fraction of the spinner's own time it spent waiting (for the lock): own time less its
  CPU time (0: the encoder never held it off).

Prints a table, writes JSON (command, date, git revision, CPU):

    python -m tests.e2e.online_serving.opus_codec_bench --frames 500 --output opus-codec.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .opus_worker_bench import FRAME, REPO, speech_frames

SWITCH_INTERVAL_S = 0.0005


def noise_frames(count: int, seed: int = 0) -> np.ndarray:
    """Full-band noise at speech-like loudness (RMS 0.25), the random model's kind of output."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.standard_normal((count, FRAME)) * 0.25, -1, 1).astype(np.float32)


def cpu_per_frame(codec: str, frames: np.ndarray) -> dict[str, float]:
    """Own CPU time per frame of one stream, encoding then decoding, in ms."""
    from orchestrator.protocol.ogg_opus import OggOpusDecoder, OggOpusEncoder

    encoder = OggOpusEncoder(codec=codec)
    started = time.thread_time()
    pages = [b"".join(encoder.encode(frame)) for frame in frames]
    encode_s = time.thread_time() - started
    decoder = OggOpusDecoder(codec=codec)
    decoded = 0
    started = time.thread_time()
    for page in pages:
        decoded += len(decoder.feed(page))
    if codec == "sphn":  # 0.1 decodes on a thread of its own: wait for it, count only the feed
        deadline = time.monotonic() + 10
        while decoded < len(frames) * FRAME and time.monotonic() < deadline:
            time.sleep(0.002)
            decoded += len(decoder.poll())
    decode_s = time.thread_time() - started
    decoder.close()
    return {"encode_ms": round(encode_s / len(frames) * 1000, 3), "decode_ms": round(decode_s / len(frames) * 1000, 3),
            "bytes_per_frame": round(sum(map(len, pages[1:])) / max(1, len(pages) - 1), 1),
            "decoded_samples": decoded}


def lock_hold(codec: str, frames: np.ndarray) -> dict[str, float]:
    """Gaps of a spinning thread while another encodes ``frames`` back to back."""
    from orchestrator.protocol.ogg_opus import OggOpusEncoder

    from orchestrator.own_clock import OwnClock

    encoder = OggOpusEncoder(codec=codec)
    done = threading.Event()
    gaps: list[float] = []
    spun = [0.0, 0.0]  # own time of the spinner, and its CPU time

    def spin() -> None:
        clock = OwnClock()
        last = start = clock.now()
        cpu = time.thread_time()
        while not done.is_set():
            now = clock.now()
            if now - last > 1e-4:
                gaps.append(now - last)
            last = now
        spun[0], spun[1] = clock.now() - start, time.thread_time() - cpu
        clock.close()

    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)
        started = time.perf_counter()
        for frame in frames:
            encoder.encode(frame)
        encode_wall_s = time.perf_counter() - started
    finally:
        done.set()
        spinner.join()
        sys.setswitchinterval(before)
    array = np.asarray(gaps or [0.0]) * 1000
    return {"gap_p99_ms": round(float(np.percentile(array, 99)), 3), "gap_max_ms": round(float(array.max()), 3),
            "spinner_waited": round(max(0.0, spun[0] - spun[1]) / max(spun[0], 1e-9), 3),
            "encode_wall_ms_per_frame": round(encode_wall_s / len(frames) * 1000, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=500, help="frames per stream and measurement (default 500)")
    parser.add_argument("--codecs", default="libopus,sphn", help="comma-separated (default libopus,sphn)")
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    from orchestrator.protocol import libopus

    audio = {"speech": speech_frames(args.frames), "noise": noise_frames(args.frames)}
    rows: list[dict[str, Any]] = []
    for codec in args.codecs.split(","):
        for kind, frames in audio.items():
            row = {"codec": codec, "audio": kind, **cpu_per_frame(codec, frames), **lock_hold(codec, frames)}
            row["cores_per_100_sessions"] = round((row["encode_ms"] + row["decode_ms"]) / 80.0 * 100, 2)
            rows.append(row)
    print(f"{'codec':8} {'audio':7} {'enc ms':>7} {'dec ms':>7} {'cores/100':>9} {'lock gap p99':>12} "
          f"{'max':>7} {'spinner waited':>14}")
    for r in rows:
        print(f"{r['codec']:8} {r['audio']:7} {r['encode_ms']:7.3f} {r['decode_ms']:7.3f} {r['cores_per_100_sessions']:9.2f} "
              f"{r['gap_p99_ms']:12.3f} {r['gap_max_ms']:7.3f} {r['spinner_waited']:14.3f}")
    if args.output:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip()
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        args.output.write_text(json.dumps({
            "command": "python -m tests.e2e.online_serving.opus_codec_bench " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": revision, "cpu": cpu, "libopus": libopus.version() if libopus.available() else None,
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
