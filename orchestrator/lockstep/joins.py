"""Prefill jobs: the control work that may take several pieces (opening a lane: preparing its
system prompt; restarting one: preparing it again), and the queue that gives them turns.

The scheduler runs one piece of one job between ticks.  Jobs take turns in order; at most
``concurrent_joins`` are under way at once, because the engine's memory plan reserves the
longest prompt's peak for each of them (engines/runtime/memory_plan.py), and an open that
waits past ``join_wait_s`` for its turn is refused (``JoinTurnTimeout``) without having
allocated anything.  Used under the scheduler's lock: nothing here locks.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from engines.interface import WAITING, Engine, EngineError, Pieces, SessionSpec

log = logging.getLogger(__name__)

UNFINISHED = object()  # a job's preparation has pieces left


class JoinTurnTimeout(EngineError):
    """An open that waited longer than ``join_wait_s`` for its turn to be prepared: the server
    is preparing as many joins as its memory plan allows (retryable)."""

    code = "resource_exhausted"
    reason = "join_wait_timeout"  # personaplex_open_failures_total{reason}


@dataclass
class Job:
    kind: str  # open | restart
    key: str
    spec: SessionSpec | None = None  # open: what to open
    future: concurrent.futures.Future | None = None  # open: settled with the slot or the error
    pieces: Pieces | None = None  # the preparation under way, once its first piece ran
    waited: bool = False  # its last piece did nothing (engines.interface.WAITING)
    queued_at: float = 0.0  # when it was asked for (an open's wait for its turn is bounded)

    @property
    def started(self) -> bool:
        """Whether its preparation is under way (and may hold device memory for it)."""
        return self.pieces is not None

    def next_piece(self, engine: Engine, spec: SessionSpec) -> Any:
        """Run the next piece of the preparation of ``spec``: its result once the last piece
        ran, else ``UNFINISHED``; raises what preparing raised."""
        if self.pieces is None:
            self.pieces = engine.prepare_in_pieces(spec)
        try:
            self.waited = next(self.pieces) is WAITING
        except StopIteration as done:
            return done.value
        return UNFINISHED

    def drop(self) -> None:
        """Stop the preparation now: what it holds (a device cache, the engine's piece graph)
        is given back at once, not whenever the generator is collected."""
        if self.pieces is not None:
            self.pieces.close()


class JobQueue:
    def __init__(self, concurrent_joins: int, join_wait_s: float, settle: Callable[..., None]) -> None:
        self.concurrent_joins = concurrent_joins
        self.join_wait_s = join_wait_s
        self._settle = settle  # (future, result=None, error=None): how an open's future is settled
        self._jobs: deque[Job] = deque()
        self._waits_in_row = 0  # jobs in turn whose piece waited for another's

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> None:
        self._jobs.append(job)

    def take(self, now: float) -> Job | None:
        """The next job to run a piece of, in turn, among those under way and, while fewer than
        ``concurrent_joins`` are, the longest waiting; opens that waited past ``join_wait_s``
        for their turn are refused here."""
        expired = [job for job in self._jobs
                   if not job.started and job.kind == "open" and now - job.queued_at > self.join_wait_s]
        for job in expired:
            self._jobs.remove(job)
            log.warning("open of %s refused: no turn to prepare it within %g s (%d joins under way)", job.key,
                        self.join_wait_s, self.concurrent_joins)
            self._settle(job.future, error=JoinTurnTimeout(
                f"the server is preparing other sessions and had no turn for this one within "
                f"{self.join_wait_s:g} s; try again"))
        under_way = sum(1 for job in self._jobs if job.started)
        for job in self._jobs:
            if job.started or under_way < self.concurrent_joins:
                self._jobs.remove(job)
                return job
        return None

    def cancel_opens(self, key: str) -> None:
        """Cancel the pending open of ``key`` (its client left): its future, its preparation."""
        for job in [job for job in self._jobs if job.kind == "open" and job.key == key]:
            self._jobs.remove(job)
            job.future.cancel()
            job.drop()

    def after_piece(self, job: Job, finished: bool) -> str:
        """Put an unfinished ``job`` back for its next piece after the others' turns, and say
        what the engine thread does next: "next" (a piece that waited spent no engine time:
        the next job may have this gap), "pause" (every job in turn has waited: none can
        advance, which the engine's contract rules out, so pause briefly rather than spin) or
        "tick" (as usual, a tick may come first)."""
        if finished or not job.waited:
            self._waits_in_row = 0
            if not finished:
                self._jobs.append(job)
            return "tick"
        self._jobs.append(job)
        self._waits_in_row += 1
        if self._waits_in_row < len(self._jobs):
            return "next"
        self._waits_in_row = 0
        return "pause"
