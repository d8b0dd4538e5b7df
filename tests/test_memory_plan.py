"""The engine's device-memory plan (issue 34): its arithmetic, its figures against what the
real engine allocates on the tiny model, and what it decides (auto) or refuses (one line)."""

from __future__ import annotations

import gc
from dataclasses import replace
import warnings

import pytest
import torch

from engines.errors import MemoryPlanError
from engines.runtime.factory import create_engine
from engines.runtime.memory_plan import MemoryPlan, PlanItem, choose_kv_cache, choose_sessions
from engines.spec import GIB, MemorySettings

MIB = 1 << 20


def _plan(device_bytes: int, per_session: int, **items: int) -> MemoryPlan:
    return MemoryPlan("cuda:0", device_bytes, 0, per_session,
                      tuple(PlanItem(name, size, "setting") for name, size in items.items()))


def test_the_plan_fits_sessions_beside_its_items():
    plan = _plan(100 * GIB, GIB, weights=16 * GIB, joins=2 * GIB, margin=GIB)
    # 100 - 19 = 81 GiB for the sessions and the scratch slot: 80 sessions.
    assert plan.largest_fit() == 80
    assert choose_sessions(plan, None, "PERSONAPLEX_MAX_SESSIONS").sessions == 80
    assert choose_sessions(plan, 80, "PERSONAPLEX_MAX_SESSIONS").fits
    with pytest.raises(MemoryPlanError) as refused:
        choose_sessions(plan, 81, "PERSONAPLEX_MAX_SESSIONS")
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("PERSONAPLEX_MAX_SESSIONS=81 does not fit the memory of cuda:0: set it to 80 or less")
    assert "joins 2.00 GiB" in line and "of 100.00 GiB" in line
    tiny = _plan(GIB, GIB, weights=GIB)
    with pytest.raises(MemoryPlanError, match="auto: not even one session fits"):
        choose_sessions(tiny, None, "PERSONAPLEX_MAX_SESSIONS")
    lines = choose_sessions(plan, None, "x").lines()
    assert len(lines) == 1 + 1 + 3 and lines[0].startswith("memory plan (estimate) for 80 sessions on cuda:0")
    assert choose_sessions(plan, None, "x").as_dict()["items"]["joins"] == {"bytes": 2 * GIB, "source": "setting"}


def test_kv_cache_auto_chooses_by_the_sessions_asked_for():
    """The choice's arithmetic: exact (the model dtype) wherever the sessions asked for fit it
    and for auto sessions, the 8-bit cache only where it alone fits them; neither fitting, the
    8-bit plan, whose refusal names the most any cache fits."""
    exact = replace(_plan(100 * GIB, 2 * GIB, weights=19 * GIB), kv_cache="auto")  # 39 fit
    compact = replace(_plan(100 * GIB, GIB, weights=19 * GIB), kv_cache="fp8")  # 80 fit
    name = "PERSONAPLEX_MAX_SESSIONS"
    for asked in (None, 1, 39):
        chosen = choose_kv_cache(asked, exact, compact, name)
        assert chosen.kv_cache == "auto" and chosen.per_session == 2 * GIB
    assert choose_kv_cache(None, exact, compact, name).kv_choice == (
        "exact, the sessions are auto: 39 sessions fit (the fp8 cache would fit 80: PERSONAPLEX_KV_CACHE=fp8)")
    for asked in (40, 80):
        chosen = choose_kv_cache(asked, exact, compact, name)
        assert chosen.kv_cache == "fp8" and chosen.per_session == GIB
        assert chosen.kv_choice == (f"fp8, PERSONAPLEX_MAX_SESSIONS={asked} does not fit the exact cache "
                                    "(at most 39); the fp8 cache fits up to 80")
    neither = choose_kv_cache(81, exact, compact, name)
    assert neither.kv_cache == "fp8" and "fits neither" in neither.kv_choice
    with pytest.raises(MemoryPlanError, match="set it to 80 or less"):
        choose_sessions(neither, 81, name)
    # Capped like auto sessions: past the largest graph bucket the 8-bit cache buys nothing.
    roomy = replace(_plan(1000 * GIB, 2 * GIB, weights=19 * GIB), kv_cache="auto")
    assert choose_kv_cache(160, roomy, replace(roomy, kv_cache="int8", per_session=GIB), name).kv_cache == "auto"
    assert "would fit" not in choose_kv_cache(None, roomy, replace(roomy, kv_cache="int8", per_session=GIB),
                                              name).kv_choice


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001 - an object gc holds half made
                continue
    return sum(storages.values())


@pytest.mark.parametrize("kv_cache", ["auto", "fp8", "int8"])
def test_the_plan_is_what_the_engine_allocates_on_the_tiny_model(kv_cache):
    """The plan's weights and per-session state against the tensors the real engine holds:
    an engine of 4 slots and one of 36, measured by every live tensor's storage.  The
    difference is 32 slots of state, which the plan must match within 1 %; each engine's
    whole allocation must be within 5 % + 1 MiB of the plan's weights and sessions (the rest
    is the tokenizer's and the voices' few tensors).  For each KV cache storage: the 8-bit
    ones hold their values and scales."""
    memory = MemorySettings(limit_bytes=GIB, margin_bytes=0, prefill_cache_bytes=0)
    baseline = _live_tensor_bytes()
    measured, plans = [], []
    for slots in (4, 36):
        engine = create_engine(None, max_slots=slots, device="cpu", memory=memory, kv_cache=kv_cache)
        assert engine.kv.kv_cache == kv_cache
        measured.append(_live_tensor_bytes() - baseline)
        plans.append(engine.memory_plan)
        del engine
    per_slot_measured = (measured[1] - measured[0]) / 32
    assert per_slot_measured == pytest.approx(plans[0].per_session, rel=0.01)
    for plan, allocated in zip(plans, measured):
        planned = plan.item("weights").bytes + plan.session_bytes
        assert abs(allocated - planned) <= 0.05 * planned + MIB, (allocated, planned)


def test_auto_takes_the_most_that_fit_and_a_number_that_does_not_fit_is_refused():
    """With a limit to plan against, the tiny engine on CPU sizes itself (auto) and refuses a
    count past it with the one line; the settled plan has run the longest join.  (The KV
    cache named: with auto, a count past the exact cache's fit takes the 8-bit one, below.)"""
    memory = MemorySettings(limit_bytes=64 * MIB, margin_bytes=MIB, prefill_cache_bytes=4 * MIB)
    engine = create_engine(None, max_slots=None, device="cpu", memory=memory, kv_cache="int8")
    plan = engine.memory_plan
    assert engine.num_slots == plan.sessions == min(plan.largest_fit(), 160) and plan.fits
    settled = engine.settle_memory_plan()
    assert settled.stage == "measured" and settled.sessions == engine.num_slots
    assert engine.free_slots() == engine.num_slots  # the dry run left the slots as they were
    too_many = plan.largest_fit() + 1
    with pytest.raises(MemoryPlanError, match=f"max_sessions={too_many} does not fit .* set it to "
                                              f"{plan.largest_fit()} or less"):
        create_engine(None, max_slots=too_many, device="cpu", memory=memory, kv_cache="int8")


def test_kv_cache_auto_is_exact_unless_the_sessions_asked_for_need_the_8bit_cache():
    """``PERSONAPLEX_KV_CACHE=auto`` on the real engine (tiny model, CPU, a limit to plan
    with): auto sessions and a count the exact cache fits take the exact cache (the model
    dtype); one session more takes the 8-bit cache this device runs (int8: no e4m3 on a CPU)
    and fits; past the 8-bit cache's fit, the refusal names its largest.  (43 MiB: ~39 for the
    weights and items, room for ~60 exact slots of 59 KiB, ~100 int8 ones of 37 KiB.)"""
    memory = MemorySettings(limit_bytes=43 * MIB, margin_bytes=MIB, prefill_cache_bytes=4 * MIB)
    auto = create_engine(None, max_slots=None, device="cpu", memory=memory)
    exact_fit = auto.memory_plan.largest_fit()
    assert auto.kv.kv_cache == auto.memory_plan.kv_cache == "auto" and auto.num_slots == exact_fit
    assert auto.memory_plan.kv_choice.startswith("exact, the sessions are auto")
    assert auto.memory_plan.as_dict()["kv_cache"] == "exact"
    asked = create_engine(None, max_slots=exact_fit, device="cpu", memory=memory)
    assert asked.kv.kv_cache == "auto"
    more = create_engine(None, max_slots=exact_fit + 1, device="cpu", memory=memory)
    plan = more.memory_plan
    assert more.kv.kv_cache == plan.kv_cache == "int8" and more.num_slots == exact_fit + 1 and plan.fits
    assert plan.kv_choice.startswith(f"int8, max_sessions={exact_fit + 1} does not fit the exact cache")
    assert plan.as_dict()["kv_cache"] == "int8" and plan.per_session < auto.memory_plan.per_session
    compact_fit = plan.largest_fit()
    assert compact_fit > exact_fit
    with pytest.raises(MemoryPlanError, match=f"max_sessions={compact_fit + 1} does not fit .* set it to "
                                              f"{compact_fit} or less"):
        create_engine(None, max_slots=compact_fit + 1, device="cpu", memory=memory)


def test_no_plan_on_cpu_without_a_limit():
    engine = create_engine(None, max_slots=2, device="cpu")
    assert engine.memory_plan is None and engine.settle_memory_plan() is None
    with pytest.raises(ValueError, match="needs a GPU or a memory limit"):
        create_engine(None, max_slots=None, device="cpu")


def test_the_server_sizes_its_engine_by_the_plan_and_shows_the_plan_in_ready():
    """``PERSONAPLEX_MAX_SESSIONS=auto`` with a memory limit to plan against (on CPU): the
    engine takes the most that fit, admission is that figure, and ``/ready`` carries the
    measured plan; the log has it one line per item."""
    from tests.orch_support import Server

    server = Server(max_sessions="auto", memory_limit_gb=0.06, memory_margin_gb=0.001, prefill_cache_gb=0.004,
                    workers=2)
    try:
        ready = server.wait_ready()
        plan = ready["devices"][0]["memory_plan"]
        assert plan["stage"] == "measured" and plan["device_bytes"] == int(0.06 * GIB)
        assert ready["max_sessions"] == plan["sessions"] == min(plan["largest_fit"], 160) > 8
        assert set(plan["items"]) == {"not_ours", "weights", "graphs", "joins", "prefill_cache", "margin"}
        assert plan["total_bytes"] <= plan["device_bytes"]
        assert plan["kv_cache"] == "exact" and plan["kv_choice"].startswith("exact, the sessions are auto")
        logged = [line for line in server.logs().splitlines() if "memory plan (measured)" in line]
        assert len(logged) == 1 and f"for {plan['sessions']} sessions on cpu" in logged[0]
    finally:
        server.stop()
    server.assert_clean_log()


def test_a_max_sessions_past_the_plan_fails_the_engines_start_with_one_line():
    """A session count the plan does not fit: the engine does not load, ``/ready`` and
    ``/health`` say so, and the log says it in one line naming the largest that fits."""
    import re
    import time

    from tests.orch_support import Server

    server = Server(max_sessions=1000, memory_limit_gb=0.06, memory_margin_gb=0.001, prefill_cache_gb=0.004,
                    wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        while True:
            status, ready = server.get("/ready")
            if ready.get("reason") == "unavailable" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 503 and ready["reason"] == "unavailable", ready
        assert server.get("/health")[0] == 503
        lines = [line for line in server.logs().splitlines() if "does not fit the memory of cpu" in line]
        assert lines, server.logs()[-3000:]
        match = re.search(r"PERSONAPLEX_MAX_SESSIONS=1000 does not fit the memory of cpu even with the int8 KV cache: "
                          r"set it to (\d+) or less",
                          lines[0])
        assert match and 8 < int(match.group(1)) < 1000, lines[0]
        assert "Traceback" not in server.logs()
    finally:
        server.stop()


class _Allocator:
    """The allocator counters ``memory_probe.measure`` reads, as a stand-in for a GPU's: the
    compile and capture left ``one_off`` bytes cached, and a join allocates ``join`` bytes."""

    def __init__(self, held: int, one_off: int, join: int, fail: bool = False, others: int = 0) -> None:
        self.allocated_now, self.reserved_now, self.peak = held, held + one_off, held
        self.join, self.fail, self.others = join, fail, others

    def synchronize(self) -> None:
        pass

    def release_cached(self) -> None:
        self.reserved_now = self.allocated_now

    def reserved(self) -> int:
        return self.reserved_now

    def allocated(self) -> int:
        return self.allocated_now

    def reset_peak(self) -> None:
        self.peak = self.allocated_now

    def peak_allocated(self) -> int:
        return self.peak

    def peak_reserved(self) -> int:
        return self.reserved_now

    def held_by_others(self) -> int:
        return self.others

    def dry_run(self) -> None:
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 758.00 MiB")
        self.peak = self.allocated_now + self.join  # allocated, then freed (the allocator keeps it)
        self.reserved_now = max(self.reserved_now, self.peak)


def test_the_graphs_and_a_join_are_measured_from_the_allocator():
    """On a GPU the plan's graphs are what the allocator holds beyond the weights and the
    slots once the one-off blocks are given back, and a join is the peak its dry run adds
    (times the joins prepared at once); a dry run out of memory is the one-line refusal."""
    from engines.runtime import memory_probe

    plan = choose_sessions(_plan(100 * GIB, GIB, not_ours=0, weights=16 * GIB, graphs=5 * GIB, joins=2 * GIB,
                                 margin=GIB), 70, "PERSONAPLEX_MAX_SESSIONS")
    held = 16 * GIB + plan.session_bytes + 3 * GIB  # the graphs hold 3 GiB
    allocator = _Allocator(held, one_off=4 * GIB, join=GIB + GIB // 2)
    measured = memory_probe.measure(plan, allocator, allocator.dry_run, 2, "PERSONAPLEX_MAX_SESSIONS")
    assert measured.item("graphs") == PlanItem("graphs", 3 * GIB, "measured")
    assert measured.item("joins").bytes == 3 * GIB and measured.item("joins").source == "measured"
    assert measured.largest_fit() == 100 - 16 - 3 - 3 - 1 - 1
    failing = _Allocator(held, one_off=0, join=0, fail=True)
    with pytest.raises(MemoryPlanError, match=r"^PERSONAPLEX_MAX_SESSIONS=70: the dry run of the longest join ran "
                                              r"out of memory on cuda:0 .*set it lower or free the device"):
        memory_probe.measure(plan, failing, failing.dry_run, 1, "PERSONAPLEX_MAX_SESSIONS")


def test_the_context_measured_again_and_an_auto_plan_over_by_a_little_keeps_a_smaller_cache():
    """``not_ours`` is measured again once the graphs are captured (the CUDA context grows as
    kernel modules load); an auto plan that measures a little over its estimate takes what is
    missing out of the prefill cache's room (the slots are allocated by then), and one that
    measures over by more than that room, or a plan asked for, is refused."""
    from dataclasses import replace

    from engines.runtime import memory_probe

    plan = _plan(100 * GIB, GIB, not_ours=GIB // 2, weights=16 * GIB, graphs=5 * GIB, joins=2 * GIB, margin=GIB)
    plan = plan.with_item(PlanItem("not_ours", GIB // 2, "measured"))
    plan = choose_sessions(plan, 70, "PERSONAPLEX_MAX_SESSIONS")
    held = 16 * GIB + plan.session_bytes + 3 * GIB
    allocator = _Allocator(held, one_off=0, join=GIB, others=GIB)
    measured = memory_probe.measure(plan, allocator, allocator.dry_run, 1, "PERSONAPLEX_MAX_SESSIONS")
    assert measured.item("not_ours") == PlanItem("not_ours", GIB, "measured")

    memory = MemorySettings(limit_bytes=64 * MIB, margin_bytes=MIB, prefill_cache_bytes=4 * MIB)
    engine = create_engine(None, max_slots=None, device="cpu", memory=memory)
    auto = engine.memory_plan
    over = replace(auto, device_bytes=auto.total - MIB)  # measured 1 MiB over the room
    fitted = engine._fit_auto(over)
    assert fitted.fits and fitted.item("prefill_cache").bytes == 3 * MIB == engine.prefills.max_bytes
    too_far = replace(auto, device_bytes=auto.total - 5 * MIB)
    assert not engine._fit_auto(too_far).fits
    assert "=auto (" in too_far.refusal("PERSONAPLEX_MAX_SESSIONS")
    asked = replace(over, auto=False)
    assert engine._fit_auto(asked) is asked
