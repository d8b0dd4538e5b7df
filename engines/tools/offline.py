"""Offline wav-in / wav-out inference, flag-compatible with NVIDIA's ``python -m moshi.offline``.

The input WAV is the user's side of the conversation; the output WAV (same length, 24 kHz
mono) is what the model says, and the output JSON lists one text piece per 80 ms frame
('PAD' / 'EPAD' for padding), exactly as the reference writes them.

    python -m engines.tools.offline --checkpoint DIR --voice-prompt NATF2.pt \\
        --input-wav in.wav --output-wav out.wav --output-text out.json

Without ``--checkpoint`` / ``--moshi-weight`` the embedded tiny demo model is used (untrained:
for trying the tool, not for listening).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from engines.config import DEFAULT_PERSONA, FRAME_SAMPLES, SAMPLE_RATE, WEIGHT_MODES, WindowMode
from engines.errors import AudioInputError, CheckpointError
from engines.interface import EngineError, SamplingParams, SessionSpec
from engines.spec import EngineSpec

log = logging.getLogger("engines.tools.offline")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engines.tools.offline",
        description="Offline PersonaPlex inference: feed a WAV as the user's audio, write the "
        "model's speech (WAV, same length) and its per-frame text (JSON). The flags of the "
        "reference `python -m moshi.offline` (--cpu-offload excepted), plus --checkpoint for a local "
        "checkpoint directory.",
    )
    p.add_argument("--input-wav", required=True, help="user audio (any sample rate; first channel used)")
    p.add_argument("--output-wav", required=True, help="where to write the model's audio (24 kHz mono WAV)")
    p.add_argument("--output-text", required=True, help="where to write the JSON list of per-frame text pieces")
    p.add_argument("--text-prompt", default=DEFAULT_PERSONA, help="persona / system prompt (default: the reference's teacher persona)")
    p.add_argument("--voice-prompt", default="NATF2.pt",
                   help="voice prompt: a .pt name from the voice directory or checkpoint (default NATF2.pt), "
                   "or a path to a .wav recording to build a voice from")
    p.add_argument("--voice-prompt-dir", help="directory holding voice .pt files (default: the checkpoint's voices/ or voices.tgz)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="local checkpoint directory (PersonaPlex or Kyutai Moshi layout), or a "
                        "Hugging Face repo id")
    source.add_argument("--hf-repo", metavar="REPO[@REVISION]",
                        help="Hugging Face repo to load from, e.g. nvidia/personaplex-7b-v1 (gated: accept its "
                        "licence and set HF_TOKEN); only the needed files are downloaded, into the standard cache")
    p.add_argument("--tokenizer", help="path to the SentencePiece text tokenizer (overrides the checkpoint's)")
    p.add_argument("--moshi-weight", help="path to the LM safetensors (overrides the checkpoint's)")
    p.add_argument("--mimi-weight", help="path to the Mimi safetensors (overrides the checkpoint's)")
    p.add_argument("--temp-audio", type=float, default=0.8, help="audio sampling temperature (default 0.8)")
    p.add_argument("--temp-text", type=float, default=0.7, help="text sampling temperature (default 0.7)")
    p.add_argument("--topk-audio", type=int, default=250, help="audio top-k (default 250)")
    p.add_argument("--topk-text", type=int, default=25, help="text top-k (default 25)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    p.add_argument("--seed", type=int, default=-1, help="sampling seed (-1: random)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--window", choices=WindowMode.ALL, default=WindowMode.REFERENCE,
                   help="attention window once it wraps: 'reference' reproduces NVIDIA's code exactly "
                   "(default), 'full' the upstream Kyutai one")
    p.add_argument("--depformer-steps", type=int, choices=(8, 16), default=8,
                   help="depformer steps per frame: 8 agent codebooks (default) or the reference's 16")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="auto",
                   help="LM weights: 'auto' as the checkpoint stores them (default), 'fp8' the projections and "
                   "FFNs quantized to float8 at load: the 7B model in ~9 GB of GPU memory instead of ~17, with a "
                   "small numerical error (docs/PERFORMANCE.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cpu-offload", action="store_true",
                   help="the reference's layer offloading to the CPU: NOT supported here (the run stops with a "
                   "message); the bf16 7B model needs ~17 GB of GPU memory (~9 GB with --weights fp8), or run on "
                   "--device cpu")
    return p


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from engines.audio_io import read_audio, write_wav
    from engines.runtime.factory import create_torch_engine
    from engines.checkpoints.voices import build_voice_prompt

    if args.cpu_offload:
        raise ValueError("--cpu-offload is not supported by this implementation: use a GPU with ~17 GB free for "
                         "the bf16 7B model (~9 GB with --weights fp8), or --device cpu (slow)")
    for flag in ("output_wav", "output_text"):
        parent = Path(getattr(args, flag)).resolve().parent
        if not parent.is_dir():
            raise AudioInputError(f"--{flag.replace('_', '-')}: directory {parent} does not exist")
    sampling = SamplingParams(greedy=args.greedy, temp_audio=args.temp_audio, temp_text=args.temp_text,
                              topk_audio=args.topk_audio, topk_text=args.topk_text)
    voice = args.voice_prompt
    voice_wav = voice.lower().endswith(".wav")
    if args.voice_prompt_dir and not voice_wav:
        voice_path = Path(args.voice_prompt_dir) / voice
        if not voice_path.is_file():
            raise CheckpointError(f"voice prompt {voice!r} not found in {args.voice_prompt_dir} (resolved: {voice_path})")
    overrides = {k: v for k, v in (("lm_weights", args.moshi_weight), ("mimi_weights", args.mimi_weight),
                                   ("tokenizer", args.tokenizer), ("voices_dir", args.voice_prompt_dir)) if v}
    device = args.device or _default_device()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    user_pcm = read_audio(args.input_wav)
    checkpoint = args.hf_repo or args.checkpoint
    if checkpoint is None and args.moshi_weight is None:
        log.warning("no --checkpoint given: using the embedded tiny demo model, which is UNTRAINED "
                    "(its speech is noise); pass --hf-repo nvidia/personaplex-7b-v1 (or --checkpoint DIR)")
    engine = create_torch_engine(EngineSpec(checkpoint, max_slots=1, device=device, window=args.window,
                                            weights=args.weights),
                                 depformer_steps=args.depformer_steps, **overrides)
    if voice_wav:
        data = build_voice_prompt(engine, read_audio(voice))
        voice = Path(voice).with_suffix(".pt").name
        engine.voice_store.register(voice, data)
    spec = SessionSpec(voice=voice, persona=args.text_prompt, sampling=sampling,
                       seed=None if args.seed == -1 else args.seed)
    slot = engine.open_slot(spec)
    frames = -(-user_pcm.shape[0] // FRAME_SAMPLES)
    padded = np.zeros(frames * FRAME_SAMPLES, dtype=np.float32)
    padded[: user_pcm.shape[0]] = user_pcm
    audio, labels = [], []
    with torch.inference_mode():
        for i in tqdm(range(frames), desc="frames", unit="frame", disable=True if args.no_progress else None):
            out = engine.step([slot], padded[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].reshape(1, -1))[0]
            audio.append(out.pcm)
            labels.append(engine.tokenizer.label(out.text_id))
    pcm = np.concatenate(audio)[: user_pcm.shape[0]]
    write_wav(args.output_wav, pcm, SAMPLE_RATE)
    Path(args.output_text).write_text(json.dumps(labels, ensure_ascii=False), encoding="utf-8")
    log.info("wrote %s (%.2f s) and %s (%d frames)", args.output_wav, pcm.shape[0] / SAMPLE_RATE, args.output_text, frames)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        run(args)
    except (CheckpointError, AudioInputError, EngineError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
