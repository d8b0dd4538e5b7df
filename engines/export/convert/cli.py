"""``python convert_checkpoint.py``: the command line of the converter (logic in ``pipeline``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engines.config import BUILD_DTYPES, BUILD_KV_CACHE_DTYPES  # torch-free: --help needs no torch

log = logging.getLogger("convert_checkpoint")

TARGETS = ("trtllm", "torch-fp8")

DESCRIPTION = """\
Convert a PersonaPlex / Moshi checkpoint directory (e.g. nvidia/personaplex-7b-v1) into
what the TensorRT-LLM backend serves (--target trtllm, the default):

  OUTPUT/trtllm_checkpoint/   a LlamaForCausalLM TensorRT-LLM checkpoint of the temporal
                              transformer (config.json + rank0.safetensors)
  OUTPUT/native/              the parts that run beside the engine: audio embedding tables,
                              depformer, Mimi (codebooks precomputed), tokenizer, voices and
                              the prefills of the bundled voices with the default persona
  OUTPUT/onnx/                Mimi streaming step and depformer ONNX graphs (--skip-onnx)
  OUTPUT/README.md            the exact trtllm-build and trtexec commands to run next

Re-running with the same source and options resumes: finished artifacts are skipped.
A directory holding anything else is left alone unless --force is given.

--target torch-fp8 writes instead a checkpoint directory for the PyTorch engine whose LM
projections and FFNs are stored in fp8 (~9 GB instead of ~17 for the 7B model), so the
server does not quantize them at every start; serve it as any checkpoint directory.  Only
--depformer-steps and --force apply to it.
"""

EPILOG = """\
example (needs pip install -e '.[convert]' for the ONNX steps, or --skip-onnx):
  python convert_checkpoint.py --hf-repo nvidia/personaplex-7b-v1 --output-dir build/pp7b \\
      --dtype bfloat16 --kv-cache-dtype fp8 --max-sessions 64
  (or --model-dir DIR for a checkpoint already on disk)
  then run the commands in build/pp7b/README.md and serve with
  PERSONAPLEX_BACKEND=trtllm PERSONAPLEX_CHECKPOINT=build/pp7b hypercorn orchestrator:app

  python convert_checkpoint.py --hf-repo nvidia/personaplex-7b-v1 --target torch-fp8 \
      --output-dir build/pp7b-fp8
  PERSONAPLEX_CHECKPOINT=build/pp7b-fp8 hypercorn orchestrator:app
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="convert_checkpoint.py", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=Path,
                        help="checkpoint directory: model.safetensors, the Mimi tokenizer-*.safetensors, "
                             "tokenizer_spm_32k_3.model, voices/ or voices.tgz (a Kyutai config.json is honoured)")
    source.add_argument("--hf-repo", metavar="REPO[@REVISION]",
                        help="Hugging Face repo to convert, e.g. nvidia/personaplex-7b-v1 (gated: accept its licence "
                             "and set HF_TOKEN); only the needed files are downloaded, into the standard cache")
    p.add_argument("--output-dir", required=True, type=Path, help="build directory to write, e.g. build/pp7b")
    p.add_argument("--target", default="trtllm", choices=TARGETS,
                   help="what to write: trtllm (default: TensorRT-LLM checkpoint, native parts, ONNX graphs) or "
                        "torch-fp8 (a checkpoint directory with fp8 LM weights for the PyTorch engine)")
    p.add_argument("--dtype", default="bfloat16", choices=BUILD_DTYPES,
                   help="engine weight and activation dtype (default: bfloat16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=BUILD_KV_CACHE_DTYPES,
                   help="temporal KV cache: auto (= --dtype) or fp8 (half the memory per session; "
                        "uncalibrated scale, see --kv-cache-scale)")
    p.add_argument("--kv-cache-scale", type=float, default=1.0,
                   help="FP8 KV scale of every layer (K and V are stored as value / scale; default 1.0)")
    p.add_argument("--max-sessions", type=_positive, default=64,
                   help="most concurrent sessions the engine is built for (max batch size; default 64)")
    p.add_argument("--max-prefill", type=_positive, default=1024,
                   help="longest system prompt (voice + persona) in 80 ms positions (default 1024)")
    p.add_argument("--max-positions", type=_positive, default=32768,
                   help="longest call in 80 ms frames: RoPE table size and max_seq_len (default 32768 = 43 min)")
    p.add_argument("--tokens-per-block", type=_positive, default=64, help="paged KV block size (default 64)")
    p.add_argument("--depformer-steps", type=int, default=8, choices=(8, 16),
                   help="depformer codebook steps to keep: 8 (agent audio; the user-side steps are dead "
                        "compute) or 16 (the reference's full depformer)")
    p.add_argument("--skip-onnx", action="store_true", help="do not export the Mimi / depformer ONNX graphs")
    p.add_argument("--force", action="store_true",
                   help="overwrite an output directory holding another conversion or other files")
    verbosity = p.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="debug logging (e.g. why an export failed)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Our progress at INFO; the libraries' (the ONNX exporter's optimizer is chatty) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    ours = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    loggers = [logging.getLogger(name) for name in ("engines", log.name)]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(ours)
    try:
        return _run(parser, args)
    finally:  # main() also runs in-process (tests): leave the logging set-up as it was
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.kv_cache_scale <= 0:
        parser.error(f"--kv-cache-scale must be > 0, got {args.kv_cache_scale}")
    if args.hf_repo is not None:
        from engines.errors import CheckpointError
        from engines.checkpoints.hub import parse_repo_ref, resolve_checkpoint

        if parse_repo_ref(args.hf_repo) is None:
            parser.error(f"--hf-repo {args.hf_repo!r} is not a repo id (owner/name[@revision])")
        try:
            args.model_dir = resolve_checkpoint(args.hf_repo)
        except CheckpointError as exc:
            parser.error(str(exc))
    elif not args.model_dir.is_dir():
        parser.error(f"--model-dir {args.model_dir} is not a directory")
    if args.target == "torch-fp8":
        return _write_fp8_copy(parser, args)
    # Imports torch (seconds): only once the cheap checks passed.
    from engines.export.convert.pipeline import ConvertError, ConvertOptions, convert

    options = ConvertOptions(
        model_dir=args.model_dir, output_dir=args.output_dir, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        max_sessions=args.max_sessions, max_prefill=args.max_prefill, max_positions=args.max_positions,
        tokens_per_block=args.tokens_per_block, depformer_steps=args.depformer_steps,
        kv_cache_scale=args.kv_cache_scale, skip_onnx=args.skip_onnx, force=args.force,
    )
    if options.max_prefill > options.max_positions:
        parser.error("--max-prefill cannot exceed --max-positions")
    if options.tokens_per_block & (options.tokens_per_block - 1):
        parser.error(f"--tokens-per-block must be a power of two, got {options.tokens_per_block}")
    try:
        convert(options)
    except ConvertError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        log.warning("interrupted: re-run the same command to resume")
        return 130
    return 0


def _write_fp8_copy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from engines.errors import CheckpointError
    from engines.export.convert.fp8_copy import write_fp8_copy

    try:
        write_fp8_copy(args.model_dir, args.output_dir, steps=args.depformer_steps, force=args.force)
    except (CheckpointError, OSError, ValueError) as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        log.warning("interrupted: nothing was committed; re-run the same command")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
