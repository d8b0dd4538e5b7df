"""Prometheus text exposition (format 0.0.4), written by hand: a few counters, gauges and
two histograms do not justify a client library.

The unlabelled families are totals over the process's engines (as before there were several);
the ``personaplex_device_*`` families give each engine's device its own series under a
``device`` label.  Updated from the event loop and from the scheduler threads, hence the lock.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Callable

TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.32, 0.64, 1.28)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The series of this histogram; ``labels`` (``device="cuda:0"``) go on every one."""
        le_prefix = labels + "," if labels else ""
        own = f"{{{labels}}}" if labels else ""
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{le_prefix}le="{_num(bound)}"}} {cumulative}')
        out.append(f'{name}_bucket{{{le_prefix}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{own} {_num(self.total)}")
        out.append(f"{name}_count{own} {self.count}")
        return out


class _TickStats:
    """Tick duration and batch size histograms (of the process, or of one device)."""

    def __init__(self) -> None:
        self.seconds = Histogram(TICK_BUCKETS_S)
        self.batch = Histogram(BATCH_BUCKETS)

    def observe(self, seconds: float, batch: int) -> None:
        self.seconds.observe(seconds)
        self.batch.observe(batch)


# Per-device gauges: (family suffix, its value from the device's status, help text).
_DEVICE_GAUGES: tuple[tuple[str, Callable[[dict], int], str], ...] = (
    ("ready", lambda d: int(d["ready"]), "1 while this device's engine is loaded, warmed up, alive and not stalled."),
    ("engine_stalled", lambda d: int(d["state"] == "stalled"),
     "1 while an engine call of this device is past the watchdog deadline."),
    ("sessions_live", lambda d: d["live_sessions"], "Sessions holding an admission slot of this device."),
    ("slots_free", lambda d: d["free_slots"], "Admission slots of this device still free."),
    ("max_sessions", lambda d: d["max_sessions"], "Admission capacity of this device."),
)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions_opened = 0
        self.sessions_refused = 0
        self.sessions_closed: dict[str, int] = defaultdict(int)  # by reason
        self.frames_in: dict[str, int] = defaultdict(int)  # by source: client | silence
        self.frames_out = 0
        self.frames_dropped = 0  # outputs of a cancelled epoch or a closed session
        self.errors: dict[str, int] = defaultdict(int)  # by code
        self.ticks = 0
        self.tick_stats = _TickStats()  # all devices
        self.device_ticks: dict[str, _TickStats] = defaultdict(_TickStats)
        # Reliability (docs/RELIABILITY.md).
        self.tick_failures: dict[str, int] = defaultdict(int)  # by scope: slots | batch
        self.tick_stalls = 0  # engine calls the watchdog found past their deadline
        self.connections_refused: dict[str, int] = defaultdict(int)  # before a session: by reason
        self.events_dropped = 0  # client events over the per-socket rate limit
        # Gauges read at scrape time from their owners.
        self.live_sessions: Callable[[], int] = lambda: 0
        self.free_slots: Callable[[], int] = lambda: 0
        self.max_sessions: Callable[[], int] = lambda: 0
        # One status dict per device (engine_pool.DeviceEngine.status).
        self.devices: Callable[[], list[dict]] = list
        self.ready: Callable[[], bool] = lambda: False
        self.engine_stalled: Callable[[], bool] = lambda: False
        self.draining: Callable[[], bool] = lambda: False
        self.loop_tasks: Callable[[], int] = lambda: 0

    def inc(self, name: str, label: str | None = None, n: int = 1) -> None:
        with self._lock:
            if label is None:
                setattr(self, name, getattr(self, name) + n)
            else:
                getattr(self, name)[label] += n

    def observe_tick(self, seconds: float, batch: int, silence_frames: int, device: str | None = None) -> None:
        with self._lock:
            self.ticks += 1
            self.tick_stats.observe(seconds, batch)
            if device is not None:
                self.device_ticks[device].observe(seconds, batch)
            self.frames_out += batch
            if silence_frames:
                self.frames_in["silence"] += silence_frames

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(samples)

            metric("personaplex_ready", "gauge", "1 once the engine is loaded and warmed up.",
                   [f"personaplex_ready {int(self.ready())}"])
            metric("personaplex_sessions_live", "gauge", "Sessions holding an admission slot.",
                   [f"personaplex_sessions_live {self.live_sessions()}"])
            metric("personaplex_slots_free", "gauge", "Admission slots still free.",
                   [f"personaplex_slots_free {self.free_slots()}"])
            metric("personaplex_max_sessions", "gauge", "Admission capacity (all devices).",
                   [f"personaplex_max_sessions {self.max_sessions()}"])
            metric("personaplex_sessions_opened_total", "counter", "Sessions opened.",
                   [f"personaplex_sessions_opened_total {self.sessions_opened}"])
            metric("personaplex_sessions_refused_total", "counter", "Opens refused with resource_exhausted.",
                   [f"personaplex_sessions_refused_total {self.sessions_refused}"])
            metric("personaplex_sessions_closed_total", "counter", "Sessions closed, by reason.",
                   _labelled("personaplex_sessions_closed_total", "reason", self.sessions_closed))
            metric("personaplex_ticks_total", "counter", "Lockstep ticks run.", [f"personaplex_ticks_total {self.ticks}"])
            metric("personaplex_tick_duration_seconds", "histogram", "Engine time of one batched tick.",
                   self.tick_stats.seconds.lines("personaplex_tick_duration_seconds"))
            metric("personaplex_batch_size", "histogram", "Sessions advanced per tick.",
                   self.tick_stats.batch.lines("personaplex_batch_size"))
            metric("personaplex_frames_in_total", "counter", "80 ms input frames stepped, by source.",
                   _labelled("personaplex_frames_in_total", "source", self.frames_in))
            metric("personaplex_frames_out_total", "counter", "80 ms output frames produced.",
                   [f"personaplex_frames_out_total {self.frames_out}"])
            metric("personaplex_frames_dropped_total", "counter",
                   "Output frames dropped (cancelled epoch or closed session).",
                   [f"personaplex_frames_dropped_total {self.frames_dropped}"])
            metric("personaplex_errors_total", "counter", "Error events sent, by code.",
                   _labelled("personaplex_errors_total", "code", self.errors))
            self._render_reliability(metric)
            self._render_devices(metric)
            return "\n".join(lines) + "\n"

    def _render_devices(self, metric: Callable[[str, str, str, list[str]], None]) -> None:
        """The ``personaplex_device_*`` families: one series per device (label ``device``)."""
        devices = self.devices()
        for suffix, value, help_text in _DEVICE_GAUGES:
            name = f"personaplex_device_{suffix}"
            metric(name, "gauge", help_text, [f'{name}{{device="{_escape(d["device"])}"}} {value(d)}' for d in devices])
        for d in devices:  # every device has its histograms, even before its first tick
            self.device_ticks[d["device"]]
        ticks = sorted(self.device_ticks.items())
        for name, help_text, pick in (
            ("personaplex_device_tick_duration_seconds", "Engine time of one batched tick, per device.",
             lambda stats: stats.seconds),
            ("personaplex_device_batch_size", "Sessions advanced per tick, per device.", lambda stats: stats.batch),
        ):
            samples = [line for device, stats in ticks
                       for line in pick(stats).lines(name, f'device="{_escape(device)}"')]
            metric(name, "histogram", help_text, samples)

    def _render_reliability(self, metric: Callable[[str, str, str, list[str]], None]) -> None:
        metric("personaplex_tick_failures_total", "counter",
               "Ticks where engine.step raised, by scope (slots: only named sessions failed; batch: all of the tick).",
               _labelled("personaplex_tick_failures_total", "scope", self.tick_failures))
        metric("personaplex_connections_refused_total", "counter",
               "Websockets refused before a session, by reason (auth, origin, limits, shutdown, stalled).",
               _labelled("personaplex_connections_refused_total", "reason", self.connections_refused))
        for name, kind, help_text, value in (
            ("personaplex_tick_stalls_total", "counter", "Engine calls that ran past the watchdog deadline.",
             self.tick_stalls),
            ("personaplex_engine_stalled", "gauge", "1 while an engine call is past the watchdog deadline.",
             int(self.engine_stalled())),
            ("personaplex_draining", "gauge", "1 once shutdown has begun (new opens refused).", int(self.draining())),
            ("personaplex_events_dropped_total", "counter", "Client events dropped by the per-socket rate limits.",
             self.events_dropped),
            ("personaplex_event_loop_tasks", "gauge", "asyncio tasks alive on the server's event loop.",
             self.loop_tasks()),
        ):
            metric(name, kind, help_text, [f"{name} {value}"])


def _labelled(name: str, label: str, values: dict[str, int]) -> list[str]:
    return [f'{name}{{{label}="{_escape(key)}"}} {values[key]}' for key in sorted(values)]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value))
