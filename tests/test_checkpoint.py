"""Checkpoint discovery and validation: layouts, key name variants, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.checkpoints import loader as ckpt
from engines.config import LMConfig, replace
from engines.errors import CheckpointError
from engines.checkpoints.tiny import TINY_LM


class RecordingReader:
    """Stands in for a 16.7 GB file: hands out empty tensors of the shape asked for."""

    path = Path("model.safetensors")

    def __init__(self, steps: int) -> None:
        self.requested: dict[str, tuple] = {}
        self.steps = steps

    def has(self, key):
        if key.startswith("linears."):
            return int(key.split(".")[1]) < self.steps
        return "in_projs" not in key and "out_projs" not in key

    def shape(self, key):
        return self._shapes[key]

    def get(self, key, shape=None):
        if shape is None:
            shape = self._shapes[key]
        self.requested[key] = tuple(shape)
        return torch.empty(shape, device="meta")


def test_personaplex_7b_key_set_matches_the_real_checkpoint():
    cfg = LMConfig()  # an empty config.json means these defaults
    reader = RecordingReader(steps=16)
    dd = cfg.depformer_dim
    reader._shapes = {}
    for layer in range(cfg.num_layers):
        reader._shapes[f"transformer.layers.{layer}.self_attn.in_proj_weight"] = (3 * cfg.dim, cfg.dim)
        reader._shapes[f"transformer.layers.{layer}.self_attn.out_proj.weight"] = (cfg.dim, cfg.dim)
    for layer in range(cfg.depformer_num_layers):
        reader._shapes[f"depformer.layers.{layer}.self_attn.in_proj_weight"] = (16 * 3 * dd, dd)
        reader._shapes[f"depformer.layers.{layer}.self_attn.out_proj.weight"] = (16 * dd, dd)
    ckpt.load_lm_tensors(reader, cfg, steps=16)
    keys = reader.requested
    assert len(keys) == 475  # spec/model.md 5.2
    assert keys["transformer.layers.31.gating.linear_in.weight"] == (22528, 4096)
    assert keys["transformer.layers.0.gating.linear_out.weight"] == (4096, 11264)
    assert keys["depformer.layers.5.gating.15.linear_in.weight"] == (5632, 1024)
    assert keys["depformer_emb.14.weight"] == (2049, 1024)
    assert keys["text_linear.weight"] == (32000, 4096)
    assert keys["out_norm.alpha"] == (1, 1, 4096)


def test_empty_config_means_personaplex_defaults(tiny_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, d)
    (d / "config.json").write_text("")
    assert ckpt.locate(d).lm_config == LMConfig()


def test_kyutai_config_is_parsed(tiny_checkpoint):
    files = ckpt.locate(tiny_checkpoint)
    assert files.lm_config == TINY_LM
    assert files.mimi_config.seanet.dimension == 32
    assert files.voices_archive is not None


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: (d / "model.safetensors").unlink(), "LM weights not found"),
        (lambda d: (d / "tokenizer_spm_32k_3.model").unlink(), "text tokenizer not found"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "config.json").write_text('{"dim": 64, "gating": "gelu"}'), "gating"),
        (lambda d: (d / "config.json").write_text('{"conditioners": {"x": 1}}'), "conditioners"),
    ],
)
def test_locate_errors_name_the_problem(tiny_checkpoint, tmp_path, mutate, message):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, d)
    mutate(d)
    with pytest.raises(CheckpointError, match=message):
        ckpt.locate(d)


def test_missing_directory():
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        ckpt.locate("/nonexistent/checkpoint")


def _rewrite_lm(tmp_path, tiny_checkpoint, edit) -> Path:
    tensors = load_file(str(Path(tiny_checkpoint) / "model.safetensors"))
    edit(tensors)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_missing_and_misshaped_tensors_are_named(tiny_checkpoint, tmp_path):
    path = _rewrite_lm(tmp_path, tiny_checkpoint, lambda t: t.pop("transformer.layers.1.norm2.alpha"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'transformer.layers.1.norm2.alpha'"):
        ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), TINY_LM, 8)

    def shrink(t):
        t["text_emb.weight"] = t["text_emb.weight"][:100]

    path = _rewrite_lm(tmp_path, tiny_checkpoint, shrink)
    with pytest.raises(CheckpointError, match=r"'text_emb.weight' has shape \(100, 64\), expected \(32001, 64\)"):
        ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), TINY_LM, 8)


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        ckpt.SafetensorsReader(path)


def test_split_attention_names_load_like_fused(tiny_checkpoint, tmp_path):
    fused = ckpt.load_lm_tensors(ckpt.SafetensorsReader(Path(tiny_checkpoint) / "model.safetensors"), TINY_LM, 16)
    dd = TINY_LM.depformer_dim

    def split(t):
        for key in [k for k in t if "self_attn" in k]:
            w = t.pop(key)
            prefix, kind = key.rsplit("self_attn.", 1)
            rows = (3 * dd if "in_proj" in kind else dd) if prefix.startswith("depformer") else w.shape[0]
            name = "in_projs" if "in_proj" in kind else "out_projs"
            for i, part in enumerate(w.split(rows)):
                t[f"{prefix}self_attn.{name}.{i}.weight"] = part.clone()

    path = _rewrite_lm(tmp_path, tiny_checkpoint, split)
    loaded = ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), TINY_LM, 16)
    assert loaded.keys() == fused.keys()
    assert all(torch.equal(loaded[k], fused[k]) for k in fused)


def test_eight_step_depformer_file(tiny_checkpoint, tmp_path):
    """A Moshi-style file with 8 depformer steps serves the default 8-step mode and refuses
    the 16-step conformance mode with a clear message."""
    dd = TINY_LM.depformer_dim

    def drop_user_steps(t):
        for key in list(t):
            parts = key.split(".")
            if key.startswith(("linears.", "depformer_in.")) and int(parts[1]) >= 8:
                del t[key]
            elif key.startswith("depformer_emb.") and int(parts[1]) >= 7:
                del t[key]
            elif ".gating." in key and key.startswith("depformer") and int(parts[4]) >= 8:
                del t[key]
        for layer in range(TINY_LM.depformer_num_layers):
            p = f"depformer.layers.{layer}.self_attn."
            t[p + "in_proj_weight"] = t[p + "in_proj_weight"][: 8 * 3 * dd].clone()
            t[p + "out_proj.weight"] = t[p + "out_proj.weight"][: 8 * dd].clone()

    path = _rewrite_lm(tmp_path, tiny_checkpoint, drop_user_steps)
    full = ckpt.load_lm_tensors(ckpt.SafetensorsReader(Path(tiny_checkpoint) / "model.safetensors"), TINY_LM, 8)
    eight = ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), TINY_LM, 8)
    assert all(torch.equal(eight[k], full[k]) for k in full)
    with pytest.raises(CheckpointError, match="16-step conformance mode needs a 16-step checkpoint"):
        ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), TINY_LM, 16)
    moshi_cfg = replace(TINY_LM, dep_q=8)
    assert ckpt.load_lm_tensors(ckpt.SafetensorsReader(path), moshi_cfg, 8).keys() == full.keys()


def test_kyutai_config_json_round_trip():
    cfg = LMConfig.from_moshi_kwargs(json.loads(json.dumps(TINY_LM.to_moshi_kwargs())))
    assert cfg == TINY_LM
