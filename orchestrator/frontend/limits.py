"""Per-client limits: concurrent websockets and open rate per API key or client address, and
the event and byte rate of one socket.

Token buckets with lazy refill: no timers, O(1) per check.  Everything runs on the event loop
(no locks).  The per-client tables forget a client once it holds nothing and its bucket is
full again, so a flood of one-off addresses cannot grow them without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Past this many remembered clients, idle ones are swept before adding another.
_SWEEP_AT = 4096


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, now: float) -> bool:
        if self.refill(now) >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_s(self, now: float) -> float:
        """Seconds until the next token."""
        missing = 1.0 - self.refill(now)
        return max(0.0, missing / self.rate) if self.rate > 0 else float("inf")


@dataclass
class _Client:
    held: int
    bucket: TokenBucket | None

    def idle(self, now: float) -> bool:
        """Holds nothing and its bucket (refilled to ``now``) is full: nothing to remember."""
        return self.held == 0 and (self.bucket is None or self.bucket.refill(now) >= self.bucket.burst)


@dataclass(frozen=True)
class Refusal:
    code: str  # session_limit_exceeded | open_rate_limited
    message: str
    retry_after_s: float | None = None


class ClientLimits:
    """Concurrent websockets and opens per minute, per client (an API key or an address).

    ``max_concurrent`` / ``per_minute`` of 0 switch that limit off.  The bucket holds one
    minute of opens (``per_minute``) and refills continuously.
    """

    def __init__(self, what: str, max_concurrent: int, per_minute: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # "key" or "address", for messages
        self.max_concurrent = max_concurrent
        self.per_minute = per_minute
        self._clock = clock
        self._clients: dict[str, _Client] = {}

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.per_minute > 0

    def __len__(self) -> int:
        return len(self._clients)

    def acquire(self, client: str) -> Refusal | None:
        """Count one more open websocket of ``client``, or say why not (nothing counted)."""
        if not self.enabled:
            return None
        now = self._clock()
        entry = self._clients.get(client)
        if entry is None:
            if len(self._clients) >= _SWEEP_AT:
                self._sweep(now)
            bucket = TokenBucket(self.per_minute / 60.0, self.per_minute, now) if self.per_minute else None
            entry = self._clients[client] = _Client(0, bucket)
        if self.max_concurrent and entry.held >= self.max_concurrent:
            return Refusal("session_limit_exceeded",
                           f"this {self.what} already has {entry.held} open sessions (limit {self.max_concurrent})")
        if entry.bucket is not None and not entry.bucket.take(now):
            wait = entry.bucket.wait_s(now)
            return Refusal("open_rate_limited",
                           f"more than {self.per_minute} opens per minute from this {self.what}; "
                           f"retry in {wait:.1f} s", retry_after_s=round(wait, 3))
        entry.held += 1
        return None

    def release(self, client: str) -> None:
        entry = self._clients.get(client)
        if entry is None or entry.held <= 0:
            return
        entry.held -= 1
        if entry.idle(self._clock()):
            del self._clients[client]

    def held(self, client: str) -> int:
        entry = self._clients.get(client)
        return entry.held if entry is not None else 0

    def _sweep(self, now: float) -> None:
        idle = [name for name, entry in self._clients.items() if entry.idle(now)]
        for name in idle:
            del self._clients[name]


class EventRate:
    """One socket's client events and bytes per second, with bursts of two seconds' worth
    (the byte burst is at least ``min_byte_burst``, so one event of the largest size allowed
    always fits).

    ``allow(n)`` is False for an event over either limit; ``should_report()`` is True at
    most once a second, so a flooding client gets a trickle of errors, not one per event.
    A rate of 0 switches that limit off.
    """

    def __init__(self, rate: float, byte_rate: float = 0, min_byte_burst: float = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._events = TokenBucket(rate, 2 * rate, now) if rate > 0 else None
        self._bytes = TokenBucket(byte_rate, max(2 * byte_rate, min_byte_burst), now) if byte_rate > 0 else None
        self._last_report = float("-inf")
        self.dropped = 0  # events refused since the last report

    def allow(self, size: int = 0) -> bool:
        now = self._clock()
        events, data = self._events, self._bytes
        if (events is None or events.refill(now) >= 1.0) and (data is None or data.refill(now) >= size):
            if events is not None:
                events.tokens -= 1.0
            if data is not None:
                data.tokens -= size
            return True
        self.dropped += 1
        return False

    def should_report(self) -> bool:
        now = self._clock()
        if now - self._last_report < 1.0:
            return False
        self._last_report = now
        return True

    def take_dropped(self) -> int:
        dropped, self.dropped = self.dropped, 0
        return dropped
