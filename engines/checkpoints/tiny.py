"""A tiny, random, deterministic PersonaPlex checkpoint in the official file layout.

Widths are tiny, but the stream layout and vocabularies are the real ones (17 streams,
text ids 0..31999 with PAD 3 / EPAD 0, audio ids 0..2047, initial ids 32000 / 2048), so the
silence / sine codes, the delays and every protocol path behave as with the 7B model.  It
is what the tests and the server's embedded default run; it is NOT a trained model and
produces noise-like audio.

    python -m engines.checkpoints.tiny OUT_DIR [--seed 0] [--force]

Files written (as in ``nvidia/personaplex-7b-v1``): ``model.safetensors`` (bf16),
``tokenizer-e351c8d8-checkpoint125.safetensors`` (fp32), ``tokenizer_spm_32k_3.model``,
``voices.tgz`` (voices/NATF2.pt, NATM1.pt, VARF0.pt, built from synthetic voices by the
voice builder) and a Kyutai-style ``config.json`` + ``mimi_config.json`` declaring the tiny
widths.  Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import logging
import math
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from engines.checkpoints import loader as ckpt
from engines.config import LMConfig, MimiConfig, MimiTransformerConfig, QuantizerConfig, SeanetConfig, default_cache_dir

log = logging.getLogger(__name__)

TINY_VERSION = 1
TINY_LM = LMConfig(
    dim=64, num_heads=4, num_layers=2, context=32,
    depformer_dim=32, depformer_dim_feedforward=132, depformer_num_heads=2, depformer_num_layers=2,
    dep_q=16,
)
TINY_MIMI = MimiConfig(
    seanet=SeanetConfig(dimension=32, n_filters=4),
    transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=2, dim_feedforward=64, context=20),
    quantizer=QuantizerConfig(dimension=16, n_q=32, bins=2048, input_dimension=32, output_dimension=32),
)
TINY_VOICES = {"NATF2.pt": 210.0, "NATM1.pt": 120.0, "VARF0.pt": 250.0}  # synthetic f0 in Hz
TOKENIZER_VOCAB = 400

_CORPUS = """\
You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way.
You enjoy having a good conversation. Have a deep conversation about technology. Your name is Jane.
You are a concise and helpful assistant. You are a calm and precise assistant.
You are a cheerful travel assistant who knows every city, beach and mountain.
Hello, how are you today? I am fine, thank you. What would you like to talk about?
The weather is nice and the sun is shining over the river and the old bridge.
Could you tell me more about that? Of course, let me explain it step by step.
People speak, listen and think at the same time; a good conversation flows both ways.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy.
Music, books, science, history, cooking, sports and games are popular topics.
I don't know the answer, but we can find it together. That sounds great!
Yes. No. Maybe. Sure. Okay. Right. Well. So. Hmm. Really? Wow. Thanks. Bye.
"""


# LM -----------------------------------------------------------------------------------------
def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def lm_tensors(cfg: LMConfig, gen: torch.Generator, text_vocab: int) -> dict[str, torch.Tensor]:
    """Random LM weights under the official key names (fused attention, all depformer steps)."""
    d, dd, h, hd = cfg.dim, cfg.depformer_dim, cfg.ffn_hidden, cfg.depformer_ffn_hidden
    t: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_q):
        t[f"emb.{i}.weight"] = _normal(gen, (cfg.card + 1, d), 1 / math.sqrt(d))
    t["text_emb.weight"] = _normal(gen, (cfg.text_card + 1, d), 1 / math.sqrt(d))
    for layer in range(cfg.num_layers):
        p = f"transformer.layers.{layer}."
        t[p + "self_attn.in_proj_weight"] = _normal(gen, (3 * d, d), 1 / math.sqrt(d))
        t[p + "self_attn.out_proj.weight"] = _normal(gen, (d, d), 1 / math.sqrt(d))
        t[p + "norm1.alpha"] = 1 + 0.1 * torch.randn((1, 1, d), generator=gen)
        t[p + "norm2.alpha"] = 1 + 0.1 * torch.randn((1, 1, d), generator=gen)
        t[p + "gating.linear_in.weight"] = _normal(gen, (2 * h, d), 1 / math.sqrt(d))
        t[p + "gating.linear_out.weight"] = _normal(gen, (d, h), 1 / math.sqrt(h))
    t["out_norm.alpha"] = 1 + 0.1 * torch.randn((1, 1, d), generator=gen)
    text_linear = _normal(gen, (cfg.text_card, d), 1 / math.sqrt(d))
    # Ids the tiny tokenizer does not have get zero logits, so the demo model speaks in
    # pieces that exist (the real vocabulary size is kept for the layout).
    text_linear[text_vocab:] = 0
    t["text_linear.weight"] = text_linear
    for s in range(cfg.dep_q):
        t[f"depformer_in.{s}.weight"] = _normal(gen, (dd, d), 1 / math.sqrt(d))
        t[f"linears.{s}.weight"] = _normal(gen, (cfg.card, dd), 1 / math.sqrt(dd))
    for s in range(cfg.dep_q - 1):
        t[f"depformer_emb.{s}.weight"] = _normal(gen, (cfg.card + 1, dd), 1 / math.sqrt(dd))
    t["depformer_text_emb.weight"] = _normal(gen, (cfg.text_card + 1, dd), 1 / math.sqrt(dd))
    for layer in range(cfg.depformer_num_layers):
        p = f"depformer.layers.{layer}."
        t[p + "self_attn.in_proj_weight"] = _normal(gen, (cfg.dep_q * 3 * dd, dd), 1 / math.sqrt(dd))
        t[p + "self_attn.out_proj.weight"] = _normal(gen, (cfg.dep_q * dd, dd), 1 / math.sqrt(dd))
        t[p + "norm1.alpha"] = 1 + 0.1 * torch.randn((1, 1, dd), generator=gen)
        t[p + "norm2.alpha"] = 1 + 0.1 * torch.randn((1, 1, dd), generator=gen)
        for s in range(cfg.dep_q):
            t[p + f"gating.{s}.linear_in.weight"] = _normal(gen, (2 * hd, dd), 1 / math.sqrt(dd))
            t[p + f"gating.{s}.linear_out.weight"] = _normal(gen, (dd, hd), 1 / math.sqrt(hd))
    return {k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}


# Mimi ---------------------------------------------------------------------------------------
def _conv(t: dict, gen: torch.Generator, key: str, c_out: int, c_in: int, k: int, bias: bool = True) -> None:
    t[key + ".weight"] = _normal(gen, (c_out, c_in, k), 1 / math.sqrt(c_in * k))
    if bias:
        t[key + ".bias"] = 0.01 * torch.randn((c_out,), generator=gen)


def _resblock(t: dict, gen: torch.Generator, prefix: str, dim: int, cfg: SeanetConfig) -> None:
    hidden = dim // cfg.compress
    _conv(t, gen, prefix + ".block.1.conv.conv", hidden, dim, cfg.residual_kernel_size)
    _conv(t, gen, prefix + ".block.3.conv.conv", dim, hidden, 1)


def mimi_tensors(cfg: MimiConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random Mimi weights under the official key names (model.md 5.3)."""
    s, tr, q = cfg.seanet, cfg.transformer, cfg.quantizer
    t: dict[str, torch.Tensor] = {}
    # Encoder: conv, then per (reversed) ratio: residual blocks, ELU, strided conv; ELU, conv.
    i, mult = 0, 1
    _conv(t, gen, f"encoder.model.{i}.conv.conv", s.n_filters, s.channels, s.kernel_size)
    i += 1
    for ratio in reversed(s.ratios):
        for _ in range(s.n_residual_layers):
            _resblock(t, gen, f"encoder.model.{i}", mult * s.n_filters, s)
            i += 1
        i += 1  # ELU
        _conv(t, gen, f"encoder.model.{i}.conv.conv", 2 * mult * s.n_filters, mult * s.n_filters, 2 * ratio)
        i += 1
        mult *= 2
    i += 1  # ELU
    _conv(t, gen, f"encoder.model.{i}.conv.conv", s.dimension, mult * s.n_filters, s.last_kernel_size)
    # Decoder: conv, then per ratio: ELU, transposed conv, residual blocks; ELU, conv.
    i, mult = 0, 2 ** len(s.ratios)
    _conv(t, gen, f"decoder.model.{i}.conv.conv", mult * s.n_filters, s.dimension, s.kernel_size)
    i += 1
    for ratio in s.ratios:
        i += 1  # ELU
        c_in, c_out = mult * s.n_filters, mult * s.n_filters // 2
        t[f"decoder.model.{i}.convtr.convtr.weight"] = _normal(gen, (c_in, c_out, 2 * ratio), 1 / math.sqrt(c_in * 2))
        t[f"decoder.model.{i}.convtr.convtr.bias"] = 0.01 * torch.randn((c_out,), generator=gen)
        i += 1
        for _ in range(s.n_residual_layers):
            _resblock(t, gen, f"decoder.model.{i}", c_out, s)
            i += 1
        mult //= 2
    i += 1  # ELU
    _conv(t, gen, f"decoder.model.{i}.conv.conv", s.channels, s.n_filters, s.last_kernel_size)
    d = tr.d_model
    for side in ("encoder", "decoder"):
        for layer in range(tr.num_layers):
            p = f"{side}_transformer.transformer.layers.{layer}."
            t[p + "self_attn.in_proj_weight"] = _normal(gen, (3 * d, d), 1 / math.sqrt(d))
            t[p + "self_attn.out_proj.weight"] = _normal(gen, (d, d), 1 / math.sqrt(d))
            for norm in ("norm1", "norm2"):
                t[p + norm + ".weight"] = 1 + 0.1 * torch.randn((d,), generator=gen)
                t[p + norm + ".bias"] = 0.1 * torch.randn((d,), generator=gen)
            t[p + "linear1.weight"] = _normal(gen, (tr.dim_feedforward, d), 1 / math.sqrt(d))
            t[p + "linear2.weight"] = _normal(gen, (d, tr.dim_feedforward), 1 / math.sqrt(tr.dim_feedforward))
            t[p + "layer_scale_1.scale"] = torch.full((d,), tr.layer_scale)
            t[p + "layer_scale_2.scale"] = torch.full((d,), tr.layer_scale)
    t["downsample.conv.conv.conv.weight"] = _normal(gen, (s.dimension, s.dimension, 4), 1 / math.sqrt(s.dimension * 4))
    t["upsample.convtr.convtr.convtr.weight"] = _normal(gen, (s.dimension, 1, 4), 0.5)
    for name, layers in (("rvq_first", 1), ("rvq_rest", q.n_q - 1)):
        p = f"quantizer.{name}."
        t[p + "input_proj.weight"] = _normal(gen, (q.dimension, q.input_dimension, 1), 1 / math.sqrt(q.input_dimension))
        t[p + "output_proj.weight"] = _normal(gen, (q.output_dimension, q.dimension, 1), 1 / math.sqrt(q.dimension))
        for layer in range(layers):
            c = p + f"vq.layers.{layer}._codebook."
            t[c + "_initialized"] = torch.ones(1)
            t[c + "cluster_usage"] = 0.5 + torch.rand((q.bins,), generator=gen)
            # Later residual levels see smaller residuals: shrink their codebooks.
            t[c + "embedding_sum"] = _normal(gen, (q.bins, q.dimension), 0.5 ** layer) * t[c + "cluster_usage"][:, None]
    return {k: v.float().contiguous() for k, v in t.items()}


# Tokenizer ------------------------------------------------------------------------------------
def train_tokenizer(path: Path) -> None:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS.splitlines()),
        model_writer=model,
        vocab_size=TOKENIZER_VOCAB,
        hard_vocab_limit=False,
        model_type="bpe",
        character_coverage=1.0,
        # The real tokenizer's special ids: 0 unk ("EPAD" in outputs), 1 BOS, 2 EOS, 3 PAD.
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        user_defined_symbols=["<system>"],
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())


# Voices ---------------------------------------------------------------------------------------
def synthetic_voice(f0: float, seconds: float = 2.0, sample_rate: int = 24000) -> np.ndarray:
    """A deterministic speech-like signal: harmonics with vibrato and a syllable envelope."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = f0 * (1 + 0.05 * np.sin(2 * np.pi * 3.0 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * t)) + 0.1
    return (0.2 * wave * envelope).astype(np.float32)


def _write_voices_archive(path: Path, voices: dict[str, dict[str, torch.Tensor]]) -> None:
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(voices):
            buf = io.BytesIO()
            torch.save(voices[name], buf)
            info = tarfile.TarInfo(f"voices/{name}")
            info.size = buf.tell()
            info.mtime = 0
            buf.seek(0)
            tar.addfile(info, buf)
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(tar_bytes.getvalue())


# Entry points ------------------------------------------------------------------------------------
def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint into ``out_dir`` (created; must not hold a checkpoint)."""
    from engines.runtime.torch_engine import EngineOptions, PersonaPlexEngine
    from engines.checkpoints.voices import build_voice_prompt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    train_tokenizer(out / ckpt.TOKENIZER_FILE)
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_file=str(out / ckpt.TOKENIZER_FILE)).get_piece_size()
    save_file(lm_tensors(TINY_LM, gen, vocab), str(out / ckpt.LM_FILE), metadata={"format": "pt"})
    save_file(mimi_tensors(TINY_MIMI, gen), str(out / ckpt.MIMI_FILE), metadata={"format": "pt"})
    config = dict(TINY_LM.to_moshi_kwargs(), moshi_name=ckpt.LM_FILE, mimi_name=ckpt.MIMI_FILE,
                  tokenizer_name=ckpt.TOKENIZER_FILE, mimi_config_name="mimi_config.json")
    (out / ckpt.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / "mimi_config.json").write_text(json.dumps(TINY_MIMI.to_moshi_config(), indent=2) + "\n")
    (out / "README.md").write_text(
        "Tiny random PersonaPlex-layout checkpoint written by `python -m engines.checkpoints.tiny`.\n"
        "Untrained: for tests and demos only. Real weights: nvidia/personaplex-7b-v1.\n"
    )
    engine = PersonaPlexEngine.from_files(ckpt.locate(out), num_slots=1, options=EngineOptions(device="cpu"))
    voices = {name: build_voice_prompt(engine, synthetic_voice(f0)) for name, f0 in TINY_VOICES.items()}
    _write_voices_archive(out / ckpt.VOICES_ARCHIVE, voices)
    return out


def ensure_tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The embedded default checkpoint, generated once (atomically) into the cache."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-v{TINY_VERSION}"
    if (target / ckpt.VOICES_ARCHIVE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("generating the embedded tiny demo checkpoint in %s (one time, a few seconds)", target)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ckpt.VOICES_ARCHIVE).is_file():  # lost a race to a broken dir
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engines.checkpoints.tiny",
        description="Write a tiny random PersonaPlex checkpoint (official file layout) for tests and demos.",
    )
    parser.add_argument("out_dir", help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0; same seed, same bytes)")
    parser.add_argument("--force", action="store_true", help="overwrite files of an existing checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        parser.error(f"{out} is not empty; pass --force to overwrite")
    write_tiny_checkpoint(out, seed=args.seed)
    log.info("wrote tiny checkpoint to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
