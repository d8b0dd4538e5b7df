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


def test_one_compilation_serves_every_step_and_its_weights_are_static(tiny_checkpoint):
    """The compiled path's step (``depformer_step_fixed``) has the same shapes at every step,
    so it compiles once; its weights are marked static, so the graph's only symbols are its
    activations' dimensions (engines/fastpath/compiled.static_shapes).  The concatenating form
    compiled three times (0, 1, then 2 or more steps so far), and with symbolic weights its
    graphs had 13, 25 and 28 symbols."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    from engines.model.lm import depformer_step_fixed

    files = ckpt.locate(tiny_checkpoint)
    lm = PersonaPlexEngine.from_files(files, 1, EngineOptions(compile=True, depformer_steps=4)).lm
    symbols: list[set] = []

    def backend(gm, example_inputs):
        values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        symbols.append(set().union(*(free_symbols(v) for v in values if isinstance(v, torch.Tensor))))
        return gm.forward

    torch._dynamo.reset()
    lm._depformer_step = torch.compile(depformer_step_fixed, backend=backend, dynamic=True, fullgraph=True)
    cfg = lm.cfg
    for B in (2, 3):
        hidden, first = torch.randn(B, cfg.dim), torch.zeros(B, dtype=torch.long)
        forced, mask = torch.zeros(B, 4, dtype=torch.long), torch.zeros(B, 4, dtype=torch.bool)
        _depformer_run(lm, hidden, first, forced, mask)
    assert len(symbols) == 1, symbols
    assert len(symbols[0]) <= 2, symbols  # the batch (and the embedding's rows)
