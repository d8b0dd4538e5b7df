"""``python -m orchestrator.drain_wait``: wait until a server's live sessions have ended (or a
deadline passes), for an orchestrator's pre-stop hook.

Kubernetes takes a terminating pod out of its Service's endpoints and runs the pre-stop hook
before it sends SIGTERM; a hook that waits here lets the pod's calls end on their own, with
no new ones coming, before the server's drain (SIGTERM) ends whatever is left with reason
``shutdown`` (deploy/kubernetes/personaplex.yaml, docs/DEPLOYMENT.md, "Kubernetes").  It reads
``live_sessions`` from ``/ready`` (whatever its status: a full or draining server answers 503
with the same body) and always exits 0: a hook that fails would only hurry the stop.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.request

log = logging.getLogger("orchestrator.drain_wait")


def live_sessions(url: str) -> int | None:
    """The server's live sessions from ``/ready``, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            body = answer.read()
    except urllib.error.HTTPError as refused:  # 503: full, draining, loading; the body still counts
        body = refused.read()
    except OSError:
        return None
    try:
        return int(json.loads(body)["live_sessions"])
    except (ValueError, KeyError, TypeError):
        return None


# Looks in a row without an answer after which the server counts as gone: one slow or refused
# answer (a busy event loop, a connection limit) must not end the wait and cut live calls.
MISSES_GONE = 3


def wait(url: str, deadline_s: float, poll_s: float) -> int | None:
    """Poll until no session is live, the server has not answered ``MISSES_GONE`` times in a
    row, or ``deadline_s`` passes; the last count (None: no answer)."""
    end = time.monotonic() + deadline_s
    misses = 0
    while True:
        live = live_sessions(url)
        misses = 0 if live is not None else misses + 1
        if live == 0 or misses >= MISSES_GONE or time.monotonic() >= end:
            return live
        time.sleep(min(poll_s, max(0.0, end - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.drain_wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/ready", help="the server's /ready")
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="wait at most this long (keep it under the pod's grace period less the "
                             "server's --graceful-timeout)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between looks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    live = wait(args.url, args.deadline_s, args.poll_s)
    log.info("after %.0f s: %s", time.monotonic() - started,
             "no live sessions" if live == 0 else "the server does not answer" if live is None
             else f"{live} session(s) still live at the deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
