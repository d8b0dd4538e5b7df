"""The engine's device-memory plan: what every admitted session may need, accounted for before
the engine says it is ready.

A GPU engine allocates its sessions' KV windows up front, but a join allocates more: the
prefill of its system prompt (keys and values of up to a whole window, 0.5 MiB per position
at the 7B shapes in bf16) and the temporaries that install it.  Sized by windows alone, an
H200 at 152 slots had 0.5 GiB left and every join with a long persona failed (issue 34).  So
the engine plans for the worst case an admitted session may bring, item by item:

- ``not_ours``: what the device holds beside the engine's allocator (the CUDA context, other
  processes), measured before the engine loads and again once its graphs are captured;
- ``weights``: the model's weights and fixed buffers, computed from the loaded modules;
- ``sessions``: ``per_session`` x (sessions + the scratch slot), computed from the slot
  state's own tensors (KV window, token ring, Mimi's streaming state, sampling settings);
- ``graphs``: CUDA graph pools, workspaces and what the allocator keeps beside them, estimated
  before capture and measured after it;
- ``joins``: the peak a join of the longest prompt adds (a prompt as long as the window: no
  longer one keeps more), times the joins the scheduler prepares at once; estimated, then
  measured by a dry run of that join at start-up;
- ``prefill_cache``: the bytes the cache of prepared prompts may keep (a setting);
- ``margin``: a stated reserve for what is not measured (allocator rounding, workspaces a new
  shape asks for), a setting.

Torch-free: the arithmetic and its report only.  ``torch_engine`` measures the items.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engines.errors import MemoryPlanError
from engines.spec import GIB

# Sessions ``auto`` never goes past: the largest tick-graph bucket.
AUTO_MAX_SESSIONS = 160
# The KV storages as an operator reads them ("auto" at the storage level is the model dtype).
KV_NAMES = {"auto": "exact", "fp8": "fp8", "int8": "int8"}


@dataclass(frozen=True)
class PlanItem:
    name: str
    bytes: int
    source: str  # "measured", "computed", "estimated" or "setting"
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    device_bytes: int  # what the plan may use: the device's memory, or the configured limit
    sessions: int  # admitted sessions (the engine has one scratch slot more)
    per_session: int  # bytes of one slot's state
    items: tuple[PlanItem, ...]  # everything but the sessions, in the order the module doc lists them
    stage: str = "estimate"  # "estimate" (before allocating) or "measured" (after the dry run)
    auto: bool = False  # the sessions are the most that fit (not asked for)
    # The temporal KV cache's storage the sessions were planned with ("auto": the model dtype,
    # exact; "fp8"; "int8") and, where PERSONAPLEX_KV_CACHE=auto chose it, why (choose_kv_cache).
    kv_cache: str = "auto"
    kv_choice: str = ""

    @property
    def session_bytes(self) -> int:
        return self.per_session * (self.sessions + 1)

    @property
    def fixed_bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def total(self) -> int:
        return self.fixed_bytes + self.session_bytes

    @property
    def spare(self) -> int:
        return self.device_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.spare >= 0

    def largest_fit(self) -> int:
        """The most sessions these items leave room for (0 if not even one)."""
        room = self.device_bytes - self.fixed_bytes
        return max(0, room // self.per_session - 1) if self.per_session > 0 else AUTO_MAX_SESSIONS

    def item(self, name: str) -> PlanItem:
        return next(item for item in self.items if item.name == name)

    def with_sessions(self, sessions: int) -> "MemoryPlan":
        return replace(self, sessions=sessions)

    def with_item(self, item: PlanItem) -> "MemoryPlan":
        return replace(self, items=tuple(item if old.name == item.name else old for old in self.items))

    def lines(self) -> list[str]:
        """The plan for the log, one line per item."""
        head = (f"memory plan ({self.stage}) for {self.sessions} sessions on {self.device}, "
                f"KV cache {KV_NAMES.get(self.kv_cache, self.kv_cache)}: "
                f"{_size(self.total)} of {_size(self.device_bytes)}, {_size(self.spare)} spare")
        rows = [f"  sessions: {_size(self.session_bytes)} ({self.sessions} + 1 scratch x "
                f"{_size(self.per_session)}, computed)"]
        for item in self.items:
            note = f"; {item.note}" if item.note else ""
            rows.append(f"  {item.name}: {_size(item.bytes)} ({item.source}{note})")
        return [head, *rows]

    def summary(self) -> str:
        """The items on one line (the refusal's tail)."""
        parts = [f"sessions {self.sessions}+1 x {_size(self.per_session)}"]
        parts += [f"{item.name} {_size(item.bytes)}" for item in self.items]
        return f"{', '.join(parts)}; of {_size(self.device_bytes)}"

    def refusal(self, asked_by: str) -> str:
        largest = self.largest_fit()
        fix = (f"set it to {largest} or less, or free memory (plan: {self.summary()})" if largest
               else f"not even one session fits (plan: {self.summary()})")
        asked = f"auto ({self.sessions})" if self.auto else self.sessions
        # Where PERSONAPLEX_KV_CACHE=auto chose the 8-bit cache, the largest is already its.
        even = f" even with the {KV_NAMES[self.kv_cache]} KV cache" if self.kv_choice and self.kv_cache != "auto" else ""
        return f"{asked_by}={asked} does not fit the memory of {self.device}{even}: {fix}"

    def as_dict(self) -> dict[str, Any]:
        """The plan for ``/ready`` (bytes)."""
        return {
            "stage": self.stage, "device": self.device, "device_bytes": self.device_bytes,
            "sessions": self.sessions, "per_session_bytes": self.per_session,
            "session_bytes": self.session_bytes, "total_bytes": self.total, "spare_bytes": self.spare,
            "largest_fit": self.largest_fit(), "kv_cache": KV_NAMES.get(self.kv_cache, self.kv_cache),
            "kv_choice": self.kv_choice,
            "items": {item.name: {"bytes": item.bytes, "source": item.source} for item in self.items},
        }


def _size(n: int) -> str:
    """Bytes for the log: GiB, or MiB or KiB below (a small model's plan)."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"


def choose_sessions(plan: MemoryPlan, asked: int | None, asked_by: str) -> MemoryPlan:
    """``plan`` for the sessions asked for, or (``asked`` None: auto) for the largest that fits,
    at most ``AUTO_MAX_SESSIONS``; ``MemoryPlanError`` if what was asked does not fit."""
    if asked is None:
        largest = min(plan.largest_fit(), AUTO_MAX_SESSIONS)
        if largest < 1:
            raise MemoryPlanError(f"{asked_by}=auto: not even one session fits the memory of {plan.device} "
                                  f"(plan: {plan.with_sessions(1).summary()})")
        return replace(plan, sessions=largest, auto=True)
    plan = plan.with_sessions(asked)
    if not plan.fits:
        raise MemoryPlanError(plan.refusal(asked_by))
    return plan


def choose_kv_cache(asked: int | None, exact: MemoryPlan, compact: MemoryPlan, asked_by: str) -> MemoryPlan:
    """What ``PERSONAPLEX_KV_CACHE=auto`` takes, given the plan with the exact cache (the model
    dtype: ``exact``) and with the device's 8-bit cache (``compact``: fp8 where the GPU has e4m3,
    else int8; one byte an element and a scale per head vector, ~half the bytes): the exact
    cache wherever the sessions asked for fit it, and with ``asked`` None (auto: as many as
    fit), since more sessions at a quantised cache is the operator's trade to make, not ours
    (the error figures: docs/PERFORMANCE.md); the 8-bit cache only where ``asked`` sessions fit
    it and not the exact one.  Neither fitting, the 8-bit plan comes back, so that the refusal
    ``choose_sessions`` gives names the most sessions any cache fits.  The plan returned
    carries the choice and its reason (``kv_choice``)."""
    kind = KV_NAMES[compact.kv_cache]
    exact_fit, compact_fit = min(exact.largest_fit(), AUTO_MAX_SESSIONS), min(compact.largest_fit(), AUTO_MAX_SESSIONS)
    if asked is None or asked <= exact_fit:
        why = ("the sessions are auto" if asked is None else f"{asked_by}={asked} fits it") + (
            f": {exact_fit} sessions fit (the {kind} cache would fit {compact_fit}: PERSONAPLEX_KV_CACHE={kind})"
            if compact_fit > exact_fit else f": {exact_fit} sessions fit")
        return replace(exact, kv_choice=f"exact, {why}")
    if asked <= compact_fit:
        return replace(compact, kv_choice=(f"{kind}, {asked_by}={asked} does not fit the exact cache (at most "
                                           f"{exact_fit}); the {kind} cache fits up to {compact_fit}"))
    return replace(compact, kv_choice=f"{kind}, the smaller cache; {asked_by}={asked} fits neither (exact at most "
                                      f"{exact_fit}, {kind} at most {compact_fit})")
