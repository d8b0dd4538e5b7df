"""The depformer's codebook step as one compiled piece (``MoshiLM.compile_blocks``): the
same function as the eager step up to rounding, on the CPU inductor backend, with all 16
steps in the reference window (whose last step no longer sees step 0) and forced tokens."""

from __future__ import annotations

import torch

from engines.checkpoints import loader as ckpt
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
from engines.state.kv_ring import WindowMode


def _depformer_run(lm, hidden, first, forced, mask):
    logits = []

    def greedy(k, step_logits):
        logits.append(step_logits)
        return step_logits.argmax(-1)

    with torch.inference_mode():
        tokens = lm.depformer(hidden, first, forced, mask, greedy, WindowMode.REFERENCE)
    return tokens, torch.stack(logits, dim=1)


def test_compiled_depformer_step_matches_the_eager_one(tiny_checkpoint):
    files = ckpt.locate(tiny_checkpoint)
    options = dict(depformer_steps=16)
    eager = PersonaPlexEngine.from_files(files, 1, EngineOptions(**options)).lm
    compiled = PersonaPlexEngine.from_files(files, 1, EngineOptions(compile=True, **options)).lm
    assert compiled._depformer_step is not eager._depformer_step
    cfg = eager.cfg
    g = torch.Generator().manual_seed(11)
    B, steps = 3, 16
    hidden = torch.randn(B, cfg.dim, generator=g)
    first = torch.randint(0, cfg.text_card, (B,), generator=g)
    forced = torch.randint(0, cfg.card, (B, steps), generator=g)
    mask = torch.rand(B, steps, generator=g) < 0.3
    want_tokens, want = _depformer_run(eager, hidden, first, forced, mask)
    got_tokens, got = _depformer_run(compiled, hidden, first, forced, mask)
    assert got.shape == (B, steps, cfg.card)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), (got - want).abs().max()
    assert torch.equal(got_tokens, want_tokens)


def test_the_compiled_steps_weights_have_static_shapes(tiny_checkpoint):
    """Every weight dimension a symbol was what made the depformer step slow to trace and to
    load from the caches (engines/fastpath/compiled.static_shapes): the compiled step's
    weights are marked static, so its graph's symbols are only its activations' dimensions
    (3, 4 and 6 in the three variants; 13, 25 and 28 with the weights' dimensions symbolic)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    files = ckpt.locate(tiny_checkpoint)
    lm = PersonaPlexEngine.from_files(files, 1, EngineOptions(compile=True, depformer_steps=4)).lm
    symbols: list[set] = []

    def backend(gm, example_inputs):
        values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        symbols.append(set().union(*(free_symbols(v) for v in values if isinstance(v, torch.Tensor))))
        return gm.forward

    torch._dynamo.reset()
    from engines.model.lm import depformer_step
    lm._depformer_step = torch.compile(depformer_step, backend=backend, dynamic=True, fullgraph=True)
    cfg = lm.cfg
    B = 3
    hidden, first = torch.randn(B, cfg.dim), torch.zeros(B, dtype=torch.long)
    forced, mask = torch.zeros(B, 4, dtype=torch.long), torch.zeros(B, 4, dtype=torch.bool)
    _depformer_run(lm, hidden, first, forced, mask)
    assert len(symbols) == 3, symbols  # steps so far 0, 1, then any
    assert all(len(s) <= 6 for s in symbols), symbols
