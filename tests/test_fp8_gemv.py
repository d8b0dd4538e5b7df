"""The few-row fp8 weight product (``engines.fastpath.fp8_gemv``) against the dequantized
product: on CPU through Triton's interpreter, on a GPU directly and inside a compiled piece.

The CPU check runs fp16 activations (the interpreter's bf16 arithmetic is not to be
trusted: it returned garbage for bf16 ``tl.dot`` operands); the GPU check runs the engine's
bf16.  (The H200 machine's Triton fails in the interpreter itself, as with the KV
ring's interpreter test; the GPU test is the one that counts there.)  Runs in a subprocess because the interpreter is chosen when Triton is
imported.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from tests.triton_interpreter import worst_error_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from engines.fastpath import fp8_gemv
    from engines.model.fp8_weights import quantize_weight

    torch.manual_seed(0)
    worst = 0.0
    # Rows 1..KERNEL_ROWS, channels and K that do not fill a block (and K that does), and a
    # weight that is one step of a depformer-style stack (a view with an offset).
    stack = quantize_weight(torch.randn(3, 40, 300))
    # K of 2 and 5 whole steps of 512.
    cases = [(1, 40, 300, None), (3, 16, 1024, None), (4, 33, 70, None), (2, 64, 513, None), (2, 40, 300, 1),
             (2, 7, 2560, None), (4, 5, 1024, None)]
    for M, N, K, step in cases:
        q = quantize_weight(torch.randn(N, K)) if step is None else None
        data, scale = (q.data, q.scale) if q is not None else (stack.data[step], stack.scale[step])
        x = torch.randn(M, 1, K).to(torch.float16)
        assert fp8_gemv.available(x) == (M <= fp8_gemv.GEMV_ROWS)
        y = fp8_gemv.fp8_gemv(x, data, scale)
        assert y.shape == (M, 1, N) and y.dtype == torch.float16
        want = x.float() @ (data.float() * scale[:, None]).t()
        worst = max(worst, ((y.float() - want).abs().max() / want.abs().max()).item())
    # Above GEMV_ROWS rows, or in float32, it is not taken.
    assert not fp8_gemv.available(torch.zeros(fp8_gemv.GEMV_ROWS + 1, 1, 8, dtype=torch.float16))
    assert not fp8_gemv.available(torch.zeros(1, 8, dtype=torch.float32))
    assert not fp8_gemv.available(torch.zeros(0, 8, dtype=torch.float16))  # no rows: nothing to launch
    print(worst)
""")


def test_few_row_fp8_product_matches_the_dequantized_product_in_the_interpreter():
    worst = worst_error_in_interpreter(SCRIPT)
    assert worst < 2e-3, worst  # fp16 rounding of the result


def test_without_a_gpu_or_the_interpreter_the_product_is_not_taken():
    from engines.fastpath import fp8_gemv

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("only meaningful on a plain CPU process")
    assert not fp8_gemv.available(torch.zeros(1, 1, 16, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_few_row_fp8_product_on_the_gpu_at_7b_shapes_and_compiled():
    from engines.fastpath import fp8_gemv
    from engines.fastpath.compiled import compile_dynamic
    from engines.model.fp8_weights import quantize_weight

    torch.manual_seed(0)
    for N, K in ((12288, 4096), (4096, 11264), (3072, 1024)):
        q = quantize_weight(torch.randn(N, K, device="cuda"))
        deq = (q.data.float() * q.scale[:, None]).to(torch.bfloat16)
        for M in range(1, fp8_gemv.KERNEL_ROWS + 1):
            x = torch.randn(M, 1, K, device="cuda").to(torch.bfloat16)
            y = fp8_gemv.fp8_gemv(x, q.data, q.scale)
            want = torch.nn.functional.linear(x, deq).float()
            rel = float((y.float() - want).norm() / want.norm())
            assert rel < 1e-2, (N, K, M, rel)
    compiled = compile_dynamic(lambda x, w, s: fp8_gemv.fp8_gemv(x, w, s) * 2)
    x = torch.randn(2, 1, 1024, device="cuda").to(torch.bfloat16)
    assert torch.equal(compiled(x, q.data, q.scale), fp8_gemv.fp8_gemv(x, q.data, q.scale) * 2)
