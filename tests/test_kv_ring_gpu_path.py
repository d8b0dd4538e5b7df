"""The GPU decode path of ``SlotKVRing.attend`` (the Triton kernel, one row per query) against
the gather path, on CPU through Triton's interpreter.

Streaming calls of 2-4 tokens (Mimi's 2-token steps) take the kernel path on a GPU; its
window floor (a query may not reach below ``end - capacity``, where the call's own writes
overwrote older entries) is the subtle part, checked here in both window modes, with wrapped
rings, and with the 8-bit caches (the int8 one written by the fused write kernel on the kernel
path, as on a GPU).  Runs in a subprocess because the interpreter is chosen when Triton is
imported.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import worst_error_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import math, torch
    from engines.fastpath import attention, kv_write
    from engines.state.kv_ring import SlotKVRing, WindowMode, window_start

    # No CUDA here: fixed split size instead of one derived from the SM count.
    attention._split_size = lambda C, rows, device, block, min_splits: block
    torch.manual_seed(0)
    worst = 0.0
    for kv_cache in ("auto", "fp8", "int8"):
        for mode in WindowMode.ALL:
            for T in (1, 2, 3):
                C, H, D, S = 7, 2, 16, 4
                rings = [SlotKVRing(2, S, H, C, D, kv_cache=kv_cache) for _ in range(2)]
                slots = torch.tensor([2, 0])
                for call in range(6):  # wraps the 7-entry ring twice for T = 3
                    positions = rings[0].positions(slots, T)
                    call_end = (positions[:, -1:] + 1).expand_as(positions)
                    lo = window_start(positions, call_end, C, mode)
                    q, k, v = (torch.randn(2, H, T, D) for _ in range(3))
                    outs = []
                    for use_kernel, ring in zip((False, True), rings):
                        attention.available = lambda device, fp8=False, on=use_kernel: on
                        # Not the fused fp8 write: the interpreter rounds some values to e4m3
                        # wrongly (tests/test_kv_write.py); it is checked on the GPU.  The int8
                        # one is exact here: the kernel path's ring takes it.
                        kv_write.available = lambda device, head_dim, fp8=True, on=use_kernel and kv_cache == "int8": on
                        outs.append(ring.attend(1, slots, q, k, v, positions, lo))
                        ring.advance(slots, T)
                    worst = max(worst, (outs[0] - outs[1]).abs().max().item())
    print(worst)
""")


def test_kernel_path_matches_gather_path_for_short_streaming_calls():
    worst = worst_error_in_interpreter(SCRIPT)
    assert worst < 1e-5, worst
