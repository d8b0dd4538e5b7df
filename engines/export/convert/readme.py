"""``build/NAME/README.md``: the exact commands that turn a converted directory into engines.

Flags follow ``trtllm-build`` of TensorRT-LLM 1.2.1 (tensorrt_llm/commands/build.py and the
plugin options of tensorrt_llm/plugin/plugin.py; spec/trtllm.md 2.5) and TensorRT's
``trtexec``.  Paths are written relative to the directory the converter was run from.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from engines.runtime.trtllm.layout import BuildLayout, BuildMeta
from engines.runtime.trtllm.kv_blocks import blocks_per_slot


def trtllm_build_args(layout: BuildLayout, meta: BuildMeta) -> list[str]:
    plugin_dtype = meta.dtype  # the GEMM / attention plugins run in the checkpoint dtype
    return [
        "trtllm-build",
        "--checkpoint_dir", str(layout.checkpoint_dir),
        "--output_dir", str(layout.engine_dir),
        # One sequence per live session; every tick is one decode call over all of them.
        "--max_batch_size", str(meta.max_sessions),
        # A session's system prompt is one context call of up to max_prefill positions.
        "--max_input_len", str(meta.max_prefill),
        # Positions keep growing past the attention window (RoPE uses absolute positions).
        "--max_seq_len", str(meta.max_positions),
        "--max_num_tokens", str(max(meta.max_prefill, meta.max_sessions)),
        "--max_beam_width", "1",
        # Every input embedding comes from the prompt table: one row per token of a call.
        "--max_prompt_embedding_table_size", str(meta.prompt_table_size),
        "--kv_cache_type", "paged",
        "--tokens_per_block", str(meta.tokens_per_block),
        "--gpt_attention_plugin", plugin_dtype,
        "--gemm_plugin", plugin_dtype,
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
        # The last text_vocab..vocab_size logits carry the hidden state: keep float32.
        "--logits_dtype", "float32",
    ]


def trtexec_args(onnx_path: Path, plan_path: Path, layout: dict, max_batch: int) -> list[str]:
    """A float32 plan with one optimisation profile over the graph's batch axis."""
    from engines.export.onnx.state import StepLayout

    shapes = StepLayout.from_json(json.dumps(layout)).trtexec_shapes(1, max(1, max_batch // 2), max_batch)
    return ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={plan_path}"] + [f"{k}={v}" for k, v in shapes.items()]


def _command(args: list[str]) -> str:
    lines, line = [], []
    for arg in args:
        # Keep a flag and its value on one line.
        if arg.startswith("--") and line and not (len(line) == 1 and line[0] == args[0]):
            lines.append(" ".join(line))
            line = []
        line.append(shlex.quote(arg))
    lines.append(" ".join(line))
    return " \\\n  ".join(lines)


def render(layout: BuildLayout, meta: BuildMeta, graphs: list[tuple[Path, dict]]) -> str:
    """The README text; ``graphs`` are the exported (ONNX file, tensor layout) pairs."""
    window_ref, window_full = meta.context - 1, meta.context
    blocks = blocks_per_slot(window_ref, meta.tokens_per_block)
    kv = "FP8 (e4m3, uncalibrated per-layer scale; see docs/TRTLLM.md)" if meta.kv_cache_dtype == "fp8" else meta.dtype
    text = f"""# {meta.model_name}: TensorRT-LLM build directory

Written by `convert_checkpoint.py`. The temporal transformer is a Llama-shaped TensorRT-LLM
checkpoint; the 17-stream input embedding, the depformer and Mimi run beside the engine
(docs/TRTLLM.md).

## 1. Temporal transformer engine (TensorRT-LLM 1.2.1, the last release with trtllm-build)

```bash
{_command(trtllm_build_args(layout, meta))}
```

Notes:
- `--max_prompt_embedding_table_size {meta.prompt_table_size}` is at least the number of sessions
  ({meta.max_sessions}) and the longest system prompt ({meta.max_prefill} positions): each token of a call
  is the fake id `vocab_size` and reads its input embedding from its own table row.
- No `--gather_context_logits` / `--gather_generation_logits` / `--gather_all_token_logits`: the
  server needs the last token's logits of each sequence, which the engine returns by default
  (gathering context logits would change the `logits` output to every token).
- The attention window is a run-time setting, not a build flag: the server passes {window_ref}
  (reference window: NVIDIA's code sees context - 1 keys) or {window_full} (`PERSONAPLEX_WINDOW=full`)
  and gives every session a fixed set of {blocks} paged KV blocks of {meta.tokens_per_block} tokens,
  used as a ring.
- KV cache: {kv}.

"""
    if graphs:
        commands = "\n".join(_command(trtexec_args(path, layout.plans / (path.stem + ".plan"), graph,
                                                     meta.max_sessions)) for path, graph in graphs)
        text += f"""## 2. Mimi and depformer plans (TensorRT `trtexec`)

```bash
mkdir -p {shlex.quote(str(layout.plans))}
{commands}
```

The plans are float32 (TF32 math on the GPU): compare codes with the PyTorch path before trying
`--fp16`/`--bf16` (spec/trtllm.md 6). They are built for the reference attention window; without
plans (or with PERSONAPLEX_WINDOW=full) the server runs these parts in PyTorch.

"""
    else:
        text += """## 2. Mimi and depformer plans

No ONNX files were written (`--skip-onnx`); the server runs Mimi and the depformer in PyTorch.
Re-run the converter without `--skip-onnx` to add them.

"""
    serve = (f"PERSONAPLEX_BACKEND=trtllm PERSONAPLEX_CHECKPOINT={shlex.quote(str(layout.root))} "
             f"PERSONAPLEX_MAX_SESSIONS={meta.max_sessions} hypercorn orchestrator:app")
    return text + f"""## 3. Serve

```bash
{serve}
```
"""
