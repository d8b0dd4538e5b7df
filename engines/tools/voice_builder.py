"""Build a PersonaPlex voice prompt (``.pt``) from a WAV file, so users can add voices.

The reference's recipe: read, resample to 24 kHz, normalise to -24 LUFS, Mimi-encode in
80 ms frames (last one zero-padded), and run one forced model call per frame with the
voice codes on the agent side, PAD text and the sine frame on the user side.  The input
embeddings of those calls and the final token ring are what the ``.pt`` stores.

    python -m engines.tools.voice_builder --hf-repo nvidia/personaplex-7b-v1 --input-wav me.wav --output voices/ME.pt
    PERSONAPLEX_VOICE_DIR=voices hypercorn orchestrator:app   # then ask for voice "ME.pt"
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from engines.audio_io import read_audio
from engines.errors import AudioInputError, CheckpointError
from engines.checkpoints.voices import build_voice_prompt
from engines.spec import EngineSpec

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engines.tools.voice_builder",
        description="Turn a recording of a voice into a PersonaPlex voice prompt (.pt). "
        "A few seconds of clean speech work best; the audio is resampled to 24 kHz and "
        "normalised to -24 LUFS first, as NVIDIA's reference does.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="checkpoint directory or Hugging Face repo id (default: the embedded "
                        "tiny demo model)")
    source.add_argument("--hf-repo", metavar="REPO[@REVISION]",
                        help="Hugging Face repo to load from, e.g. nvidia/personaplex-7b-v1 (HF_TOKEN for gated repos)")
    parser.add_argument("--input-wav", required=True, help="recording of the voice (any rate; first channel used)")
    parser.add_argument("--output", required=True, help="where to write the .pt (name it e.g. MYVOICE.pt)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    out = Path(args.output)
    if out.suffix != ".pt":
        parser.error("--output must end in .pt")
    if out.exists() and not args.force:
        parser.error(f"{out} exists; pass --force to overwrite")
    from engines.runtime.factory import create_torch_engine

    checkpoint = args.hf_repo or args.checkpoint
    if checkpoint is None:
        log.warning("no --checkpoint given: building the voice with the embedded tiny demo model; "
                    "such a voice only fits that model (pass --hf-repo nvidia/personaplex-7b-v1 for real weights)")
    try:
        engine = create_torch_engine(EngineSpec(checkpoint, max_slots=1, device=args.device))
        pcm = read_audio(args.input_wav)
        voice = build_voice_prompt(engine, pcm)
    except (CheckpointError, AudioInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(voice, out)
    log.info("wrote %s (%d voice frames); to use it, put it in the server's PERSONAPLEX_VOICE_DIR (or the "
             "offline tool's --voice-prompt-dir) and ask for voice %r", out, voice["embeddings"].shape[0] + 1,
             out.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
