"""Our LM against the PyPI moshi 0.2.13 oracle on identical random tiny weights.

Teacher forcing over more steps than the attention context, so the ring buffer wraps.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engines.checkpoints.loader import SafetensorsReader, load_lm_tensors
from engines.model.lm import MoshiLM
from engines.state.kv_ring import SlotKVRing, WindowMode
from engines.checkpoints.tiny import TINY_LM
from tests.oracle import official_lm_state_dict, tiny_oracle_lm

STEPS = TINY_LM.context + 14  # wraps the 32-position window


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    oracle = tiny_oracle_lm(TINY_LM, seed=3)
    path = tmp_path_factory.mktemp("lm") / "model.safetensors"
    save_file(official_lm_state_dict(oracle, TINY_LM.dep_q), str(path))
    ours = MoshiLM(TINY_LM, depformer_steps=16)
    ours.load_state_dict(load_lm_tensors(SafetensorsReader(path), TINY_LM, 16), strict=True, assign=True)
    return oracle, ours


def _codes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, TINY_LM.card, (1, TINY_LM.num_streams, STEPS), generator=g)
    codes[:, 0] = torch.randint(0, TINY_LM.text_card, (1, STEPS), generator=g)
    return codes


def _run_ours(lm: MoshiLM, codes: torch.Tensor, window: str, slot: int = 1):
    kv = SlotKVRing(TINY_LM.num_layers, 3, TINY_LM.num_heads, TINY_LM.context, TINY_LM.head_dim)
    slots = torch.tensor([slot])
    text, dep = [], []
    forced = torch.ones(1, 16, dtype=torch.bool)
    with torch.no_grad():
        for t in range(STEPS - 1):
            h = lm.temporal(slots, lm.embed_tokens(codes[:, :, t : t + 1].transpose(1, 2)), kv, window)
            text.append(lm.text_logits(h)[0, 0])
            target = codes[:, :, t + 1]
            logits = []
            lm.depformer(h[:, 0], target[:, 0], target[:, 1:17], forced,
                         lambda k, lg: (logits.append(lg[0]), lg.argmax(-1))[1], window)
            dep.append(torch.stack(logits))
    return torch.stack(text), torch.stack(dep)


def _run_oracle(oracle, codes: torch.Tensor):
    text, dep = [], []
    with torch.no_grad(), oracle.streaming(1):
        for t in range(STEPS - 1):
            h, text_logits = oracle.forward_text(codes[:, :, t : t + 1])
            text.append(text_logits[0, 0, 0])
            target = codes[:, :, t + 1]
            logits = []
            with oracle.depformer.streaming(1):
                for k in range(16):
                    logits.append(oracle.forward_depformer(k, target[:, k : k + 1, None], h)[0, 0, 0])
            dep.append(torch.stack(logits))
    return torch.stack(text), torch.stack(dep)


def test_full_window_matches_oracle_over_window_wrap(models):
    oracle, ours = models
    codes = _codes(0)
    text_o, dep_o = _run_oracle(oracle, codes)
    text, dep = _run_ours(ours, codes, WindowMode.FULL)
    scale = text_o.abs().max()
    assert torch.allclose(text, text_o, atol=1e-5 * scale, rtol=0), (text - text_o).abs().max()
    assert torch.allclose(dep, dep_o, atol=1e-5 * dep_o.abs().max(), rtol=0), (dep - dep_o).abs().max()
    assert torch.equal(text.argmax(-1), text_o.argmax(-1))
    assert torch.equal(dep.argmax(-1), dep_o.argmax(-1))


def test_reference_window_is_the_oracle_with_one_key_less(models):
    """NVIDIA's ring drops the oldest key once wrapped: with one token per call a query sees
    context-1 keys, i.e. exactly what the upstream full window of context-1 sees."""
    oracle, ours = models
    codes = _codes(1)
    text_full, _ = _run_ours(ours, codes, WindowMode.FULL)
    text_ref, _ = _run_ours(ours, codes, WindowMode.REFERENCE)
    wrap = TINY_LM.context - 1  # first query position whose windows differ
    assert torch.equal(text_ref[:wrap], text_full[:wrap])
    assert not torch.allclose(text_ref[wrap:], text_full[wrap:])
    for module in oracle.transformer.modules():
        if hasattr(module, "context") and hasattr(module, "in_projs"):
            module.context = TINY_LM.context - 1
    try:
        text_o, _ = _run_oracle(oracle, codes)
    finally:
        for module in oracle.transformer.modules():
            if hasattr(module, "context") and hasattr(module, "in_projs"):
                module.context = TINY_LM.context
    assert torch.allclose(text_ref, text_o, atol=1e-5 * text_o.abs().max(), rtol=0)


def test_slot_choice_does_not_change_results(models):
    _, ours = models
    codes = _codes(2)
    a, _ = _run_ours(ours, codes, WindowMode.REFERENCE, slot=0)
    b, _ = _run_ours(ours, codes, WindowMode.REFERENCE, slot=2)
    assert torch.equal(a, b)
