"""The Triton decode attention against a direct computation (runs only where CUDA is)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.fastpath import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def expected(q, keys, values, slots, q_pos, lo):
    C = keys.shape[2]
    out = []
    for b in range(q.shape[0]):
        start = max(int(lo[b]), 0)
        ring = torch.arange(start, int(q_pos[b]) + 1, device=q.device) % C
        k = keys[slots[b], :, ring].float()  # [H, n, D]
        v = values[slots[b], :, ring].float()
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[b].float(), k) / math.sqrt(q.shape[-1]), dim=-1)
        out.append(torch.einsum("hn,hnd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C, D", [(37, 64), (3000, 128), (250, 64)])
def test_matches_direct_attention_over_wrapped_windows(dtype, C, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    S, H = 6, 4
    keys = torch.randn(S, H, C, D, device="cuda", dtype=dtype, generator=g)
    values = torch.randn(S, H, C, D, device="cuda", dtype=dtype, generator=g)
    slots = torch.tensor([3, 0, 5, 1], device="cuda")
    q_pos = torch.tensor([5 * C + 7, C - 1, 3, 2 * C], device="cuda")
    # full window, NVIDIA's window, and assorted shorter ones (lo may be negative early on)
    for lo in (q_pos - C + 1, q_pos - C + 2, torch.tensor([q_pos[0] - 5, -4, 1, 2 * C], device="cuda")):
        q = torch.randn(4, H, D, device="cuda", dtype=dtype, generator=g)
        got = attention.decode_attention(q, keys, values, slots, q_pos, lo).float()
        want = expected(q, keys, values, slots, q_pos, lo)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("C, D", [(3000, 128), (37, 64)])
def test_8bit_cache_matches_direct_attention_over_its_dequantised_window(C, D, kind):
    from engines.state.kv_ring import SCALED_STORAGE

    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability 8.9")
    _, quantize, dequantize = SCALED_STORAGE[kind]
    g = torch.Generator(device="cuda").manual_seed(1)
    S, H = 5, 4
    spread = torch.logspace(-2, 1, H, device="cuda").view(1, H, 1, 1)  # heads of unequal size
    kq, ks = quantize(torch.randn(S, H, C, D, device="cuda", generator=g) * spread)
    vq, vs = quantize(torch.randn(S, H, C, D, device="cuda", generator=g) * spread)
    slots = torch.tensor([4, 0, 2], device="cuda")
    q_pos = torch.tensor([3 * C + 11, C - 1, 5], device="cuda")
    lo = q_pos - C + 2
    q = torch.randn(3, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    got = attention.decode_attention(q, kq, vq, slots, q_pos, lo, scales=(ks, vs)).float()
    want = expected(q, dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32), slots, q_pos, lo)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()
