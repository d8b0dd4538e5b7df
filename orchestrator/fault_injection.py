"""Fault injection for tests and drills: an engine wrapper that fails chosen sessions' steps,
and loads that fail or take long on a chosen device.

``PERSONAPLEX_FAULT_INJECTION`` holds one or more plans separated by ``;``, each a list of
``key=value`` pairs separated by ``,``::

    persona=FAULT-A,mode=slot,after=5,times=1; persona=FAULT-H,mode=hang,seconds=2.5,after=3

- ``persona``: the plan targets slots opened with a persona containing this text (so a test
  picks its victim session through its ``instructions``);
- ``mode``: ``slot`` (the victim's step fails, the others in the tick advance and keep their
  output: ``SlotFault`` with outputs), ``slot_early`` (fails before anything advanced:
  ``SlotFault`` without outputs, the others' frames are stepped again), ``batch`` (a plain
  ``RuntimeError`` worded like a CUDA error: nobody can tell which session caused it),
  ``hang`` (the step sleeps ``seconds`` before running: a stuck tick for the watchdog),
  ``restart`` (the victim's next context restart fails: its session cannot go on),
  ``slow_open`` (opening the slot, prompt included, takes ``seconds`` longer: a prompt that
  is slow to run), ``leak_open`` (the open fails after the engine took the slot, which it
  keeps: the engine lost a slot, as a failed install once did), ``oom_open`` (the open fails
  as the GPU's allocator fails, torch's ``OutOfMemoryError`` with its words, before the slot
  is taken);
- ``device`` with ``mode`` ``fail_load`` (the engine of that device label, e.g. ``cpu#0``,
  fails to load, worded as a CUDA allocation failure) or ``slow_load`` (its load takes
  ``seconds`` longer): ``device=cpu#0,mode=fail_load``; such a plan names no persona;
- ``after``: fire on the victim slot's N-th step since it was opened (default 5), then every
  ``after`` steps, ``times`` times in all (default 1; 0 = no limit).

The wrapper is installed only when the setting is set: with it unset the engine is used as
is, so a production tick pays nothing for this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.interface import Engine, EngineError, FrameOutput, SessionSpec, SlotFault

log = logging.getLogger(__name__)

SESSION_MODES = ("slot", "slot_early", "batch", "hang", "restart", "slow_open", "leak_open", "oom_open")
LOAD_MODES = ("fail_load", "slow_load")
MODES = SESSION_MODES + LOAD_MODES


class FaultPlanError(ValueError):
    pass


@dataclass(frozen=True)
class FaultPlan:
    persona: str  # "" for a load plan
    mode: str
    after: int = 5
    times: int = 1
    seconds: float = 2.0
    device: str = ""  # a load plan's device label

    @classmethod
    def parse_all(cls, text: str) -> list[FaultPlan]:
        plans = [cls.parse(part) for part in text.split(";") if part.strip()]
        if not plans:
            raise FaultPlanError("no fault plan given")
        return plans

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        fields: dict[str, str] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise FaultPlanError(f"fault plan item {item.strip()!r} is not key=value")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"persona", "mode", "after", "times", "seconds", "device"}
        if unknown:
            raise FaultPlanError(f"unknown fault plan keys: {', '.join(sorted(unknown))}")
        mode = fields.get("mode")
        if mode in LOAD_MODES:
            if not fields.get("device") or "persona" in fields:
                raise FaultPlanError(f"a load fault plan needs device=<label> and no persona: {text.strip()!r}")
        elif not fields.get("persona") or mode not in SESSION_MODES or "device" in fields:
            raise FaultPlanError(f"a fault plan needs persona=<text> and mode=<{'|'.join(SESSION_MODES)}>, or "
                                 f"device=<label> and mode=<{'|'.join(LOAD_MODES)}>: {text.strip()!r}")
        try:
            plan = cls(fields.get("persona", ""), mode, int(fields.get("after", 5)), int(fields.get("times", 1)),
                       float(fields.get("seconds", 2.0)), fields.get("device", ""))
        except ValueError as exc:
            raise FaultPlanError(f"fault plan {text.strip()!r}: {exc}") from None
        if plan.after < 1 or plan.times < 0 or plan.seconds < 0:
            raise FaultPlanError(f"fault plan {text.strip()!r}: after >= 1, times >= 0, seconds >= 0")
        return plan


class _Victim:
    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.steps = 0
        self.fired = 0
        self.restart_due = False

    def step_fires(self) -> bool:
        """Count one step of this slot; True when the plan fires on it."""
        self.steps += 1
        plan = self.plan
        if plan.times and self.fired >= plan.times:
            return False
        if self.steps % plan.after:
            return False
        self.fired += 1
        return True


class FaultyEngine:
    """Wraps an engine; everything not listed here is passed through unchanged."""

    def __init__(self, inner: Engine, plans: Sequence[FaultPlan]) -> None:
        self.inner = inner
        self.plans = [plan for plan in plans if plan.mode in SESSION_MODES]
        self.injected = 0  # faults fired so far
        self._victims: dict[int, _Victim] = {}
        log.warning("FAULT INJECTION is on (testing only): %s", "; ".join(map(str, self.plans)))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def open_slot(self, spec: SessionSpec, prefill: Any = None) -> int:
        plan = next((p for p in self.plans if p.persona in spec.persona), None)
        if plan is not None and plan.mode == "oom_open":
            # As the allocator fails a prefill's scratch: before the slot is taken, with its words.
            import torch

            self._fired(plan, -1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 758.00 MiB. GPU 0 has a total "
                                         "capacity of 139.80 GiB of which 537.06 MiB is free. (injected fault)")
        slot = self.inner.open_slot(spec, prefill)
        if plan is not None and plan.mode == "leak_open":
            self._fired(plan, slot)
            raise EngineError(f"injected fault: the open failed and slot {slot} was lost")
        if plan is not None and plan.mode == "slow_open":
            self._fired(plan, slot)
            time.sleep(plan.seconds)
            plan = None  # nothing more happens to this slot
        if plan is not None:
            self._victims[slot] = _Victim(plan)
        else:
            self._victims.pop(slot, None)
        return slot

    def close_slot(self, slot: int) -> None:
        self._victims.pop(slot, None)
        self.inner.close_slot(slot)

    def close_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._victims.pop(slot, None)
        self.inner.close_slots(slots)

    def restart_slot(self, slot: int, prefill: Any = None) -> None:
        victim = self._victims.get(slot)
        if victim is not None and victim.restart_due:
            victim.restart_due = False
            self._fired(victim.plan, slot)
            raise EngineError(f"injected fault: restart of slot {slot} failed")
        self.inner.restart_slot(slot, prefill)

    def step(self, slots: Sequence[int], pcm: np.ndarray) -> list[FrameOutput]:
        firing = [(i, slot, self._victims[slot].plan) for i, slot in enumerate(slots)
                  if slot in self._victims and self._victims[slot].step_fires()]
        if not firing:
            return self.inner.step(slots, pcm)
        for _, slot, plan in firing:
            self._fired(plan, slot)
        modes = {plan.mode for *_, plan in firing}
        if "hang" in modes:
            time.sleep(max(plan.seconds for *_, plan in firing if plan.mode == "hang"))
        if "batch" in modes:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected fault)")
        for _, slot, plan in firing:
            if plan.mode == "restart":
                self._victims[slot].restart_due = True
        failing = [(i, slot) for i, slot, plan in firing if plan.mode in ("slot", "slot_early", "restart")]
        if not failing:
            return self.inner.step(slots, pcm)
        bad = {slot for _, slot in failing}
        if "slot_early" in modes:
            raise SlotFault(f"injected fault before the step in slot(s) {sorted(bad)}", sorted(bad))
        keep = [i for i, slot in enumerate(slots) if slot not in bad]
        outputs: list[FrameOutput | None] = [None] * len(slots)
        if keep:
            for i, out in zip(keep, self.inner.step([slots[i] for i in keep], pcm[keep])):
                outputs[i] = out
        raise SlotFault(f"injected fault in slot(s) {sorted(bad)}", sorted(bad), outputs)

    def _fired(self, plan: FaultPlan, slot: int) -> None:
        self.injected += 1
        log.warning("injected fault #%d: mode=%s slot=%d", self.injected, plan.mode, slot)


def with_fault_injection(factory: Callable[..., Engine], spec: str | None, device: str = "") -> Callable[..., Engine]:
    """The engine factory as is, or (testing only) one whose engines fail on purpose;
    ``device``: the label of the device the engines are built for (load plans name it)."""
    if not spec:
        return factory
    from .settings import SettingsError, env_name

    try:
        plans = FaultPlan.parse_all(spec)
    except FaultPlanError as exc:
        raise SettingsError(f"{env_name('fault_injection')}: {exc}") from None
    loads = [plan for plan in plans if plan.mode in LOAD_MODES and plan.device == device]

    def build(*args: Any, **kwargs: Any) -> Engine:
        for plan in loads:
            log.warning("injected fault: mode=%s device=%s", plan.mode, device)
            if plan.mode == "fail_load":
                raise RuntimeError("CUDA error: out of memory (injected fault)")
            time.sleep(plan.seconds)
        engine = factory(*args, **kwargs)
        return FaultyEngine(engine, plans) if any(plan.mode in SESSION_MODES for plan in plans) else engine

    return build
