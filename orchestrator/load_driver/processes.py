"""``--processes P``: the load's sessions split over P worker processes with one shared start.

One Python process cannot keep an 80 ms grid for hundreds of sessions (each frame costs JSON,
base64 and websocket masking on one interpreter), and a client that falls behind makes the
server look slow.  So the parent spawns P workers, each driving a contiguous block of session
indexes on its own event loop:

1. every worker opens its sessions and reports ``("ready", admitted)``;
2. when all have reported (or died), the parent picks one start instant on the host's
   monotonic clock (``time.monotonic`` is CLOCK_MONOTONIC, the same in every process) a
   little ahead, and sends it to every worker; all sessions send frame 0 at that instant;
3. workers report progress every ``--progress-s`` and finally their rows, which the parent
   merges into one result (``load.assemble_result``) exactly as a single process would.

A worker that dies leaves failed rows for its sessions (error names its exit code); the
others go on.  Pipes carry small pickled tuples, and the rows once at the end.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from .audio import InputAudio, load_input
from .load import LoadRun, LoadSession, log_progress
from .options import Options

log = logging.getLogger(__name__)

START_LEAD_S = 0.25  # from the start decision to frame 0: every worker has the message by then
_SPARE_S = 60.0  # slack on the parent's own deadlines beyond the workers' bounded steps


@dataclass
class _Worker:
    number: int
    indexes: range
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False
    admitted: int = 0
    rows: list[dict[str, Any]] | None = None
    progress: dict[str, int] | None = None
    gone: bool = False  # its pipe closed


def split(sessions: int, processes: int) -> list[range]:
    """Contiguous index blocks, sizes differing by at most one."""
    base, extra = divmod(sessions, processes)
    blocks, first = [], 0
    for number in range(processes):
        size = base + (number < extra)
        blocks.append(range(first, first + size))
        first += size
    return blocks


def run_sessions_in_processes(opts: Options, audio: InputAudio, processes: int) -> list[dict[str, Any]]:
    """Drive ``opts.sessions`` sessions from ``processes`` workers; returns every row."""
    assert opts.sessions is not None
    context = multiprocessing.get_context("spawn")  # no forked event loops or sockets
    level = logging.getLogger().getEffectiveLevel()
    workers: list[_Worker] = []
    for number, indexes in enumerate(split(opts.sessions, processes)):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_worker_main, args=(opts, indexes, number, child_end, level),
                                  name=f"load-driver-{number}", daemon=True)
        process.start()
        child_end.close()
        workers.append(_Worker(number, indexes, process, parent_end))
    try:
        # An open is bounded by connect + session.update + session.created (each timeout_s),
        # a failed one by the close budget after it.
        _collect(workers, "ready", deadline=time.monotonic() + 3 * opts.timeout_s + opts.cleanup_timeout_s + _SPARE_S)
        start = time.monotonic() + START_LEAD_S
        for worker in workers:
            if worker.ready and not worker.gone:
                try:
                    worker.conn.send(("start", start))
                except OSError:
                    worker.gone = True
        log.info("load: %d of %d sessions admitted by %d of %d worker processes; streaming",
                 sum(w.admitted for w in workers), opts.sessions, sum(w.ready for w in workers), processes)
        stream_s = audio.frames * 0.08 + opts.drain_s + 2 * opts.timeout_s + 2 * opts.cleanup_timeout_s
        _collect(workers, "rows", deadline=start + stream_s + _SPARE_S, started=start,
                 total_frames=audio.frames, every_s=opts.progress_s)
    finally:
        for worker in workers:
            if worker.process.is_alive() and worker.rows is None:
                worker.process.terminate()
            worker.process.join(5)
            worker.conn.close()
    rows: list[dict[str, Any]] = []
    for worker in workers:
        if worker.rows is not None:
            rows += worker.rows
        else:
            code = worker.process.exitcode
            if not worker.ready and not worker.gone:
                why = f"driver worker {worker.number} did not open its sessions in time (stopped)"
            elif code not in (None, 0) and worker.gone:
                why = f"driver worker {worker.number} exited with code {code}"
            else:
                why = f"driver worker {worker.number} sent no result"
            log.error("load: %s; its %d sessions are failed rows", why, len(worker.indexes))
            rows += [LoadSession(opts, audio, i, worker.number).row(why) for i in worker.indexes]
    return rows


def _collect(workers: list[_Worker], until: str, *, deadline: float, started: float | None = None,
             total_frames: int = 0, every_s: float = 5.0) -> None:
    """Read worker messages until every live worker has sent ``until`` ("ready" or "rows"),
    logging merged progress every ``every_s`` while streaming."""
    next_progress = (started or 0.0) + every_s

    def waiting() -> list[_Worker]:
        if until == "ready":
            return [w for w in workers if not w.ready and not w.gone]
        return [w for w in workers if w.ready and w.rows is None and not w.gone]

    while waiting():
        now = time.monotonic()
        if now > deadline:
            log.error("load: %d worker(s) did not report %s in time", len(waiting()), until)
            return
        timeout = min(deadline, next_progress) - now if started is not None else deadline - now
        for conn in wait([w.conn for w in waiting()], timeout=max(0.0, timeout)):
            worker = next(w for w in workers if w.conn is conn)
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                worker.gone = True
                continue
            if kind == "ready":
                worker.ready, worker.admitted = True, payload
            elif kind == "progress":
                worker.progress = payload
            elif kind == "rows":
                worker.rows = payload
        if started is not None and time.monotonic() >= next_progress:
            log_progress(time.monotonic() - started, total_frames, [w.progress for w in workers])
            next_progress += every_s


# The worker process -----------------------------------------------------------------------------

def _worker_main(opts: Options, indexes: range, number: int, conn: Connection, level: int) -> None:
    # Workers log warnings and worse (the parent reports progress); debug stays available.
    logging.basicConfig(level=level if level <= logging.DEBUG else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s worker {number} %(name)s: %(message)s")
    try:
        asyncio.run(_drive(opts, indexes, number, conn))
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


async def _drive(opts: Options, indexes: range, number: int, conn: Connection) -> None:
    audio = load_input(opts.input_wav, tail_s=opts.tail_s, expected_sha256=opts.expected_input_sha256,
                       max_frames=opts.load_frames)
    run = LoadRun(opts, audio, indexes, number)
    loop = asyncio.get_running_loop()
    reporter: asyncio.Task | None = None
    try:
        conn.send(("ready", await run.open_all()))
        kind, start = await loop.run_in_executor(None, conn.recv)
        assert kind == "start"
        run.start(start)

        async def report() -> None:
            while True:
                await asyncio.sleep(opts.progress_s)
                conn.send(("progress", run.progress()))

        reporter = asyncio.create_task(report())
        rows = await run.finish()
        reporter.cancel()
        conn.send(("rows", rows))
    finally:
        if reporter is not None:
            reporter.cancel()
        await run.abort()
