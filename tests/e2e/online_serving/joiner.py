"""Sessions that join with long personas while a load runs: each one connects, opens with a
persona no other session had (a cold prefill on the engine), leaves once open, and the next
one follows ``--every-s`` after the previous one started.  Writes the open times as JSON.

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
from tests.orch_support import Client


async def join_once(url: str, index: int, chars: int) -> dict:
    started = time.monotonic()
    client = await Client.connect(url)
    try:
        await client.open(instructions=persona_text(index, chars))
        opened = time.monotonic() - started
        await client.send({"type": "session.close"})
        await client.wait_closed()
        return {"index": index, "open_s": opened}
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
                      **await join_once(args.url, args.first_index + index, args.persona_chars)})
        index += 1
        await asyncio.sleep(max(0.0, args.every_s - (time.monotonic() - started)))
    return joins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--persona-chars", type=int, default=6000)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--first-index", type=int, default=0, help="persona numbering (keep runs' personas apart)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    joins = asyncio.run(run(args))
    opened = sorted(j["open_s"] for j in joins if "open_s" in j)
    summary = {"command": " ".join(sys.argv), "joins": len(joins), "failed": len(joins) - len(opened),
               "open_s_p50": opened[len(opened) // 2] if opened else None, "open_s_max": opened[-1] if opened else None,
               "every": joins}
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"joiner: {len(opened)} of {len(joins)} joins opened; open time p50 {summary['open_s_p50']} s, "
          f"max {summary['open_s_max']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
