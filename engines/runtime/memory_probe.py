"""The measurements behind the PyTorch engine's memory plan (``memory_plan``).

What one slot's state costs is computed from the state classes themselves, built for one slot
on the meta device (no memory is allocated), so the figure is exact and known before the
engine allocates its slots.  What a join costs at peak is measured by a dry run of the longest
prompt at start-up, and what the graphs took by the allocator's counters once they are
captured (``measure``).
"""

from __future__ import annotations

import gc
import logging
from typing import Callable, Iterable

import torch

from engines.config import AUDIO_SILENCE_FRAMES, LMConfig
from engines.errors import MemoryPlanError
from engines.runtime.memory_plan import MemoryPlan, PlanItem
from engines.spec import GIB
from engines.state.kv_ring import SlotKVRing

log = logging.getLogger(__name__)

# Before capture, what the graph pools, workspaces and allocator slack beside them are
# taken to be on a GPU (checked after capture, when they are measured).  At the 7B shapes
# with 22 tick graphs and 6 prefill graphs an H200 measured 5.00 GiB at 147 slots
# (docs/PERFORMANCE.md, "Every admitted session opens: the memory plan at the wall").
GRAPHS_ESTIMATE = 5 * GIB
# A join's peak beyond its prefill's keys and values (embeddings of a piece, an 8-bit
# install's temporaries of one layer), as a share of them, before it is measured.
JOIN_OVERHEAD = 0.25


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            seen[id(t)] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _attributes(obj) -> list[torch.Tensor]:
    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]


def slot_state_tensors(kv, tokens, sampling, mimi) -> list[torch.Tensor]:
    """The tensors of every slot's state: the KV ring, the token ring, the sampling settings and
    Mimi's streaming state (its non-persistent buffers, its persistent ones being weights, and
    its transformers' KV rings)."""
    mimi_state = [buffer for module in mimi.modules() for name, buffer in module.named_buffers(recurse=False)
                  if name in module._non_persistent_buffers_set]
    # Its transformers' KV rings are attributes, not buffers.
    mimi_rings = [t for module in mimi.modules() for ring in vars(module).values() if isinstance(ring, SlotKVRing)
                  for t in _attributes(ring)]
    return _attributes(kv) + _attributes(tokens) + _attributes(sampling) + mimi_state + mimi_rings


def per_slot_bytes(cfg: LMConfig, mimi_cfg, window: str, dtype: torch.dtype, kv_cache: str) -> int:
    """Bytes one slot's state takes with a temporal KV cache of ``kv_cache`` storage (built for
    one slot on the meta device)."""
    from engines.model.mimi import MimiCodec
    from engines.state.session_slots import SlotSampling
    from engines.state.token_state import TokenState

    meta = torch.device("meta")
    kv = SlotKVRing(cfg.num_layers, 1, cfg.num_heads, cfg.context, cfg.head_dim, device=meta, dtype=dtype,
                     kv_cache=kv_cache)
    mimi = MimiCodec(mimi_cfg, 1, window=window, device=meta)
    return tensor_bytes(slot_state_tensors(kv, TokenState(cfg, 1, device=meta), SlotSampling(1, meta), mimi))


def mimi_weight_bytes(mimi_cfg, window: str) -> int:
    """Bytes of Mimi's weights (built on the meta device: they do not depend on the slots)."""
    from engines.model.mimi import MimiCodec

    return module_bytes(MimiCodec(mimi_cfg, 1, window=window, device=torch.device("meta")))


def module_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the weights (parameters and persistent buffers) of ``modules``."""
    tensors: list[torch.Tensor] = []
    for module in modules:
        tensors += list(module.parameters())
        for sub in module.modules():
            tensors += [b for name, b in sub.named_buffers(recurse=False)
                        if name not in sub._non_persistent_buffers_set]
    return tensor_bytes(tensors)


def join_estimate(cfg: LMConfig, dtype: torch.dtype, eager_scratch_positions: int) -> int:
    """A join's peak before it is measured: the keys and values of a whole window in the
    compute dtype (the longest prefill keeps no more), ``JOIN_OVERHEAD`` beside them, and
    the prefill's own cache when it runs eagerly (no piece graph holds one)."""
    per_position = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return int(per_position * cfg.context * (1 + JOIN_OVERHEAD)) + per_position * eager_scratch_positions


def longest_persona(cfg: LMConfig, voice_rows: int) -> list[int]:
    """Persona tokens that make a prompt exactly as long as the window with a voice of
    ``voice_rows`` positions: the longest prefill any join keeps (a longer prompt keeps the
    window's newest positions only)."""
    n = max(1, cfg.context - voice_rows - 2 * AUDIO_SILENCE_FRAMES)
    return [1000 % cfg.text_card] * n


def held_before(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA ``device`` now (before the engine loads: what others and
    the CUDA context hold is total - free); None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def with_measured(plan: MemoryPlan, graphs: int, join_peak: int | None, joins: int) -> MemoryPlan:
    """``plan`` with the graphs and (if measured) the join's peak as measured."""
    plan = plan.with_item(PlanItem("graphs", max(0, graphs), "measured"))
    if join_peak is not None:
        plan = plan.with_item(PlanItem("joins", join_peak * joins, "measured",
                                       f"{joins} x {join_peak / GIB:.2f} GiB, the longest prompt's dry run"))
    return plan


class CudaCounters:
    """The caching allocator's counters of one CUDA device (what ``measure`` reads)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def held_by_others(self) -> int:
        """What the device holds beyond this allocator's reserve: other processes, and our CUDA
        context with the kernel modules it has loaded since the engine started."""
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - self.reserved()


def measure(plan: MemoryPlan, counters: CudaCounters, dry_run: Callable[[], None], joins: int,
            setting: str) -> MemoryPlan:
    """``plan`` with what could only be estimated before allocating measured (start-up, once
    the graphs are captured): ``not_ours`` again (the CUDA context grows as kernel modules
    load), the graphs as what the allocator holds beyond the weights and the slots once the
    one-off blocks of compiling and capturing are given back, and a join as the peak a dry
    run of the longest one (``dry_run``) adds, allocated or reserved, whichever is more.  The
    blocks the dry run freed stay with the allocator, reserved for the joins to come.
    ``MemoryPlanError`` (one line) if the dry run itself runs out of memory."""
    gc.collect()  # cyclic garbage (the warm-up's) is no graph
    counters.synchronize()
    counters.release_cached()
    if plan.item("not_ours").source == "measured":  # (with a limit, the plan is of our memory only)
        plan = plan.with_item(PlanItem("not_ours", max(plan.item("not_ours").bytes, counters.held_by_others()),
                                       "measured"))
    graphs = counters.reserved() - plan.item("weights").bytes - plan.session_bytes
    if graphs < 0:
        log.warning("memory plan: the allocator holds %d bytes less than the weights and slots it counts",
                    -graphs)
    allocated_before, reserved_before = counters.allocated(), counters.reserved()
    counters.reset_peak()
    try:
        dry_run()
    except torch.OutOfMemoryError as exc:
        short = with_measured(plan, graphs, None, joins)
        raise MemoryPlanError(f"{setting}={plan.sessions}: the dry run of the longest join ran out of memory on "
                              f"{plan.device} (something beyond the plan holds its memory); set it lower or free "
                              f"the device (plan: {short.summary()})") from exc
    counters.synchronize()
    peak = max(counters.peak_allocated() - allocated_before, counters.peak_reserved() - reserved_before)
    return with_measured(plan, graphs, peak, joins)
