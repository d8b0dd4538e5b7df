"""The conversion as a list of resumable steps (see ``manifest``).

Order: TensorRT-LLM checkpoint, native artifacts, prefills, ONNX graphs, and last
``runtime.json`` + ``README.md``, so a directory with a ``runtime.json`` is complete.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from engines.checkpoints import loader as ckpt
from engines.errors import CheckpointError
from engines.interface import EngineError
from engines.runtime.trtllm.layout import FORMAT_VERSION, BuildLayout, BuildMeta
from engines.export.convert import llama, native, onnx, readme
from engines.export.convert.manifest import Manifest, atomic_path, commit, source_fingerprint
from engines.export.convert.safetensors_stream import write_streaming

log = logging.getLogger(__name__)


class ConvertError(Exception):
    """A conversion cannot proceed; the message is one line meant for the user."""


@dataclass(frozen=True)
class ConvertOptions:
    model_dir: Path
    output_dir: Path
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_sessions: int = 64
    max_prefill: int = 1024
    max_positions: int = 32768
    tokens_per_block: int = 64
    depformer_steps: int = 8
    kv_cache_scale: float = 1.0
    skip_onnx: bool = False
    force: bool = False

    def fingerprint_options(self) -> dict:
        data = asdict(self)
        for key in ("model_dir", "output_dir", "skip_onnx", "force"):
            data.pop(key)
        return data


class Converter:
    def __init__(self, options: ConvertOptions) -> None:
        self.options = options
        self.layout = BuildLayout(options.output_dir)
        self.torch_dtype = llama.DTYPES[options.dtype]
        try:
            self.files = ckpt.locate(options.model_dir)
            self.reader = ckpt.SafetensorsReader(self.files.lm_weights)
            ckpt.SafetensorsReader(self.files.mimi_weights)
            self._check_lm_file()
        except CheckpointError as exc:
            raise ConvertError(str(exc)) from None
        self.cfg = self.files.lm_config
        self.persona_tokens: tuple[int, ...] = ()

    def _check_lm_file(self) -> None:
        """Cheap header-only checks, so a wrong directory fails before anything is written."""
        cfg = self.files.lm_config
        last = f"transformer.layers.{cfg.num_layers - 1}.gating.linear_in.weight"
        for key, shape in (("text_linear.weight", (cfg.text_card, cfg.dim)), (last, (2 * cfg.ffn_hidden, cfg.dim))):
            if not self.reader.has(key):
                raise CheckpointError(f"{self.reader.path}: missing tensor {key!r} (not a Moshi/PersonaPlex LM?)")
            if self.reader.shape(key) != shape:
                raise CheckpointError(f"{self.reader.path}: tensor {key!r} has shape {self.reader.shape(key)}, "
                                      f"expected {shape}")
        have = ckpt.depformer_steps_in_file(self.reader)
        if have < self.options.depformer_steps:
            raise CheckpointError(f"{self.reader.path}: {have} depformer steps, --depformer-steps "
                                  f"{self.options.depformer_steps} asked")

    # Output directory ---------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        f = self.files
        sources = source_fingerprint([f.lm_weights, f.mimi_weights, f.tokenizer, f.voices_dir, f.voices_archive])
        return {"sources": sources, "options": self.options.fingerprint_options()}

    def open_manifest(self) -> Manifest:
        root = self.layout.root
        fingerprint = json.loads(json.dumps(self.fingerprint()))  # as it reads back from disk
        if root.exists() and not root.is_dir():
            raise ConvertError(f"--output-dir {root} exists and is not a directory")
        previous = Manifest.read(root) if root.is_dir() else None
        occupied = root.is_dir() and any(root.iterdir())
        if previous is not None and previous.fingerprint == fingerprint and not self.options.force:
            log.info("resuming the conversion in %s (finished steps are skipped)", root)
            return previous
        if occupied and not self.options.force:
            why = ("was converted from other weights or with other options" if previous is not None
                   else "is not empty and holds no conversion of this checkpoint")
            raise ConvertError(f"--output-dir {root} {why}; pass --force to overwrite it")
        if previous is not None:
            for path in previous.owned_files():
                path.unlink(missing_ok=True)
        for stale in (self.layout.engine_dir, self.layout.plans):
            if stale.exists():
                log.warning("%s was built from the previous conversion: rebuild it after this one", stale)
        root.mkdir(parents=True, exist_ok=True)
        manifest = Manifest(root, fingerprint)
        manifest.save()
        return manifest

    # Steps ---------------------------------------------------------------------------------------
    def steps(self) -> list[tuple[str, Callable[[], list[Path]]]]:
        steps = [
            ("trtllm_checkpoint", self.write_checkpoint),
            ("lm_config", lambda: native.write_lm_config(self.files, self.layout.lm_config)),
            ("embeddings", lambda: native.write_embeddings(self.reader, self.files, self.torch_dtype,
                                                           self.layout.embeddings)),
            ("depformer", lambda: native.write_depformer(self.reader, self.files, self.options.depformer_steps,
                                                         self.torch_dtype, self.layout.depformer)),
            ("mimi", lambda: native.write_mimi(self.files, self.layout.mimi, self.layout.mimi_config)),
            ("tokenizer_voices", lambda: native.write_tokenizer_and_voices(self.files, self.layout.tokenizer,
                                                                           self.layout.voices)),
            ("prefill", self.write_prefills),
        ]
        if not self.options.skip_onnx:
            steps.append(("onnx", self.write_onnx))
        steps.append(("runtime", self.write_runtime))
        return steps

    def write_checkpoint(self) -> list[Path]:
        o, cfg = self.options, self.cfg
        out = self.layout.checkpoint_dir
        out.mkdir(parents=True, exist_ok=True)
        config = llama.llama_config(cfg, dtype=o.dtype, kv_cache_dtype=o.kv_cache_dtype, max_positions=o.max_positions)
        atomic_path(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        rank0 = out / "rank0.safetensors"
        with tqdm(total=cfg.num_layers, desc="temporal layers", unit="layer", disable=None) as bar:
            tensors = llama.llama_tensors(self.reader, cfg, o.dtype, o.kv_cache_dtype, o.kv_cache_scale,
                                          on_layer=lambda: bar.update(1))
            write_streaming(atomic_path(rank0), llama.tensor_specs(cfg, o.dtype, o.kv_cache_dtype), tensors)
        return [commit(out / "config.json"), commit(rank0)]

    def write_prefills(self) -> list[Path]:
        written, self.persona_tokens = native.write_prefills(self.reader, self.files, self.torch_dtype,
                                                             self.options.max_prefill, self.layout.prefill)
        return written

    def write_onnx(self) -> list[Path]:
        return onnx.export_all(self.files, self.reader, self.layout, self.options.depformer_steps)

    def meta(self) -> BuildMeta:
        o, cfg = self.options, self.cfg
        text_rows, hidden_rows = llama.vocab_layout(cfg)
        return BuildMeta(
            format_version=FORMAT_VERSION, model_name=self.files.name, dtype=o.dtype,
            kv_cache_dtype=o.kv_cache_dtype, hidden_size=cfg.dim, num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            text_vocab=text_rows, hidden_rows=hidden_rows, vocab_size=text_rows + hidden_rows,
            max_sessions=o.max_sessions, max_prefill=o.max_prefill, max_positions=o.max_positions,
            prompt_table_size=max(o.max_sessions, o.max_prefill), context=cfg.context,
            tokens_per_block=o.tokens_per_block, depformer_steps=o.depformer_steps,
            default_persona_tokens=self.persona_tokens,
        )

    def write_runtime(self) -> list[Path]:
        meta = self.meta()
        graphs = onnx.graph_layouts(self.layout)  # whatever an ONNX step (this run or an earlier) wrote
        atomic_path(self.layout.readme).write_text(readme.render(self.layout, meta, graphs))
        atomic_path(self.layout.runtime).write_text(meta.to_json())
        return [commit(self.layout.readme), commit(self.layout.runtime)]

    # Driver ---------------------------------------------------------------------------------------
    def run(self) -> BuildLayout:
        manifest = self.open_manifest()
        for leftover in self.layout.root.rglob(".*.partial"):  # an interrupted run's temporary files
            leftover.unlink(missing_ok=True)
        steps = self.steps()
        if manifest.is_done("prefill"):
            self.persona_tokens = tuple(manifest.steps["prefill"]["info"]["persona_tokens"])
        for i, (name, produce) in enumerate(steps, 1):
            # runtime.json and the README are cheap and describe the other steps: always rewritten.
            if name != "runtime" and manifest.is_done(name):
                log.info("[%d/%d] %s: already done, skipped", i, len(steps), name)
                continue
            log.info("[%d/%d] %s ...", i, len(steps), name)
            manifest.forget(name)
            try:
                files = produce()
            except (CheckpointError, EngineError, ValueError, OSError) as exc:
                raise ConvertError(f"{name}: {exc}") from None
            info = {"persona_tokens": list(self.persona_tokens)} if name == "prefill" else None
            manifest.record(name, files, info)
        log.info("conversion complete: %s (next: the commands in %s)", self.layout.root, self.layout.readme)
        return self.layout


def convert(options: ConvertOptions) -> BuildLayout:
    return Converter(options).run()
