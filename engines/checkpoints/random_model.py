"""Engines with random weights at a model's shapes: what a tick costs does not depend on the
weight values, so these measure capacity, tick times and memory without the gated checkpoint
(the benchmark's engines, and the server's ``random:`` checkpoints, ``random_weights``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from engines.config import LMConfig, MimiConfig
from engines.runtime import memory_probe
from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine, check_gpu, plan_slots
from engines.model.lm import MoshiLM
from engines.model.mimi import MimiCodec
from engines.model.fp8_weights import fp8_state_entries, quantize_lm_tensors
from engines.state.kv_ring import WindowMode
from engines.model.layers import fp8_matmul_for
from engines.checkpoints.tokenizer import TextTokenizer
from engines.checkpoints.voices import VoiceStore, random_voice_data


def fill_random_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "layer_scale" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def random_lm(cfg: LMConfig, steps: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
              fp8_matmul: str | None = None) -> MoshiLM:
    """Random weights at ``cfg``'s shapes; ``fp8_matmul``: then quantized to fp8 as a
    checkpoint's are at load (``EngineOptions.weights``)."""
    with torch.device("meta"):
        lm = MoshiLM(cfg, steps)
    lm = lm.to(dtype=dtype).to_empty(device=device)
    fill_random_(lm, seed)
    if fp8_matmul is None:
        return lm.eval()
    with torch.device("meta"):
        quantized = MoshiLM(cfg, steps, fp8_matmul)
    entries = fp8_state_entries(quantize_lm_tensors(lm.state_dict().items()))
    quantized.load_state_dict(dict(entries), strict=True, assign=True)
    return quantized.eval()


def random_mimi(cfg: MimiConfig, num_slots: int, device: torch.device, seed: int = 1) -> MimiCodec:
    mimi = MimiCodec(cfg, num_slots, device=device)
    fill_random_(mimi, seed)
    return mimi.eval()


def build_random_engine(num_slots: int | None, device: str, tokenizer_path: Path, steps: int = 8,
                        lm_cfg: LMConfig = LMConfig(), mimi_cfg: MimiConfig = MimiConfig(),
                        cuda_graphs: bool = True, kv_cache: str = "auto", compile: bool = False,
                        weights: str = "auto", fp8_matmul: str = "auto", window: str = WindowMode.REFERENCE,
                        voice_names: Sequence[str] = (), overlap_encode: bool = True,
                        model_name: str = "random-7b-shapes", is_demo: bool = False,
                        options: EngineOptions | None = None) -> PersonaPlexEngine:
    """An engine with random weights at ``lm_cfg`` / ``mimi_cfg`` shapes (the benchmark's, and
    the server's ``PERSONAPLEX_CHECKPOINT=random:...``); ``voice_names`` get random prompts of
    the real format.  ``num_slots`` None: as many as the memory plan fits; ``options``: the
    memory plan's settings (the named arguments above take precedence)."""
    dev = torch.device(device)
    options = replace(options or EngineOptions(), device=device, window=window, depformer_steps=steps,
                      cuda_graphs=cuda_graphs, kv_cache=kv_cache, compile=compile, weights=weights,
                      fp8_matmul=fp8_matmul, overlap_encode=overlap_encode)
    check_gpu(options)
    held_before = memory_probe.held_before(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lm = random_lm(lm_cfg, steps, dev, dtype, fp8_matmul=fp8_matmul_for(dev, fp8_matmul) if weights == "fp8" else None)
    num_slots, plan, options = plan_slots(lm, mimi_cfg, num_slots, options, held_before)
    mimi = random_mimi(mimi_cfg, num_slots + 1, dev)
    voices = VoiceStore(None, None, None, lm_cfg.dim, lm_cfg.num_streams)
    for i, name in enumerate(voice_names):
        voices.register(name, random_voice_data(lm_cfg.dim, lm_cfg.initial_tokens(), seed=100 + i))
    return PersonaPlexEngine(lm, mimi, TextTokenizer(tokenizer_path), voices, num_slots, options,
                             model_name=model_name, is_demo=is_demo, memory_plan=plan)
