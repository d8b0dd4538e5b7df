"""The tick policies (orchestrator/lockstep/tick_policy.py) as pure functions: single decisions, and a
simulated minute of paced clients at random phases against a tick-cost model (no threads, no
sleeps, a virtual clock), which shows what each policy does to batch size and engine load."""

from __future__ import annotations

import random
import statistics

import pytest

from orchestrator.lockstep.tick_policy import PacedPolicy, TickState, WindowPolicy, make_policy

INF = float("-inf")


def state(now: float, live: int, ready: int, oldest: float | None = None, last_take: float = INF,
          tick_s: float = 0.0) -> TickState:
    return TickState(now, live, ready, oldest if oldest is not None or not ready else now, last_take, tick_s)


def test_window_policy():
    policy = WindowPolicy(0.02)
    assert not policy.decide(state(1.0, 3, 0)).tick and policy.decide(state(1.0, 3, 0)).wait_s is None
    assert policy.decide(state(1.0, 3, 3, oldest=1.0)).tick  # everyone has a frame
    waiting = policy.decide(state(1.005, 3, 1, oldest=1.0))
    assert not waiting.tick and waiting.wait_s == pytest.approx(0.015)
    assert policy.decide(state(1.02, 3, 1, oldest=1.0)).tick  # the window is over
    assert policy.decide(state(1.001, 3, 1, oldest=0.99, last_take=0.995)).tick  # behind: queued at the last take


def test_paced_policy_interval_follows_the_tick_time():
    policy = PacedPolicy(0.02, busy_target=0.5)
    assert policy.interval(0.0) == 0.02  # at least the shortest interval
    assert policy.interval(0.03) == pytest.approx(0.06)  # 30 ms ticks, half busy: one per 60 ms
    assert policy.interval(0.06) == 0.08  # never longer than a frame period
    # 1 of 3 lanes ready, 30 ms ticks: the next tick is due 60 ms after the previous take
    decision = policy.decide(state(1.01, 3, 1, oldest=1.005, last_take=1.0, tick_s=0.03))
    assert not decision.tick and decision.wait_s == pytest.approx(0.05)
    assert policy.decide(state(1.06, 3, 1, oldest=1.005, last_take=1.0, tick_s=0.03)).tick
    assert policy.decide(state(1.01, 3, 3, oldest=1.005, last_take=1.0, tick_s=0.03)).tick  # everyone: now
    assert policy.decide(state(5.0, 3, 1, oldest=5.0, last_take=1.0, tick_s=0.03)).tick  # idle a while: now
    assert not policy.decide(state(1.01, 3, 0, last_take=1.0)).tick


def test_paced_policy_lets_a_backlog_drain():
    # 60 ms ticks at a 0.7 target: the interval is the whole period, so a lane one frame behind
    # would never catch up at one frame per interval; a frame a period old ticks at once
    policy = PacedPolicy(0.02, busy_target=0.7)
    assert policy.interval(0.06) == 0.08
    assert policy.decide(state(1.05, 3, 1, oldest=0.97, last_take=1.0, tick_s=0.06)).tick
    assert not policy.decide(state(1.05, 3, 1, oldest=0.98, last_take=1.0, tick_s=0.06)).tick


def test_make_policy_names():
    assert isinstance(make_policy("window", min_wait_s=0.02, busy_target=0.7), WindowPolicy)
    assert make_policy("paced", min_wait_s=0.01, busy_target=0.6) == PacedPolicy(0.01, 0.6)
    with pytest.raises(ValueError, match="unknown tick policy"):
        make_policy("greedy", min_wait_s=0.02, busy_target=0.7)


def simulate(policy, sessions: int, *, seconds: float = 20.0, fixed_ms: float = 14.0, per_session_ms: float = 0.28,
             seed: int = 3) -> dict[str, float]:
    """Paced clients at random phases; a tick of B sessions costs fixed + B x per_session (the
    H200's full-window tick is about 10 + 0.28 B ms in the benchmark, ~14 ms fixed in the
    server).  Returns ticks per second, mean batch, engine busy fraction, latency p50/p99."""
    rng = random.Random(seed)
    period = 0.08
    frames = int(seconds / period)
    arrivals: list[tuple[float, int]] = []
    for lane in range(sessions):
        phase = rng.random() * period
        arrivals += [(phase + k * period, lane) for k in range(frames)]
    arrivals.sort()
    queues: list[list[float]] = [[] for _ in range(sessions)]
    t, nxt, last_take, tick_s = 0.0, 0, INF, 0.0
    batches: list[int] = []
    latencies: list[float] = []
    busy = 0.0
    while nxt < len(arrivals) or any(queues):
        while nxt < len(arrivals) and arrivals[nxt][0] <= t:
            queues[arrivals[nxt][1]].append(arrivals[nxt][0])
            nxt += 1
        ready = [q for q in queues if q]
        oldest = min(q[0] for q in ready) if ready else None
        decision = policy.decide(TickState(t, sessions, len(ready), oldest, last_take, tick_s))
        if decision.tick:
            cost = (fixed_ms + per_session_ms * len(ready)) / 1000.0
            last_take = t
            latencies += [t + cost - q.pop(0) for q in ready]
            t += cost
            busy += cost
            tick_s = cost if not batches else 0.2 * cost + 0.8 * tick_s
            batches.append(len(ready))
            continue
        upcoming = arrivals[nxt][0] if nxt < len(arrivals) else t + 1.0
        # a real clock always moves on; the virtual one steps at least a microsecond
        t = upcoming if decision.wait_s is None else min(upcoming, t + max(decision.wait_s, 1e-6))
    latencies.sort()
    assert len(latencies) == sessions * frames  # every frame was stepped exactly once
    return {"ticks_per_s": len(batches) / seconds, "mean_batch": statistics.mean(batches), "busy": busy / seconds,
            "p50_ms": latencies[len(latencies) // 2] * 1e3, "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3}


def test_paced_ticks_grow_the_batch_and_leave_headroom_at_128_sessions():
    window = simulate(WindowPolicy(0.02), 128)
    paced = simulate(PacedPolicy(0.02, 0.7), 128)
    # The window policy runs ticks back to back on whatever arrived meanwhile: the engine is
    # never idle and every tick re-pays the fixed cost.
    assert window["busy"] > 0.95 and window["ticks_per_s"] > 35
    # Paced: about 70 % busy in ticks over twice as large, still within a frame of latency.
    assert 0.6 < paced["busy"] < 0.8
    assert paced["mean_batch"] > 2 * window["mean_batch"] and paced["ticks_per_s"] < 25
    assert paced["p99_ms"] < 100


def test_one_session_ticks_the_moment_its_frame_arrives():
    for policy in (WindowPolicy(0.02), PacedPolicy(0.02, 0.7)):
        alone = simulate(policy, 1, seconds=4.0)
        assert alone["ticks_per_s"] == pytest.approx(12.5)
        assert alone["p99_ms"] == pytest.approx(14.28, abs=0.01)  # the tick's own cost, no waiting


def test_light_load_latency_is_the_same_order():
    window = simulate(WindowPolicy(0.02), 16)
    paced = simulate(PacedPolicy(0.02, 0.7), 16)
    assert paced["p50_ms"] < window["p50_ms"] + 10 and paced["p99_ms"] < window["p99_ms"] + 10


def test_settings_check_the_policy():
    from orchestrator.settings import Settings, SettingsError

    assert Settings().tick_policy_object() == PacedPolicy(0.02, 0.7)  # the default (docs/PERFORMANCE.md, why)
    assert Settings.from_mapping({"tick_policy": "paced", "tick_busy_target": "0.5"}).tick_policy_object() == \
        PacedPolicy(0.02, 0.5)
    assert Settings.from_mapping({"tick_policy": "window"}).tick_policy_object() == WindowPolicy(0.02)
    for bad in ({"tick_policy": "greedy"}, {"tick_busy_target": "0"}, {"tick_busy_target": "1.5"}):
        with pytest.raises(SettingsError, match="PERSONAPLEX_TICK"):
            Settings.from_mapping(bad)
