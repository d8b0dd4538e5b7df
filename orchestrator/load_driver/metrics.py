"""Pure statistics of one recorded session: no sockets, no clocks, no numpy scalars out.

Inputs are plain lists from the client's monotonic clock:
- packet timeline: arrival time (s) and PCM16 sample count of every non-empty, valid audio
  packet, in arrival order;
- send timeline: ``(planned, started, completed)`` times of every input frame sent.

Every function returns ``None`` for a value that cannot be computed from what it was given
(never 0, which would read as a measurement).  The definitions are the reference driver's
(spec §7.4), restated in each docstring, so our numbers compare with published ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .wire import FRAME_PERIOD_S, FRAME_SAMPLES, SAMPLE_RATE_HZ

# A player that starts this long after its first buffered packet (a small jitter buffer).
PLAYOUT_START_DELAY_S = 0.120
# An underrun longer than this is audible (continuity threshold of the reference benchmark).
CONTINUITY_THRESHOLD_S = 0.1
# Float noise, not starvation: arrival arithmetic on exact 80 ms steps can leave ~1e-17 s.
_EPSILON_S = 1e-9

Send = tuple[float, float, float]  # (planned, started, completed), seconds


# Distributions -------------------------------------------------------------------------------

def percentile_linear(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) by linear interpolation between the two closest ranks:
    position ``q * (n - 1)`` in the sorted values (numpy's default "linear" method)."""
    if not values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(float(v) for v in values)
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (position - lower) * (ordered[upper] - ordered[lower])


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{count, median, p99, max, argmax_index}``; the p99 is linear-interpolated and
    ``argmax_index`` is the first index holding the maximum.  Empty: count 0, the rest null."""
    if not values:
        return {"count": 0, "median": None, "p99": None, "max": None, "argmax_index": None}
    floats = [float(v) for v in values]
    peak = max(floats)
    return {
        "count": len(floats),
        "median": percentile_linear(floats, 0.5),
        "p99": percentile_linear(floats, 0.99),
        "max": peak,
        "argmax_index": floats.index(peak),
    }


# Client-side timing ---------------------------------------------------------------------------

def packet_intervals_ms(arrivals: Sequence[float]) -> list[float]:
    """Gaps between consecutive audio packet arrivals, ms."""
    return [(b - a) * 1000.0 for a, b in zip(arrivals, arrivals[1:])]


def longest_gap_ms(arrivals: Sequence[float]) -> float | None:
    """The longest time between two consecutive output packets, ms (what a listener's jitter
    buffer must cover); None with fewer than two packets."""
    if len(arrivals) < 2:
        return None
    return max(b - a for a, b in zip(arrivals, arrivals[1:])) * 1000.0


def send_lateness_ms(sends: Sequence[Send]) -> list[float]:
    """How late each send started against its planned grid time, ms (early counts as 0)."""
    return [max(0.0, started - planned) * 1000.0 for planned, started, _ in sends]


def grid_restarts(sends: Sequence[Send], dues: Sequence[float]) -> int:
    """How often the send grid restarted after a stall of more than a frame (each restart
    shifts every later planned-vs-sent lateness by the stall; see ``pacing``)."""
    offsets = [due - planned for (planned, _, _), due in zip(sends, dues)]
    return sum(1 for a, b in zip(offsets, offsets[1:]) if b - a > _EPSILON_S)


def pacing_warning(lateness: dict[str, float | int | None]) -> bool | None:
    """True when the send-lateness p99 exceeds one frame: the client could not keep real
    time, so the run measures the client as much as the server."""
    p99 = lateness.get("p99")
    return None if p99 is None else p99 > FRAME_PERIOD_S * 1000.0


def first_after_ms(first_at: float | None, stream_start: float | None) -> float | None:
    """``first_at - stream_start`` in ms (negative if it came before the stream started)."""
    if first_at is None or stream_start is None:
        return None
    return (first_at - stream_start) * 1000.0


def client_stream_rtf(arrivals: Sequence[float], samples: Sequence[int],
                      first_send_start: float | None) -> float | None:
    """(last audio receipt - first send start) / seconds of audio received.

    Below 1 the audio arrived faster than it plays; it includes the first-audio latency, so it
    tends to 1 from above for a real-time server on long runs."""
    total = sum(samples)
    if not arrivals or not total or first_send_start is None:
        return None
    return (arrivals[-1] - first_send_start) / (total / SAMPLE_RATE_HZ)


# Playback simulations ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Continuity:
    max_underrun_s: float
    underrun_event_count: int
    is_continuous: bool


def continuity(arrivals: Sequence[float], samples: Sequence[int],
               threshold_s: float = CONTINUITY_THRESHOLD_S) -> Continuity | None:
    """A player that starts at the first packet with no buffer and plays in real time.

    When packet i arrives, (arrival_i - arrival_0) seconds should have played, but only the
    audio of packets 0..i-1 was there; the shortfall is the underrun at that moment.  Reports
    the worst shortfall, how many packets arrived into one (one event per gap), and whether the
    worst stayed within ``threshold_s``.  The player does not pause, so shortfalls accumulate
    over a run that is slower than real time."""
    if not arrivals:
        return None
    if len(arrivals) != len(samples):
        raise ValueError("arrivals and samples differ in length")
    worst, events, received = 0.0, 0, 0
    for i, (arrival, n) in enumerate(zip(arrivals, samples)):
        if i:
            shortfall = (arrival - arrivals[0]) - received / SAMPLE_RATE_HZ
            if shortfall > _EPSILON_S:
                worst = max(worst, shortfall)
                events += 1
        received += n
    return Continuity(worst, events, worst <= threshold_s)


def playout_stall_ms(arrivals: Sequence[float], samples: Sequence[int], start_packet: int,
                     start_delay_s: float = PLAYOUT_START_DELAY_S) -> float | None:
    """Total time a pausing player stalls.

    The player starts ``start_delay_s`` after packet ``start_packet`` (the last one if there
    are fewer) arrived.  A packet's first sample is due when everything before it has played
    (start + stalls so far + audio before it); if the packet arrives later, the player stalls
    for the difference and resumes."""
    if not arrivals:
        return None
    start = arrivals[min(start_packet, len(arrivals) - 1)] + start_delay_s
    stalled, played = 0.0, 0
    for arrival, n in zip(arrivals, samples):
        due = start + stalled + played / SAMPLE_RATE_HZ
        if arrival - due > _EPSILON_S:
            stalled += arrival - due
        played += n
    return stalled * 1000.0


# Stream timing against the input ---------------------------------------------------------------

def least_squares_slope(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Slope of the least-squares line through (x, y); None if x has no spread."""
    if len(x) != len(y) or len(x) < 2:
        return None
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx = xs - xs.mean()
    spread = float(np.sum(dx * dx))
    if spread <= 0.0:
        return None
    return float(np.sum(dx * (ys - ys.mean())) / spread)


def frame_completions(arrivals: Sequence[float], samples: Sequence[int],
                      input_frames: int) -> tuple[list[float], list[int]]:
    """When each output frame k (k < input_frames) completed, i.e. when the cumulative samples
    first reached (k + 1) * 1920; and the index of the last frame each packet completed."""
    completed: list[float] = []
    edges: list[int] = []
    total = 0
    for arrival, n in zip(arrivals, samples):
        total += n
        frames = min(total // FRAME_SAMPLES, input_frames)
        if frames > len(completed):
            completed.extend([arrival] * (frames - len(completed)))
            edges.append(frames - 1)
    return completed, edges


def frames_completed_after(arrivals: Sequence[float], samples: Sequence[int], first_frame: int,
                           after: float) -> int:
    """Output frames with index >= ``first_frame`` that completed after time ``after``.

    In lockstep output frame k answers input frame k, so frames past the input's count that
    arrive after the last input frame was sent can only come from silence the server fed
    itself; frames past the count that arrive earlier are surplus output."""
    total, count = 0, 0
    for arrival, n in zip(arrivals, samples):
        before, total = total, total + n
        if arrival > after:
            lo, hi = max(before // FRAME_SAMPLES, first_frame), total // FRAME_SAMPLES
            count += max(0, hi - lo)
    return count


def stream_lags_ms(arrivals: Sequence[float], samples: Sequence[int], sends: Sequence[Send]) -> list[float]:
    """Per output frame k (k < input frames): its completion minus (the send completion of
    input frame k + 80 ms), ms.  A lockstep server that answers each frame the moment it
    arrives scores its own processing time; a server falling behind scores a rising line."""
    completed, _ = frame_completions(arrivals, samples, len(sends))
    return _lags_ms(completed, sends)


def _lags_ms(completed: Sequence[float], sends: Sequence[Send]) -> list[float]:
    return [(done - sends[k][2] - FRAME_PERIOD_S) * 1000.0 for k, done in enumerate(completed)]


def stream_timing(arrivals: Sequence[float], samples: Sequence[int], sends: Sequence[Send]) -> dict[str, object]:
    """Output timing against the actual sends.

    Output frame k's reference time is the send completion of input frame k plus 80 ms (the
    earliest a lockstep server can have stepped it).  ``stream_lag_ms`` is completion minus
    reference over all frames.  ``server_stream_rtf`` is the least-squares slope of completion
    against reference over the frames of the 10-90 % window, using only the last frame each
    packet completes (so multi-frame packets do not bias it); 1 keeps pace, above 1 falls
    behind.  ``stream_lag_drift_ms`` is (slope - 1) times the window's reference span.  The
    strict player starts 120 ms after the first packet, the steady one after the second."""
    completed, edges = frame_completions(arrivals, samples, len(sends))
    references = [sends[k][2] + FRAME_PERIOD_S for k in range(len(completed))]
    lo, hi = int(len(completed) * 0.1), math.ceil(len(completed) * 0.9)
    window = [k for k in edges if lo <= k < hi]
    rtf = drift_ms = None
    if len(window) >= 2:
        x = [references[k] - references[window[0]] for k in window]
        y = [completed[k] - completed[window[0]] for k in window]
        rtf = least_squares_slope(x, y)
        if rtf is not None:
            drift_ms = (rtf - 1.0) * x[-1] * 1000.0
    strict = playout_stall_ms(arrivals, samples, 0)
    steady = playout_stall_ms(arrivals, samples, 1)
    return {
        "server_stream_rtf": rtf,
        "stream_lag_drift_ms": drift_ms,
        "stream_lag_ms": distribution(_lags_ms(completed, sends)),
        "playout_stall_ms": strict,
        "playout_stalled": None if strict is None else strict > 0.0,
        "steady_playout_stall_ms": steady,
        "steady_playout_stalled": None if steady is None else steady > 0.0,
    }
