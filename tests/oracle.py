"""The PyPI ``moshi`` 0.2.13 package as a conformance oracle (installed with --no-deps).

Nothing here is used at run time; tests build tiny random moshi models, export them in
the official checkpoint layout and compare our implementation with them.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # keep moshi from calling torch.compile on CPU


def import_moshi():
    return pytest.importorskip("moshi.models.lm", reason="the PyPI moshi==0.2.13 oracle is not installed")


def tiny_oracle_lm(cfg, seed: int = 0):
    """A moshi ``LMModel`` with ``cfg``'s shapes and random weights (RMS alphas randomised too)."""
    lm_mod = import_moshi()
    torch.manual_seed(seed)
    kwargs = cfg.to_moshi_kwargs()
    kwargs.pop("depformer_context", None)
    kwargs.pop("depformer_max_period", None)
    kwargs.pop("depformer_layer_scale", None)
    model = lm_mod.LMModel(device="cpu", dtype=torch.float32, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.eval()


def official_lm_state_dict(model, dep_q: int) -> dict[str, torch.Tensor]:
    """moshi 0.2.13 ``state_dict()`` with attention re-fused as in the official file."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    fused: dict[str, list] = {}
    for k, v in sd.items():
        for split, name in (("self_attn.in_projs.", "self_attn.in_proj_weight"), ("self_attn.out_projs.", "self_attn.out_proj.weight")):
            if split in k:
                prefix, rest = k.split(split)
                idx = int(rest.split(".")[0])
                fused.setdefault(prefix + name, []).append((idx, v))
                break
        else:
            out[k] = v
    for k, parts in fused.items():
        out[k] = torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])], dim=0)
    return out
