"""The Triton decode attention against a direct computation (runs only where CUDA is)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.gpu import attention

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
