"""Model hyperparameters: one typed place for the LM and the Mimi codec.

The PersonaPlex checkpoint ships an empty ``config.json``; its hyperparameters are the
Moshi-7B ones with 16 depformer steps.  Kyutai repositories ship a ``config.json`` whose
top-level keys are ``LMModel`` keyword arguments (plus file names), and optionally a Mimi
config in the layout of ``moshi.models.loaders._mimi_config``.  Both are parsed here into
frozen dataclasses; anything we do not implement is refused with a clear message instead of
being silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# Token constants of the PersonaPlex/Moshi stream layout (spec/model.md 1.2, 4.3).
TEXT_PAD_ID = 3  # "PAD", also LMGen's zero_text_code
TEXT_EPAD_ID = 0  # end of padding
TEXT_SPECIAL_LABELS = ("EPAD", "BOS", "EOS", "PAD")  # ids 0..3 as the reference prints them
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # agent-side silence frame
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)  # user-side 440 Hz sine frame
AUDIO_SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz) spacer frames around the persona
DEFAULT_PERSONA = (
    "You are a wise and friendly teacher. Answer questions or provide advice in a clear "
    "and engaging way."
)
DEFAULT_VOICE = "NATF2.pt"
# Temporal KV cache storage: the model's dtype, or 8 bits per element with a float32 scale per
# (position, head): float8 e4m3 (GPUs of compute capability >= 8.9), or int8 (any GPU: A100s
# have no e4m3).
KV_CACHE_MODES = ("auto", "fp8", "int8")
# The modes above that store one byte per element beside its scales (``state.kv_ring``).
SCALED_KV_CACHES = ("fp8", "int8")
# The GPU capabilities ``PERSONAPLEX_GPU_ARCH`` may force (engines/fastpath/gpu_arch.py): the
# A100's, the A10/A40/RTX 30xx's, the L4/L40's and the H100/H200's; "auto" is the device's own.
GPU_ARCH_PROFILES = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0)}
GPU_ARCH_MODES = ("auto", *GPU_ARCH_PROFILES)
# Weight and activation dtypes a TensorRT-LLM build may use (convert_checkpoint.py --dtype).
BUILD_DTYPES = ("bfloat16", "float16", "float32")
# Its KV cache dtypes (--kv-cache-dtype): the converter writes fp8's scales, no int8 ones.
BUILD_KV_CACHE_DTYPES = ("auto", "fp8")
# The engines a server can run: the PyTorch one, or a TensorRT-LLM build (engines/runtime/trtllm).
BACKENDS = ("torch", "trtllm")


class WindowMode:
    """How many past keys a streaming query sees once the ring has wrapped."""

    REFERENCE = "reference"  # NVIDIA's moshi fork: capacity - 1 keys for a 1-token call
    FULL = "full"  # upstream Kyutai moshi 0.2.13: capacity keys
    ALL = (REFERENCE, FULL)


def kv_window_bytes(num_layers: int, num_heads: int, capacity: int, head_dim: int, element_bytes: int,
                    kv_cache: str) -> int:
    """Device bytes of one session's temporal KV window: keys and values of ``capacity``
    positions, in elements of ``element_bytes`` (``kv_cache`` "auto"), or of one byte with a
    float32 scale per (position, head) ("fp8", "int8": ``state.kv_ring``)."""
    positions = num_layers * num_heads * capacity
    return 2 * positions * ((head_dim + 4) if kv_cache in SCALED_KV_CACHES else head_dim * element_bytes)


# LM weight storage: the model's dtype, or fp8 projections and FFNs (engines.model.fp8_weights).
WEIGHT_MODES = ("auto", "fp8")
# torch.compile of the GPU pieces: on, off, or on for CUDA devices only.
COMPILE_MODES = ("auto", "on", "off")

# The files of a checkpoint directory (nvidia/personaplex-7b-v1's names; Kyutai's config.json
# may name others: engines/checkpoints/loader.py).
LM_FILE = "model.safetensors"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
VOICES_DIR = "voices"
VOICES_ARCHIVE = "voices.tgz"
CONFIG_FILE = "config.json"



def default_cache_dir() -> Path:
    """The project's cache directory: ``PERSONAPLEX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/personaplex-serve`` (``~/.cache/personaplex-serve``).  It holds the
    embedded tiny checkpoint and the compile caches (``engines/fastpath/compiled.py``)."""
    base = os.environ.get("PERSONAPLEX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "personaplex-serve"
    )
    return Path(base)


SAMPLE_RATE = 24000
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz
FRAME_PERIOD_S = FRAME_SAMPLES / SAMPLE_RATE  # the model's step: everything real-time is paced by it
FRAME_MS = 80


class ConfigError(ValueError):
    """A configuration file asks for something this implementation does not provide."""


def gated_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of Moshi's gated FFN for a given ``dim_feedforward``."""
    if dim_feedforward == 4 * dim:
        return (21 * dim) // 8
    return (2 * dim_feedforward) // 3


@dataclass(frozen=True)
class LMConfig:
    """Temporal transformer + depformer of a Moshi-family LM."""

    dim: int = 4096
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125
    context: int = 3000
    max_period: float = 10000.0
    text_card: int = 32000
    card: int = 2048
    n_q: int = 16
    dep_q: int = 16
    delays: tuple[int, ...] = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
    depformer_dim: int = 1024
    depformer_dim_feedforward: int = int(4.125 * 1024)
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    text_padding_id: int = TEXT_PAD_ID
    norm_eps: float = 1e-8

    def __post_init__(self) -> None:
        if len(self.delays) != self.n_q + 1:
            raise ConfigError(f"delays has {len(self.delays)} entries, expected n_q + 1 = {self.n_q + 1}")
        if self.dim % self.num_heads or self.depformer_dim % self.depformer_num_heads:
            raise ConfigError("model width must be divisible by the number of heads")
        if self.n_q % 2:
            raise ConfigError(f"n_q={self.n_q}: expected agent and user audio streams of equal size")
        if not 1 <= self.dep_q <= self.n_q:
            raise ConfigError(f"dep_q={self.dep_q} must be in [1, n_q={self.n_q}]")
        if self.context < 2:
            raise ConfigError(f"context={self.context} must be at least 2")

    # Derived sizes -------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        return self.n_q + 1

    @property
    def audio_codebooks(self) -> int:
        """Codebooks per speaker (8 for Moshi/PersonaPlex)."""
        return self.n_q // 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def ffn_hidden(self) -> int:
        return gated_hidden(self.dim, int(self.hidden_scale * self.dim))

    @property
    def depformer_head_dim(self) -> int:
        return self.depformer_dim // self.depformer_num_heads

    @property
    def depformer_ffn_hidden(self) -> int:
        return gated_hidden(self.depformer_dim, self.depformer_dim_feedforward)

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters of a checkpoint with every depformer step, those that fp8 weights
        store in fp8: the layers' projections and FFNs and ``depformer_in``; see
        ``engines.model.fp8_weights``).  The server sizes admission with them."""
        d, h, dd, dh, steps = self.dim, self.ffn_hidden, self.depformer_dim, self.depformer_ffn_hidden, self.dep_q
        temporal = self.num_layers * (4 * d * d + 3 * h * d)
        depformer = steps * (self.depformer_num_layers * (4 * dd * dd + 3 * dh * dd) + dd * d)
        rest = ((self.n_q * (self.card + 1) + 2 * self.text_card + 1) * d + (2 * self.num_layers + 1) * d
                + (self.text_card + 1 + (steps - 1) * (self.card + 1) + steps * self.card) * dd
                + 2 * self.depformer_num_layers * dd)
        return temporal + depformer + rest, temporal + depformer

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def text_initial_id(self) -> int:
        return self.text_card

    @property
    def audio_initial_id(self) -> int:
        return self.card

    def initial_tokens(self) -> list[int]:
        return [self.text_initial_id] + [self.audio_initial_id] * self.n_q

    # Parsing -------------------------------------------------------------------------
    @classmethod
    def from_moshi_kwargs(cls, kwargs: Mapping[str, Any]) -> "LMConfig":
        """Build from Kyutai ``LMModel`` kwargs (a config.json minus file names).

        Keys we know to be irrelevant for inference are ignored; features we do not
        implement raise ``ConfigError`` naming the key.
        """
        kw = dict(kwargs)
        unsupported = {
            "conditioners": None,
            "fuser": None,
            "lora": False,
            "quantize": False,
            "demux_second_stream": False,
            "demux_second_text_stream": False,
            "depformer_weights_per_step_schedule": None,
            "depformer_low_rank_embeddings": None,
            "extra_heads_num_heads": 0,
            "norm_emb": False,
            "bias_proj": False,
            "layer_scale": None,
            "depformer_layer_scale": None,
            "kv_repeat": 1,
            "cross_attention": False,
        }
        for key, neutral in unsupported.items():
            if key in kw and kw[key] not in (neutral, None, False, 0, {}):
                raise ConfigError(f"config key {key!r}={kw[key]!r} is not supported by this server")
        expected = {
            "gating": "silu",
            "norm": "rms_norm_f32",
            "positional_embedding": "rope",
            "depformer_gating": "silu",
            "depformer_pos_emb": "none",
            "causal": True,
            "depformer_multi_linear": True,
            "depformer_weights_per_step": True,
        }
        for key, value in expected.items():
            if key in kw and kw[key] != value:
                raise ConfigError(f"config key {key!r}={kw[key]!r} is not supported (expected {value!r})")
        defaults = cls()
        text_out = kw.get("text_card_out")
        if text_out not in (None, kw.get("text_card", defaults.text_card)):
            raise ConfigError("text_card_out different from text_card is not supported")
        dep_dim = int(kw.get("depformer_dim", defaults.depformer_dim))
        hidden_scale = float(kw.get("hidden_scale", defaults.hidden_scale))
        dep_ff = kw.get("depformer_dim_feedforward")
        if dep_ff is None:
            dep_ff = int(hidden_scale * dep_dim)
        if isinstance(dep_ff, list):
            raise ConfigError("per-step depformer_dim_feedforward lists are not supported")
        try:
            return cls(
                dim=int(kw.get("dim", defaults.dim)),
                num_heads=int(kw.get("num_heads", defaults.num_heads)),
                num_layers=int(kw.get("num_layers", defaults.num_layers)),
                hidden_scale=hidden_scale,
                context=int(kw.get("context", defaults.context)),
                max_period=float(kw.get("max_period", defaults.max_period)),
                text_card=int(kw.get("text_card", defaults.text_card)),
                card=int(kw.get("card", defaults.card)),
                n_q=int(kw.get("n_q", defaults.n_q)),
                dep_q=int(kw.get("dep_q", defaults.dep_q)),
                delays=tuple(int(d) for d in kw.get("delays", defaults.delays)),
                depformer_dim=dep_dim,
                depformer_dim_feedforward=int(dep_ff),
                depformer_num_heads=int(kw.get("depformer_num_heads", defaults.depformer_num_heads)),
                depformer_num_layers=int(kw.get("depformer_num_layers", defaults.depformer_num_layers)),
                text_padding_id=int(kw.get("existing_text_padding_id", defaults.text_padding_id)),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed LM configuration: {exc}") from exc

    def to_moshi_kwargs(self) -> dict[str, Any]:
        """The Kyutai ``LMModel`` kwargs for this configuration (used to write checkpoints)."""
        return {
            "dim": self.dim,
            "text_card": self.text_card,
            "existing_text_padding_id": self.text_padding_id,
            "n_q": self.n_q,
            "dep_q": self.dep_q,
            "card": self.card,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_scale": self.hidden_scale,
            "causal": True,
            "layer_scale": None,
            "context": self.context,
            "max_period": self.max_period,
            "gating": "silu",
            "norm": "rms_norm_f32",
            "positional_embedding": "rope",
            "depformer_dim": self.depformer_dim,
            "depformer_dim_feedforward": self.depformer_dim_feedforward,
            "depformer_num_heads": self.depformer_num_heads,
            "depformer_num_layers": self.depformer_num_layers,
            "depformer_layer_scale": None,
            "depformer_multi_linear": True,
            "depformer_context": self.dep_q,
            "depformer_max_period": 10000,
            "depformer_gating": "silu",
            "depformer_pos_emb": "none",
            "depformer_weights_per_step": True,
            "delays": list(self.delays),
        }


@dataclass(frozen=True)
class SeanetConfig:
    channels: int = 1
    dimension: int = 512
    n_filters: int = 64
    n_residual_layers: int = 1
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2


@dataclass(frozen=True)
class MimiTransformerConfig:
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    context: int = 250
    max_period: float = 10000.0
    layer_scale: float = 0.01


@dataclass(frozen=True)
class QuantizerConfig:
    dimension: int = 256
    n_q: int = 32
    bins: int = 2048
    input_dimension: int = 512
    output_dimension: int = 512


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = SAMPLE_RATE
    frame_rate: float = FRAME_RATE
    seanet: SeanetConfig = field(default_factory=SeanetConfig)
    transformer: MimiTransformerConfig = field(default_factory=MimiTransformerConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    num_codebooks: int = 8  # codebooks actually used (cb0 semantic + 7 acoustic)

    def __post_init__(self) -> None:
        hop = 1
        for r in self.seanet.ratios:
            hop *= r
        if self.frame_samples % hop:
            raise ConfigError(f"frame of {self.frame_samples} samples is not a multiple of the SEANet hop {hop}")
        if not 1 <= self.num_codebooks <= self.quantizer.n_q:
            raise ConfigError(f"num_codebooks={self.num_codebooks} outside [1, {self.quantizer.n_q}]")
        if self.transformer.d_model != self.seanet.dimension:
            raise ConfigError("Mimi transformer d_model must equal the SEANet dimension (no projections)")

    @property
    def frame_samples(self) -> int:
        return int(self.sample_rate / self.frame_rate)

    @property
    def hop_length(self) -> int:
        hop = 1
        for r in self.seanet.ratios:
            hop *= r
        return hop

    @property
    def latent_steps_per_frame(self) -> int:
        """Encoder-rate latent steps per 80 ms frame (2 for Mimi: 25 Hz vs 12.5 Hz)."""
        return self.frame_samples // self.hop_length

    @classmethod
    def from_moshi_config(cls, cfg: Mapping[str, Any], num_codebooks: int = 8) -> "MimiConfig":
        """Parse a Kyutai Mimi config (``loaders._mimi_config`` layout)."""
        try:
            seanet = dict(cfg["seanet"])
            quant = dict(cfg["quantizer"])
            tr = dict(cfg["transformer"])
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"Mimi config must have seanet, quantizer and transformer sections ({exc})") from exc
        checks = {
            ("seanet", "causal"): (seanet.get("causal", True), True),
            ("seanet", "norm"): (seanet.get("norm", "none"), "none"),
            ("seanet", "pad_mode"): (seanet.get("pad_mode", "constant"), "constant"),
            ("seanet", "true_skip"): (seanet.get("true_skip", True), True),
            ("seanet", "activation"): (seanet.get("activation", "ELU"), "ELU"),
            ("transformer", "gating"): (tr.get("gating", "none"), "none"),
            ("transformer", "norm"): (tr.get("norm", "layer_norm"), "layer_norm"),
            ("transformer", "positional_embedding"): (tr.get("positional_embedding", "rope"), "rope"),
            ("transformer", "causal"): (tr.get("causal", True), True),
            ("transformer", "conv_layout"): (tr.get("conv_layout", True), True),
        }
        for (section, key), (value, want) in checks.items():
            if value != want:
                raise ConfigError(f"Mimi {section}.{key}={value!r} is not supported (expected {want!r})")
        try:
            return cls(
                sample_rate=int(cfg.get("sample_rate", SAMPLE_RATE)),
                frame_rate=float(cfg.get("frame_rate", FRAME_RATE)),
                seanet=SeanetConfig(
                    channels=int(seanet.get("channels", 1)),
                    dimension=int(seanet["dimension"]),
                    n_filters=int(seanet["n_filters"]),
                    n_residual_layers=int(seanet.get("n_residual_layers", 1)),
                    ratios=tuple(int(r) for r in seanet["ratios"]),
                    kernel_size=int(seanet.get("kernel_size", 7)),
                    last_kernel_size=int(seanet.get("last_kernel_size", 3)),
                    residual_kernel_size=int(seanet.get("residual_kernel_size", 3)),
                    dilation_base=int(seanet.get("dilation_base", 2)),
                    compress=int(seanet.get("compress", 2)),
                ),
                transformer=MimiTransformerConfig(
                    d_model=int(tr["d_model"]),
                    num_heads=int(tr["num_heads"]),
                    num_layers=int(tr["num_layers"]),
                    dim_feedforward=int(tr["dim_feedforward"]),
                    context=int(tr["context"]),
                    max_period=float(tr.get("max_period", 10000)),
                    layer_scale=float(tr.get("layer_scale", 0.01)),
                ),
                quantizer=QuantizerConfig(
                    dimension=int(quant["dimension"]),
                    n_q=int(quant["n_q"]),
                    bins=int(quant["bins"]),
                    input_dimension=int(quant.get("input_dimension", seanet["dimension"])),
                    output_dimension=int(quant.get("output_dimension", seanet["dimension"])),
                ),
                num_codebooks=num_codebooks,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed Mimi configuration: missing or bad {exc}") from exc

    def to_moshi_config(self) -> dict[str, Any]:
        """The Kyutai ``_mimi_config`` dict for this configuration."""
        s, t, q = self.seanet, self.transformer, self.quantizer
        return {
            "sample_rate": self.sample_rate,
            "channels": s.channels,
            "frame_rate": self.frame_rate,
            "seanet": {
                "channels": s.channels, "dimension": s.dimension, "causal": True,
                "n_filters": s.n_filters, "n_residual_layers": s.n_residual_layers,
                "activation": "ELU", "compress": s.compress, "dilation_base": s.dilation_base,
                "disable_norm_outer_blocks": 0, "kernel_size": s.kernel_size,
                "residual_kernel_size": s.residual_kernel_size, "last_kernel_size": s.last_kernel_size,
                "norm": "none", "pad_mode": "constant", "ratios": list(s.ratios), "true_skip": True,
            },
            "quantizer": {
                "dimension": q.dimension, "n_q": q.n_q, "bins": q.bins,
                "input_dimension": q.input_dimension, "output_dimension": q.output_dimension,
            },
            "transformer": {
                "d_model": t.d_model, "num_heads": t.num_heads, "num_layers": t.num_layers,
                "causal": True, "layer_scale": t.layer_scale, "context": t.context,
                "conv_layout": True, "max_period": t.max_period, "gating": "none",
                "norm": "layer_norm", "positional_embedding": "rope",
                "dim_feedforward": t.dim_feedforward, "input_dimension": s.dimension,
                "output_dimensions": [s.dimension],
            },
        }


def replace(cfg, **changes):
    """``dataclasses.replace`` re-exported for callers that build variants."""
    return dataclasses.replace(cfg, **changes)
