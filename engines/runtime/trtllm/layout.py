"""The layout of a converted build directory (``build/NAME``): one place that both the
converter (``engines.export.convert``) and the TensorRT-LLM backend read.

    build/NAME/
      README.md                 the exact trtllm-build / trtexec commands for this build
      manifest.json             converter bookkeeping (sizes and hashes; resumable runs)
      runtime.json              BuildMeta: what the backend needs to drive the engine
      trtllm_checkpoint/        TensorRT-LLM checkpoint (config.json + rank0.safetensors)
      native/                   everything that runs outside the TensorRT-LLM engine
        lm_config.json          the Moshi LM hyperparameters (LMConfig as Kyutai kwargs)
        embeddings.safetensors  16 audio tables + the text table (summed outside the engine)
        depformer.safetensors   the depformer weights (MoshiLM parameter names)
        mimi.safetensors        Mimi weights, codebooks precomputed; + mimi_config.json
        tokenizer.model         the SentencePiece tokenizer
        voices/*.pt             the bundled voice prompts
        prefill/*.safetensors   prompt embeddings + token-ring state per (voice, persona)
      onnx/                     Mimi streaming step and depformer ONNX graphs
      engine/                   written by trtllm-build (rank0.engine, config.json)
      plans/                    written by trtexec (TensorRT plans of the ONNX graphs)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

RUNTIME_FILE = "runtime.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class BuildMeta:
    """How the converted checkpoint maps Moshi onto a Llama engine (``runtime.json``).

    The engine's vocabulary is ``text_vocab`` text logits followed by ``hidden_rows``
    identity rows: the lm_head hands back the normed hidden state the depformer needs as
    logits ``[text_vocab, text_vocab + hidden_rows)``.  Every input token is the fake id
    ``vocab_size``, which makes the engine read its input embedding from the prompt table.
    """

    format_version: int
    model_name: str
    dtype: str  # engine weight / activation dtype
    kv_cache_dtype: str  # "auto" (= dtype) or "fp8"
    hidden_size: int
    num_layers: int
    num_heads: int  # = KV heads (no GQA)
    text_vocab: int
    hidden_rows: int
    vocab_size: int  # text_vocab + hidden_rows; also the fake prompt-table token id
    max_sessions: int
    max_prefill: int  # longest system prompt (positions) one context call may carry
    max_positions: int  # RoPE table length: the longest call in 80 ms frames
    prompt_table_size: int  # >= max(max_sessions, max_prefill)
    context: int  # Moshi's attention context (3000 frames)
    tokens_per_block: int
    depformer_steps: int
    default_persona_tokens: tuple[int, ...]

    def to_json(self) -> str:
        data = asdict(self)
        data["default_persona_tokens"] = list(self.default_persona_tokens)
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildMeta:
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(data))
        if missing:
            raise ValueError(f"missing keys {', '.join(missing)}")
        if data["format_version"] != FORMAT_VERSION:
            raise ValueError(f"format_version {data['format_version']} (this server reads {FORMAT_VERSION}); "
                             "re-run convert_checkpoint.py")
        values = {k: data[k] for k in names}
        values["default_persona_tokens"] = tuple(int(t) for t in values["default_persona_tokens"])
        return cls(**values)


class BuildLayout:
    """Paths inside one build directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # Converter outputs -----------------------------------------------------------------------
    @property
    def readme(self) -> Path:
        return self.root / "README.md"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def runtime(self) -> Path:
        return self.root / RUNTIME_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "trtllm_checkpoint"

    @property
    def native(self) -> Path:
        return self.root / "native"

    @property
    def lm_config(self) -> Path:
        return self.native / "lm_config.json"

    @property
    def embeddings(self) -> Path:
        return self.native / "embeddings.safetensors"

    @property
    def depformer(self) -> Path:
        return self.native / "depformer.safetensors"

    @property
    def mimi(self) -> Path:
        return self.native / "mimi.safetensors"

    @property
    def mimi_config(self) -> Path:
        return self.native / "mimi_config.json"

    @property
    def tokenizer(self) -> Path:
        return self.native / "tokenizer.model"

    @property
    def voices(self) -> Path:
        return self.native / "voices"

    @property
    def prefill(self) -> Path:
        return self.native / "prefill"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx"

    # Written by the TensorRT tools -----------------------------------------------------------
    @property
    def engine_dir(self) -> Path:
        return self.root / "engine"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    def read_meta(self) -> BuildMeta:
        path = self.runtime
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")  # noqa: TRY004 - callers catch ValueError
        try:
            return BuildMeta.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
