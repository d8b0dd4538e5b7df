"""Sessions that join with long personas while a load runs: each one connects, opens with a
persona no other session had (a cold prefill on the engine), streams ``--stream-frames``
frames of speech in real time and waits for as many frames of the model's audio (0: none),
leaves, and the next one follows ``--every-s`` after the previous one started.  Writes the
open times, and how much audio each join got back, as JSON.

Used by ``h200_server_run.sh`` (``JOINER=EVERY_S:CHARS:DURATION_S``) to show what joins cost
the live sessions the load driver measures.

    python -m tests.e2e.online_serving.joiner --url ws://127.0.0.1:8000/v1/realtime?duplex=1 \\
        --every-s 1 --persona-chars 6000 --duration-s 60 --output joiner.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from tests.e2e.online_serving.join_pause_bench import persona_text
from engines.config import FRAME_SAMPLES
from tests.orch_support import Client, f32_append, speech_frames

FRAME_S = 0.08


async def join_once(url: str, index: int, chars: int, stream_frames: int) -> dict:
    started = time.monotonic()
    client = await Client.connect(url)
    try:
        await client.open(instructions=persona_text(index, chars))
        opened = time.monotonic() - started
        result = {"index": index, "open_s": opened}
        if stream_frames:
            for k, frame in enumerate(speech_frames(stream_frames)):
                await client.send(f32_append(frame))
                await asyncio.sleep(max(0.0, opened + (k + 1) * FRAME_S - (time.monotonic() - started)))
            audio = await client.wait_audio_frames(stream_frames, timeout=10.0)
            result["audio_frames"] = int(audio.size // FRAME_SAMPLES)
        await client.send({"type": "session.close"})
        await client.wait_closed()
        return result
    except Exception as exc:  # noqa: BLE001 - recorded: a refused or failed join is a result too
        return {"index": index, "error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        await client.close()


async def run(args: argparse.Namespace) -> list[dict]:
    joins = []
    end = time.monotonic() + args.duration_s
    index = 0
    while time.monotonic() < end:
        started = time.monotonic()
        joins.append({"at_s": round(args.duration_s - (end - started), 2),
                      **await join_once(args.url, args.first_index + index, args.persona_chars,
                                        args.stream_frames)})
        index += 1
        await asyncio.sleep(max(0.0, args.every_s - (time.monotonic() - started)))
    return joins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--persona-chars", type=int, default=6000)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--stream-frames", type=int, default=0,
                        help="frames of speech each join streams, and of the model's audio it waits for")
    parser.add_argument("--first-index", type=int, default=0, help="persona numbering (keep runs' personas apart)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    joins = asyncio.run(run(args))
    opened = sorted(j["open_s"] for j in joins if "open_s" in j)
    streamed = sum(1 for j in joins if j.get("audio_frames", 0) >= args.stream_frames > 0)
    summary = {"command": " ".join(sys.argv), "joins": len(joins), "failed": len(joins) - len(opened),
               "streamed": streamed if args.stream_frames else None,
               "open_s_p50": opened[len(opened) // 2] if opened else None, "open_s_max": opened[-1] if opened else None,
               "every": joins}
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"joiner: {len(opened)} of {len(joins)} joins opened"
          + (f", {streamed} got {args.stream_frames} frames of audio back" if args.stream_frames else "")
          + f"; open time p50 {summary['open_s_p50']} s, max {summary['open_s_max']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
