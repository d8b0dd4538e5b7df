"""The server's Prometheus metrics, on ``prometheus_client``.

Several processes serve one server: front-end workers (sessions, errors, refusals, frame
latency, event-loop lag), engine processes (ticks, batch sizes, frames, tick failures,
stalls) and the engine host (engine restarts).  ``prometheus_client``'s multiprocess mode
is made for that: each process writes its own values to files in the server's run directory
(``ipc/endpoints.metrics_dir``) and the worker that answers ``/metrics`` sums them.  What
every worker knows alike (admission, readiness and state per device, from the engines'
heartbeats) is read at scrape time from that worker's own view (``gauges``).

Without a directory (unit tests, tools that drive a scheduler themselves) each ``Metrics`` has
its own registry in memory, and nothing is written to disk.

The multiprocess directory must be known before ``prometheus_client`` is first imported in a
process (it picks its value store then): ``Metrics(multiprocess_dir=...)`` sets it, and
nothing else in the server imports the library earlier.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.32, 0.64, 1.28)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A frame's arrival at the socket to its output frame leaving it: one period is the floor.
FRAME_LATENCY_BUCKETS_S = (0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
# How long the event loop's own work held it past a 50 ms beat (frontend/loop_watch.py).
LOOP_BLOCKED_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PROTOCOLS = ("realtime", "native")  # the websocket protocols sessions are counted by

# Counters: Metrics.inc name -> (family without _total, help, label names).
_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sessions_opened": ("personaplex_sessions_opened", "Sessions opened, by protocol (realtime, native).",
                        ("protocol",)),
    "sessions_refused": ("personaplex_sessions_refused", "Opens refused with resource_exhausted.", ()),
    "sessions_closed": ("personaplex_sessions_closed", "Sessions closed, by protocol and reason.",
                        ("protocol", "reason")),
    "frames_in": ("personaplex_frames_in", "80 ms input frames stepped, by source.", ("source",)),
    "frames_out": ("personaplex_frames_out", "80 ms output frames produced.", ()),
    "frames_dropped": ("personaplex_frames_dropped", "Output frames dropped (cancelled epoch or closed session).",
                       ()),
    "errors": ("personaplex_errors", "Error events (native: error messages) sent, by code.", ("code",)),
    "tick_failures": ("personaplex_tick_failures", "Ticks where engine.step raised, by scope (slots: only named "
                      "sessions failed; batch: all of the tick).", ("scope",)),
    "tick_stalls": ("personaplex_tick_stalls", "Engine calls that ran past the watchdog deadline.", ()),
    "connections_refused": ("personaplex_connections_refused", "Websockets refused before a session, by reason "
                            "(auth, origin, limits, shutdown, stalled).", ("reason",)),
    "events_dropped": ("personaplex_events_dropped", "Client events dropped by the per-socket rate limits.", ()),
    "native_messages_dropped": ("personaplex_native_messages_dropped", "Messages of /api/chat clients dropped, by "
                                "reason (empty, unknown_kind, unexpected_kind, text_frame, oversize, rate).",
                                ("reason",)),
    "open_failures": ("personaplex_open_failures", "Opens the engine failed (the session got a typed error, its "
                      "slot is free again), by reason (out_of_memory and join_wait_timeout: retryable; engine_error).",
                      ("reason",)),
    "engine_restarts": ("personaplex_engine_restarts", "Engine processes that ended and were started again, by "
                        "device.", ("device",)),
}

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
    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        if multiprocess_dir is not None:
            os.environ[MULTIPROC_ENV] = str(multiprocess_dir)
        import prometheus_client as prom
        from prometheus_client import values

        prom.disable_created_metrics()
        self.multiprocess_dir = multiprocess_dir
        if multiprocess_dir is not None and values.ValueClass.__name__ == "MutexValue":
            raise RuntimeError("prometheus_client was imported before its multiprocess directory was set")
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._counters = {name: prom.Counter(family, help_text, list(labels), registry=reg)
                          for name, (family, help_text, labels) in _COUNTERS.items()}
        self._ticks = prom.Counter("personaplex_ticks", "Lockstep ticks run.", registry=reg)
        self._tick_seconds = prom.Histogram("personaplex_tick_duration_seconds", "Engine time of one batched tick.",
                                            buckets=TICK_BUCKETS_S, registry=reg)
        self._batch = prom.Histogram("personaplex_batch_size", "Sessions advanced per tick.", buckets=BATCH_BUCKETS,
                                     registry=reg)
        self._device_tick_seconds = prom.Histogram(
            "personaplex_device_tick_duration_seconds", "Engine time of one batched tick, per device.", ["device"],
            buckets=TICK_BUCKETS_S, registry=reg)
        self._device_batch = prom.Histogram("personaplex_device_batch_size", "Sessions advanced per tick, per device.",
                                            ["device"], buckets=BATCH_BUCKETS, registry=reg)
        self._engine_job_seconds = prom.Histogram(
            "personaplex_engine_job_duration_seconds", "Engine time of one piece of control work run between ticks "
            "(live sessions wait for it), by kind: open (a chunk of a joining session's prefill, or its install), "
            "restart, close (every close queued at the time, in one call).", ["kind"], buckets=TICK_BUCKETS_S,
            registry=reg)
        self._engine_job_own_seconds = prom.Histogram(
            "personaplex_engine_job_own_seconds", "The same pieces of control work, less the time the engine "
            "thread waited for a CPU (other processes on the host): what the work itself held the ticks for.",
            ["kind"], buckets=TICK_BUCKETS_S, registry=reg)
        self._frame_latency = prom.Histogram(
            "personaplex_frame_latency_seconds", "A client frame's arrival at the socket to its output frame "
            "leaving the socket, per device and protocol (realtime, native).", ["device", "protocol"],
            buckets=FRAME_LATENCY_BUCKETS_S, registry=reg)
        self._sessions_active = prom.Gauge(
            "personaplex_sessions_active", "Sessions open on the front-end workers, by protocol (realtime, native).",
            ["protocol"], registry=reg, multiprocess_mode="livesum")
        # Declared by the front-end workers only (declare_worker): one series per worker.
        self._worker_sessions: Any = None
        self._opus_cpu = prom.Counter(
            "personaplex_opus_cpu_seconds", "CPU time of the workers' Opus threads (their own thread time), by "
            "direction (encode: the model's frames, decode: the clients' pages).", ["direction"], registry=reg)
        self._opus_queue = prom.Gauge(
            "personaplex_opus_queue_frames", "Frames asked of a worker's Opus encoding threads and not yet handed "
            "back, the busiest worker's (sampled at each hand-back).", registry=reg, multiprocess_mode="livemax")
        self._loop_lag = prom.Histogram(
            "personaplex_event_loop_lag_seconds", "How late a front-end worker's event loop ran a timer due now "
            "(sampled twice a second per worker).", buckets=LOOP_LAG_BUCKETS_S, registry=reg)
        self._loop_blocked = prom.Histogram(
            "personaplex_event_loop_blocked_seconds", "How long past a due timer a front-end worker's event loop "
            "was held by its own work or waits (a blocking call, a lock, the interpreter lock), less the time its "
            "thread waited for a CPU: what the worker's code blocked every session of the worker for, whatever "
            "else the host runs (every 50 ms per worker).", buckets=LOOP_BLOCKED_BUCKETS_S, registry=reg)
        self._loop_tasks = prom.Gauge("personaplex_event_loop_tasks", "asyncio tasks alive on the front-end "
                                      "workers' event loops (all workers).", registry=reg, multiprocess_mode="livesum")
        self._batch_fill = prom.Gauge("personaplex_device_batch_fill", "Sessions advanced by the device's latest "
                                      "tick over its live sessions (1 = one tick serves everyone).", ["device"],
                                      registry=reg, multiprocess_mode="livemax")
        self._declared = [m for metric in (*self._counters.values(), self._ticks, self._tick_seconds, self._batch,
                                           self._device_tick_seconds, self._device_batch, self._engine_job_seconds,
                                           self._engine_job_own_seconds,
                                           self._frame_latency, self._sessions_active,
                                           self._opus_cpu, self._opus_queue, self._loop_lag, self._loop_blocked, self._loop_tasks, self._batch_fill)
                          for m in metric.describe()]
        for protocol in PROTOCOLS:  # listed from the start, as the unlabelled counters are
            self._counters["sessions_opened"].labels(protocol)
            self._sessions_active.labels(protocol)
        for direction in ("encode", "decode"):
            self._opus_cpu.labels(direction)
        # Gauges read at scrape time from this worker's view of the engines.
        self.live_sessions: Callable[[], int] = lambda: 0
        self.free_slots: Callable[[], int] = lambda: 0
        self.max_sessions: Callable[[], int] = lambda: 0
        self.devices: Callable[[], list[dict]] = list  # one status dict per device (DeviceEngine.status)
        self.ready: Callable[[], bool] = lambda: False
        self.engine_stalled: Callable[[], bool] = lambda: False
        self.draining: Callable[[], bool] = lambda: False
        self.registry.register(_ScrapeGauges(self))

    # Recording ----------------------------------------------------------------------------------
    def inc(self, name: str, label: str | tuple[str, ...] | None = None, n: int = 1) -> None:
        """Add ``n`` to a counter; ``label``: its label value, or values in declared order."""
        counter = self._counters[name]
        if label is None:
            counter.inc(n)
        else:
            counter.labels(*((label,) if isinstance(label, str) else label)).inc(n)

    def observe_tick(self, seconds: float, batch: int, silence_frames: int, device: str | None = None,
                     live: int | None = None) -> None:
        self._ticks.inc()
        self._tick_seconds.observe(seconds)
        self._batch.observe(batch)
        if device is not None:
            self._device_tick_seconds.labels(device).observe(seconds)
            self._device_batch.labels(device).observe(batch)
            if live:
                self._batch_fill.labels(device).set(batch / live)
        self._counters["frames_out"].inc(batch)
        if silence_frames:
            self._counters["frames_in"].labels("silence").inc(silence_frames)

    def observe_engine_job(self, kind: str, seconds: float, own_seconds: float) -> None:
        """One piece of control work between ticks (``kind``: open, restart, close): its wall
        time, and that less the engine thread's waits for a CPU (``own_clock``)."""
        self._engine_job_seconds.labels(kind).observe(seconds)
        self._engine_job_own_seconds.labels(kind).observe(own_seconds)

    def declare_device(self, device: str) -> None:
        """List a device's histograms before its first tick."""
        self._device_tick_seconds.labels(device)
        self._device_batch.labels(device)
        for protocol in PROTOCOLS:
            self._frame_latency.labels(device, protocol)

    def observe_frame_latency(self, device: str, protocol: str, seconds: float) -> None:
        self._frame_latency.labels(device, protocol).observe(seconds)

    def declare_worker(self) -> None:
        """This process is a front-end worker: list its own session count (0 until one opens),
        so that the busiest worker's share counts the idle ones."""
        if self._worker_sessions is None:
            self._worker_sessions = self._prom.Gauge(
                "personaplex_worker_sessions", "Sessions open on each front-end worker (one series per worker "
                "pid; the busiest worker's share is max over mean).", registry=self.registry,
                multiprocess_mode="liveall")
            self._declared.extend(self._worker_sessions.describe())

    def session_count(self, protocol: str, delta: int) -> None:
        """A session of ``protocol`` opened (+1) or closed (-1) on this worker."""
        self._sessions_active.labels(protocol).inc(delta)
        self.declare_worker()
        self._worker_sessions.inc(delta)

    def observe_opus(self, direction: str, cpu_seconds: float) -> None:
        """CPU time an Opus thread spent on a batch."""
        self._opus_cpu.labels(direction).inc(cpu_seconds)

    def opus_queue(self, frames: int) -> None:
        """Frames asked of this worker's encoding threads and not yet handed back."""
        self._opus_queue.set(frames)

    def observe_loop(self, lag_s: float, tasks: int) -> None:
        self._loop_lag.observe(lag_s)
        self._loop_tasks.set(tasks)

    def observe_loop_blocked(self, seconds: float) -> None:
        self._loop_blocked.observe(seconds)

    # Exposition ---------------------------------------------------------------------------------
    def render(self) -> str:
        prom = self._prom
        if self.multiprocess_dir is None:
            return prom.generate_latest(self.registry).decode()
        from prometheus_client import multiprocess

        registry = prom.CollectorRegistry()
        registry.register(_Merged(multiprocess.MultiProcessCollector(None, path=str(self.multiprocess_dir)),
                                  self._declared))
        registry.register(_ScrapeGauges(self))
        return prom.generate_latest(registry).decode()


def mark_process_dead(pid: int) -> None:
    """Forget a dead process's live gauges (its counters stay in the sums)."""
    directory = os.environ.get(MULTIPROC_ENV)
    if directory and "prometheus_client" in sys.modules:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)


class _Merged:
    """The sums over every process's files, with each family's own help text, and every
    declared family listed even before any process has a value for it (as in one process)."""

    def __init__(self, collector: Any, declared: list) -> None:
        self._collector = collector
        self._declared = declared

    def collect(self) -> Any:
        help_of = {m.name: m.documentation for m in self._declared}
        seen = set()
        for family in self._collector.collect():
            family.documentation = help_of.get(family.name, family.documentation)
            seen.add(family.name)
            yield family
        for empty in self._declared:
            if empty.name not in seen:
                yield empty


class _ScrapeGauges:
    """The gauges a worker reads from its own view at scrape time (not stored in files)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []  # collected only at scrape time: no fixed description

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        m = self._metrics
        for name, help_text, value in (
            ("personaplex_ready", "1 once the engine is loaded and warmed up.", int(m.ready())),
            ("personaplex_sessions_live", "Sessions holding an admission slot.", m.live_sessions()),
            ("personaplex_slots_free", "Admission slots still free.", m.free_slots()),
            ("personaplex_max_sessions", "Admission capacity (all devices).", m.max_sessions()),
            ("personaplex_engine_stalled", "1 while an engine call is past the watchdog deadline.",
             int(m.engine_stalled())),
            ("personaplex_draining", "1 once shutdown has begun (new opens refused).", int(m.draining())),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        devices = m.devices()
        for suffix, value_of, help_text in _DEVICE_GAUGES:
            family = GaugeMetricFamily(f"personaplex_device_{suffix}", help_text, labels=["device"])
            for d in devices:
                family.add_metric([d["device"]], value_of(d))
            yield family
