"""Server configuration: one frozen dataclass, read from ``PERSONAPLEX_*`` environment
variables and optionally a TOML file.

Precedence: built-in defaults < the TOML file named by ``PERSONAPLEX_CONFIG`` < environment
variables.  The TOML file holds the same names as the dataclass fields, in lower case, at top
level or under a ``[personaplex]`` table (``max_sessions = 4``).  Every value is checked once
here, with a message naming the variable, so a typo fails at start-up and not mid-call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import tomllib

from engines.spec import SpecError, check_engine_options
from engines.checkpoints.hub import DEFAULT_REPO, hub_offline, local_checkpoint, parse_repo_ref
from engines.checkpoints.random_weights import random_model_name

if TYPE_CHECKING:
    from engines.spec import EngineSpec, MemorySettings

from .lockstep.tick_policy import POLICIES, PacedPolicy, WindowPolicy, make_policy

log = logging.getLogger(__name__)

ENV_PREFIX = "PERSONAPLEX_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

# Default admission on CPU: the tiny demo model steps a frame in a few ms per session on two
# cores, and 8 sessions is the CPU load target (spec/performance.md).
CPU_DEFAULT_MAX_SESSIONS = 8
# The settings that are the engine's options (engines/spec.py checks them).
ENGINE_OPTIONS = ("checkpoint", "backend", "window", "kv_cache", "compile", "precompile", "weights", "cpu_threads",
                  "gpu_arch")
# Settings whose None is spelled "auto" too (the engine decides).
AUTO_SETTINGS = ("max_sessions",)


AUTH_MODES = ("auto", "required", "off")
# Settings that are gone, with what an operator who still sets one should know.
REMOVED_SETTINGS = {
    "engine_host": "every engine runs in an engine process of its own (the in-process 'thread' layout is gone)",
}
REFUSE_WHEN_FULL_MODES = ("event", "http")
OPUS_CODECS = ("auto", "libopus", "sphn")


class StartupError(Exception):
    """The server cannot start as configured or on this machine.  Its message is the one line
    an operator sees (what is wrong, which setting, how to fix it); start-up then ends with a
    nonzero exit status (``orchestrator/frontend/start_failure.py``)."""


class SettingsError(StartupError, ValueError):
    """A configuration value is missing, malformed or out of range."""


@dataclass(frozen=True)
class Settings:
    # Model ---------------------------------------------------------------------------------
    # Checkpoint directory, or a Hugging Face repo id "owner/name[@revision]" (downloaded into
    # the standard cache on first use: HF_TOKEN, HF_HUB_OFFLINE; engines/checkpoints/hub.py); None = the
    # embedded tiny demo model; "random:personaplex-7b" = random weights at the 7B shapes
    # (capacity measurements, engines/checkpoints/random_weights.py).
    checkpoint: str | None = None
    # A directory of voice .pt files (python -m engines.tools.voice_builder writes them) served beside
    # the checkpoint's own; a name in both is this directory's.  Every file is checked at start.
    voice_dir: str | None = None
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N"
    # One engine per listed device, e.g. "0,1", "cuda:0,cuda:1", "all" (every visible GPU) or
    # "cpu,cpu" (testing); empty = the one engine of ``device``.  See resolved_devices().
    devices: tuple[str, ...] = ()
    backend: str = "torch"  # "torch", or "trtllm" with checkpoint = a convert_checkpoint.py build dir
    window: str = "reference"  # attention window policy handed to the engine
    # Temporal KV cache storage: "auto" = the model dtype (bf16 on a GPU, float32 on CPU);
    # "fp8" = float8 e4m3 with per-(position, head) scales, half the memory and bandwidth
    # (CUDA only; ~1.65x the sessions per GPU; measured error: docs/PERFORMANCE.md, "fp8 KV
    # cache: error"); "int8" = the same with int8 values, for GPUs without e4m3 (compute
    # capability < 8.9, the A100): docs/PERFORMANCE.md, "int8 KV cache".
    kv_cache: str = "auto"
    # LM weights: "auto" = as the checkpoint stores them (bf16; fp8 for a copy written by
    # convert_checkpoint.py --target torch-fp8); "fp8" = the projections and FFNs quantized to
    # float8 e4m3 at load: the 7B model in ~9 GB instead of ~17 (torch backend; error figures
    # in docs/PERFORMANCE.md, "fp8 weights (issue 20)"; speech quality with real weights not
    # yet measured).
    weights: str = "auto"
    # torch.compile the GPU fast path's layer blocks: auto = on for CUDA, off on CPU (where
    # the eager path is the exact reference); compiling adds a minute or two to start-up.
    compile: str = "auto"
    # torch.compile's work in one portable file per GPU model and weight/KV format
    # (engines/fastpath/compile_artifacts.py), read before the first compilation and written
    # after a start that compiled: "auto" = compile/artifacts in the cache directory, "off",
    # or a directory (an image's or a volume's, so a new replica starts like a restart).
    compile_artifacts: str = "auto"
    # Keep each compiled piece whole beside the artifacts (torch's aot_compile, experimental;
    # engines/fastpath/precompiled.py), so a restart loads it instead of tracing it again;
    # "off": torch.compile traces every piece at every start (~14 s of an H200 restart).
    precompile: str = "on"
    # The GPU's compute capability as the engine takes it (engines/fastpath/gpu_arch.py): "auto"
    # = the device's own; "sm80", "sm86", "sm89", "sm90" force a profile, lower than the
    # device's only, so that an H200 takes exactly the kernels an A100 would (sm80: no fp8 e4m3
    # kernel, no scaled_mm; PERSONAPLEX_KV_CACHE=fp8 refused).  docs/DEPLOYMENT.md, "Running on
    # an A100".
    gpu_arch: str = "auto"
    # torch's intra-op threads in an engine on the CPU (the demo model); 0 = torch's default,
    # one per core.  One: the tiny model's tick is ~10 % slower on an idle host, and keeps its
    # pace on a busy one, where several threads wait for each other's turn on a core (with two
    # busy processes on 2 cores: p99 29 against 57 ms, longest 35 against 132;
    # docs/results/2026-12-04-cpu-tick-threads.json).  Engines on a GPU are left as they are.
    cpu_threads: int = 1
    # Admission per device (per engine); None ("auto") = on a GPU, as many as the engine's
    # memory plan fits (engines/runtime/memory_plan.py), on CPU 8 (see resolved_max_sessions).
    # A number the plan does not fit fails the engine's start with one line giving the largest.
    max_sessions: int | None = None
    # The memory plan.  The most device memory one engine plans with (None: its GPU's, less
    # what other processes hold when it starts; set it to share a GPU, or on CPU to plan at all).
    memory_limit_gb: float | None = None
    memory_margin_gb: float = 1.0  # kept free beside every planned item
    prefill_cache_gb: float = 2.0  # device memory the cache of prepared prompts may keep
    # Joins prepared at once per engine: the plan reserves the longest prompt's peak for each
    # (1.8 GiB at the 7B shapes); an open waits for its turn at most join_wait_s, then is
    # refused (resource_exhausted, retryable) without allocating.
    concurrent_joins: int = 1
    join_wait_s: float = 30.0
    # The directory where one server's processes meet (sockets, settings, metrics); None = a
    # directory per server under $XDG_RUNTIME_DIR or the temp dir (orchestrator/ipc/endpoints.py).
    run_dir: str | None = None
    # Lockstep scheduler ----------------------------------------------------------------------
    # When to tick (orchestrator/lockstep/tick_policy.py): "paced" at most once per interval that
    # keeps the engine about tick_busy_target busy (batch_window_ms its shortest), unless every
    # live session has a frame or a frame has waited a whole period; "window" once every live
    # session has a frame or the oldest frame waited batch_window_ms.  Paced is the default:
    # the same latency at light load, larger batches under load (docs/PERFORMANCE.md, "Both
    # tick policies at full windows").
    tick_policy: str = "paced"
    tick_busy_target: float = 0.7
    batch_window_ms: float = 20.0  # window: longest a ready frame waits; paced: shortest interval
    silence_grace_s: float = 3.0  # input stall after which silence is fed; 0 disables it
    warmup_frames: int = 4  # silent frames stepped through a throwaway slot before /ready
    # Protocol --------------------------------------------------------------------------------
    frames_per_delta: int = 1  # 80 ms frames per response.output_audio.delta
    first_message_timeout_s: float = 10.0  # connect -> first session.update
    idle_timeout_s: float = 300.0  # no client event for this long closes the session
    ready_wait_s: float = 180.0  # how long an open waits for the engine to finish loading
    max_event_bytes: int = 15 * 1024 * 1024  # larger client events get event_too_large
    # /api/chat: larger binary messages are dropped (Opus is a few KB a second; the web client
    # sends 40 ms pages of a few hundred bytes).
    max_native_message_bytes: int = 256 * 1024
    max_pending_input_bytes: int = 16 * 1024 * 1024  # queued input (float32 at 24 kHz)
    max_output_buffer_bytes: int = 32 * 1024 * 1024  # unsent server events per session
    # Connections one front-end worker holds (websockets in a session or a handshake, HTTP,
    # those still closing); a websocket past it gets HTTP 503.  With the limits above it
    # bounds the worker's memory (orchestrator/frontend/memory_bound.py).
    max_connections_per_worker: int = 256
    close_timeout_s: float = 5.0  # how long a closing session may take to flush its events
    # /api/chat's Opus (orchestrator/protocol/ogg_opus.py): "libopus" (our binding; encoding
    # and decoding run without the interpreter lock, on as many cores as there are codec
    # threads), "sphn" (holds the lock while it encodes: a worker's encodes run one at a time
    # and its event loop waits behind them), or "auto": libopus where it loads, else sphn.
    opus_codec: str = "auto"
    opus_library: str | None = None  # libopus's file; None = the system's (Debian libopus0)
    # Threads per front-end worker that encode its native sessions' output (each session's
    # frames stay on one thread, in order); a tick's encodes are split between them.
    opus_encode_threads: int = 2
    api_keys: tuple[str, ...] = ()  # accepted "Authorization: Bearer" keys; empty = open
    model_name: str | None = None  # model id to report; None = the engine's name
    # Access control (orchestrator/frontend/access.py, docs/RELIABILITY.md) ---------------------------
    api_keys_file: str | None = None  # more keys, one per line ('#' comments); read at start
    # "auto": keys required when any listening address is not loopback; "required"; "off".
    auth: str = "auto"
    bind: tuple[str, ...] = ()  # the --bind addresses, for when the sockets cannot be inspected
    allowed_origins: tuple[str, ...] = ()  # browser Origins besides the server's own; "*" = any
    trusted_proxies: tuple[str, ...] = ()  # peers whose X-Forwarded-For names the client
    max_sessions_per_key: int = 0  # concurrent websockets per API key; 0 = no limit
    max_sessions_per_ip: int = 0  # concurrent websockets per client address; 0 = no limit
    # How a handshake is refused when no engine has a free slot: "event" (accept, then the
    # resource_exhausted error event, as the reference) or "http" (a 503 before accepting,
    # which a balancer can retry on another replica).
    refuse_when_full: str = "event"
    opens_per_minute_per_key: int = 0  # websocket opens per key per minute (burst = 1 min); 0 = off
    opens_per_minute_per_ip: int = 0
    max_events_per_s: float = 250.0  # client events per second per socket (burst: 2 s); 0 = off
    # Client bytes per second per socket (burst: 2 s, at least one max_event_bytes); 0 = off.
    # 8 MiB/s is ~60x real time for base64 pcm_f32le at 24 kHz.
    max_input_bytes_per_s: int = 8 * 1024 * 1024
    max_instructions_chars: int = 6000  # persona length; each token is one prefill step
    # Faults (scheduler, watchdog) -----------------------------------------------------------
    watchdog_deadline_s: float = 10.0  # an engine call running longer is a stalled tick; 0 = off
    unhealthy_after_failed_ticks: int = 3  # consecutive ticks with no output -> /health 503
    fault_injection: str | None = None  # TESTING ONLY: orchestrator/fault_injection.py plans

    def __post_init__(self) -> None:
        def positive(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if value < 0 or (value == 0 and not allow_zero):
                raise SettingsError(f"{env_name(name)} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        if self.max_sessions is not None and not 1 <= self.max_sessions <= 4096:
            raise SettingsError(f"{env_name('max_sessions')} must be in [1, 4096], got {self.max_sessions!r}")
        if self.memory_limit_gb is not None:
            positive("memory_limit_gb")
        for name in ("memory_margin_gb", "prefill_cache_gb"):
            positive(name, allow_zero=True)
        for name in ("concurrent_joins", "join_wait_s"):
            positive(name)
        try:  # the engine's options, as the engine checks them (engines/spec.py), named as settings
            check_engine_options({name: getattr(self, name) for name in ENGINE_OPTIONS}, env_name)
        except SpecError as exc:
            raise SettingsError(str(exc)) from None
        for name in ("frames_per_delta", "first_message_timeout_s", "idle_timeout_s",
                     "ready_wait_s", "max_event_bytes", "max_native_message_bytes", "max_pending_input_bytes",
                     "max_output_buffer_bytes", "max_connections_per_worker", "close_timeout_s"):
            positive(name)
        for name in ("batch_window_ms", "silence_grace_s", "warmup_frames"):
            positive(name, allow_zero=True)
        if self.tick_policy not in POLICIES:
            raise SettingsError(f"{env_name('tick_policy')} must be one of {', '.join(POLICIES)}, "
                                f"got {self.tick_policy!r}")
        if not 0 < self.tick_busy_target <= 1:
            raise SettingsError(f"{env_name('tick_busy_target')} must be in (0, 1], got {self.tick_busy_target!r}")
        if not (self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise SettingsError(f"{env_name('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.devices:
            parse_devices(self.devices)
            if self.device != "auto":
                raise SettingsError(f"set {env_name('device')} or {env_name('devices')}, not both")
        self._check_checkpoint()
        self._check_reliability(positive)

    def _check_checkpoint(self) -> None:
        """What the engine's own check leaves: that a checkpoint is a directory or a repo id."""
        if random_model_name(self.checkpoint) is None and self.checkpoint is not None \
                and not Path(self.checkpoint).expanduser().is_dir():
            if self.backend == "trtllm":
                raise SettingsError(f"{env_name('checkpoint')}={self.checkpoint!r} is not a directory (a build "
                                    "directory written by convert_checkpoint.py)")
            if parse_repo_ref(self.checkpoint) is None:
                raise SettingsError(f"{env_name('checkpoint')}={self.checkpoint!r} is neither a directory nor a "
                                    f"Hugging Face repo id (owner/name[@revision], e.g. {DEFAULT_REPO})")

    def check_checkpoint_available(self) -> None:
        """At start (not in every ``Settings``: it reads the Hugging Face cache): a checkpoint
        named by repo id while ``HF_HUB_OFFLINE`` is set must already be in the local cache, so
        that start-up ends with one line rather than an engine that fails to load after it."""
        if self.checkpoint is None or self.backend == "trtllm" or random_model_name(self.checkpoint) is not None:
            return
        ref = parse_repo_ref(self.checkpoint)
        if ref is not None and hub_offline() and local_checkpoint(self.checkpoint) is None:
            raise SettingsError(f"{env_name('checkpoint')}={self.checkpoint!r} is not in the local Hugging Face cache "
                                "and HF_HUB_OFFLINE is set: download it once with network access (or unset "
                                "HF_HUB_OFFLINE), or name a checkpoint directory")

    def served_model_id(self) -> str | None:
        """The model id to report when the operator names none: a checkpoint named by repo
        id is served under that id (vLLM's convention); None: the engine's own name."""
        if self.model_name:
            return self.model_name
        if self.checkpoint is None or random_model_name(self.checkpoint) is not None:
            return None
        ref = parse_repo_ref(self.checkpoint)
        return ref.repo_id if ref is not None else None

    def _check_reliability(self, positive: Any) -> None:
        """Access-control and fault settings (kept apart: one job per block)."""
        if self.auth not in AUTH_MODES:
            raise SettingsError(f"{env_name('auth')} must be one of {', '.join(AUTH_MODES)}, got {self.auth!r}")
        for name in ("max_sessions_per_key", "max_sessions_per_ip", "opens_per_minute_per_key",
                     "opens_per_minute_per_ip", "max_events_per_s", "max_input_bytes_per_s", "watchdog_deadline_s",
                     "unhealthy_after_failed_ticks"):
            positive(name, allow_zero=True)
        positive("cpu_threads", allow_zero=True)
        positive("max_instructions_chars")
        positive("opus_encode_threads")
        self._check_opus()
        if self.refuse_when_full not in REFUSE_WHEN_FULL_MODES:
            raise SettingsError(f"{env_name('refuse_when_full')} must be one of {', '.join(REFUSE_WHEN_FULL_MODES)}, "
                                f"got {self.refuse_when_full!r}")
        if self.voice_dir is not None and not Path(self.voice_dir).expanduser().is_dir():
            raise SettingsError(f"{env_name('voice_dir')}={self.voice_dir!r} is not a directory")
        if self.api_keys_file is not None and not Path(self.api_keys_file).is_file():
            raise SettingsError(f"{env_name('api_keys_file')}={self.api_keys_file!r} is not a file")

    def _check_opus(self) -> None:
        if self.opus_codec not in OPUS_CODECS:
            raise SettingsError(f"{env_name('opus_codec')} must be one of {', '.join(OPUS_CODECS)}, "
                                f"got {self.opus_codec!r}")
        if self.opus_codec == "libopus" or self.opus_library is not None:
            from .protocol import libopus

            try:
                libopus.load(self.opus_library)
            except libopus.OpusUnavailable as exc:
                raise SettingsError(f"{env_name('opus_codec')}={self.opus_codec}: {exc}") from None

    def resolved_opus_codec(self) -> str:
        """The codec ``opus_codec`` names, ``auto`` resolved on this machine."""
        if self.opus_codec != "auto":
            return self.opus_codec
        from .protocol import libopus

        try:
            libopus.load(self.opus_library)
        except libopus.OpusUnavailable:
            return "sphn"
        return "libopus"

    def engine_spec(self, device: str) -> "EngineSpec":
        """What the engine of ``device`` is built from (``engines.runtime.factory.build_engine``)."""
        from engines.spec import EngineSpec

        return EngineSpec(checkpoint=self.checkpoint, max_slots=self.resolved_max_sessions(device), device=device,
                          backend=self.backend, window=self.window, kv_cache=self.kv_cache, compile=self.compile,
                          compile_artifacts=self.compile_artifacts, precompile=self.precompile,
                          weights=self.weights, voice_dir=self.voice_dir, cpu_threads=self.cpu_threads,
                          gpu_arch=self.gpu_arch, memory=self.memory_settings())

    def tick_policy_object(self) -> WindowPolicy | PacedPolicy:
        """The scheduler's tick policy, as these settings configure it."""
        return make_policy(self.tick_policy, min_wait_s=self.batch_window_ms / 1000.0,
                           busy_target=self.tick_busy_target)

    # Construction -----------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Defaults, then the TOML file of ``PERSONAPLEX_CONFIG``, then ``PERSONAPLEX_*``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        config_path = environ.get(CONFIG_ENV)
        if config_path:
            values.update(_read_toml(Path(config_path)))
        known = {f.name for f in fields(cls)}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in known:
                values[name] = raw
            elif name in REMOVED_SETTINGS:
                log.warning("ignoring %s: %s", key, REMOVED_SETTINGS[name])
            elif not name.startswith(("cache_dir", "test_")):  # the engine's and the tests' own
                log.warning("ignoring %s: not a server setting (known: %s)", key,
                            ", ".join(env_name(n) for n in sorted(known)))
        return cls.from_mapping(values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Settings":
        """Build from names -> values; strings (from the environment) are parsed by type."""
        by_name = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            if name in REMOVED_SETTINGS:
                raise SettingsError(f"setting {name!r} is gone: {REMOVED_SETTINGS[name]}")
            if name not in by_name:
                raise SettingsError(f"unknown setting {name!r}; known: {', '.join(sorted(by_name))}")
            kwargs[name] = _coerce(name, by_name[name].type, raw)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    # Derived values ---------------------------------------------------------------------------
    def resolved_device(self) -> str:
        if self.device == "cpu":
            return self.device
        visible = visible_gpus()
        if self.device == "auto":
            return "cuda" if visible else "cpu"
        if not visible:
            raise SettingsError(f"{env_name('device')}={self.device} but CUDA is not available here ({_no_cuda_why()}); "
                                f"set {env_name('device')}=cpu, or auto to use a GPU when there is one")
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        if index >= visible:
            raise SettingsError(f"{env_name('device')}={self.device} but {visible} CUDA device(s) are visible "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        return self.device

    def resolved_devices(self) -> list[str]:
        """The devices to run one engine each on: ``devices`` resolved against the visible
        GPUs (``all``: every one; an index past the last is an error), or ``[resolved_device()]``."""
        if not self.devices:
            return [self.resolved_device()]
        wanted = parse_devices(self.devices)
        if not any(device.startswith("cuda") for device in wanted) and wanted != ["all"]:
            return wanted
        visible = visible_gpus()
        if wanted == ["all"]:
            if visible == 0:
                raise SettingsError(f"{env_name('devices')}=all but no CUDA device is visible ({_no_cuda_why()})")
            return [f"cuda:{i}" for i in range(visible)]
        for device in wanted:
            if device.startswith("cuda") and int(device.split(":")[1]) >= visible:
                raise SettingsError(f"{env_name('devices')} names {device} but {visible} CUDA device(s) are visible "
                                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        return wanted

    def resolved_max_sessions(self, device: str) -> int | None:
        """The configured admission of one device's engine; None ("auto") where the engine
        decides from its memory plan (the torch backend on a GPU).  A TensorRT-LLM build
        admits the sessions it was built for; CPU the demo default of 8."""
        if self.max_sessions is not None:
            return self.max_sessions
        if self.backend == "trtllm" and self.checkpoint is not None:
            # A compiled engine has a batch size: admit the sessions it was built for.
            return _build_max_sessions(Path(self.checkpoint))
        if not device.startswith("cuda"):
            return CPU_DEFAULT_MAX_SESSIONS if self.memory_limit_gb is None else None
        return None

    def memory_settings(self) -> "MemorySettings":
        """The engine's memory plan settings (``engines.runtime.memory_plan``)."""
        from engines.spec import GIB, MemorySettings

        return MemorySettings(limit_bytes=None if self.memory_limit_gb is None else int(self.memory_limit_gb * GIB),
                              margin_bytes=int(self.memory_margin_gb * GIB),
                              prefill_cache_bytes=int(self.prefill_cache_gb * GIB),
                              concurrent_joins=self.concurrent_joins, sessions_setting=env_name("max_sessions"))


def parse_devices(items: tuple[str, ...]) -> list[str]:
    """``PERSONAPLEX_DEVICES`` items as device names: ``N`` and ``cuda:N`` are ``cuda:N``,
    ``cpu`` may repeat (several CPU engines, for tests), ``all`` stands alone; a GPU may not
    be listed twice (two engines would split one GPU's memory, each sized for all of it)."""
    where = env_name("devices")
    if "all" in items:
        if len(items) != 1:
            raise SettingsError(f"{where}: 'all' cannot be combined with other devices, got {','.join(items)!r}")
        return ["all"]
    devices: list[str] = []
    for item in items:
        name = item.lower()
        index = name.removeprefix("cuda:")
        if name == "cpu":
            devices.append("cpu")
        elif index.isdigit() and index.isascii():
            device = f"cuda:{int(index)}"
            if device in devices:
                raise SettingsError(f"{where} lists {device} twice, got {','.join(items)!r}")
            devices.append(device)
        else:
            raise SettingsError(f"{where}: {item!r} is not a device; use GPU indexes (0,1), cuda:N, cpu or all")
    return devices


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"{CONFIG_ENV}={str(path)!r} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{CONFIG_ENV}={str(path)!r} is not valid TOML: {exc}") from exc
    table = data.get("personaplex", data)
    if not isinstance(table, dict):
        raise SettingsError(f"{CONFIG_ENV}: [personaplex] must be a table")
    return dict(table)


def _coerce(name: str, type_name: Any, raw: Any) -> Any:
    """Parse ``raw`` for the field's annotated type (annotations are strings here)."""
    type_name = str(type_name)
    where = env_name(name)
    optional = "None" in type_name
    empty = ("", "none", "null", "auto") if name in AUTO_SETTINGS else ("", "none", "null")
    if raw is None or (optional and isinstance(raw, str) and raw.strip().lower() in empty):
        if not optional:
            raise SettingsError(f"{where} must be set")
        return None
    try:
        if type_name.startswith("tuple"):
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(str(item).strip() for item in items if str(item).strip())
        if type_name.startswith("int"):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if type_name.startswith("float"):
            if isinstance(raw, bool):
                raise ValueError(raw)
            value = float(raw)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(raw)
            return value
        if type_name.startswith("str"):
            if not isinstance(raw, str):
                raise ValueError(raw)
            return raw
    except (TypeError, ValueError):
        kind = type_name.split(" ")[0].split("[")[0]
        raise SettingsError(f"{where} must be {kind}, got {raw!r}") from None
    raise SettingsError(f"{where}: unsupported setting type {type_name}")  # pragma: no cover


def _build_max_sessions(build_dir: Path) -> int:
    """``max_sessions`` of a convert_checkpoint.py build (engines.runtime.trtllm.layout's runtime.json);
    the CPU default when unreadable (the engine then reports what is wrong with the directory)."""
    try:
        return max(1, int(json.loads((build_dir / "runtime.json").read_text())["max_sessions"]))
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_DEFAULT_MAX_SESSIONS


def device_labels(devices: list[str]) -> list[str]:
    """Names for the engines' devices: the device itself, or ``device#index`` for a device
    that serves more than one engine (``cpu,cpu``), so that every label is unique."""
    counts = Counter(devices)
    return [device if counts[device] == 1 else f"{device}#{index}" for index, device in enumerate(devices)]


def visible_gpus() -> int:
    """How many CUDA devices this process's engines could use.  Asked of the driver first
    (``_driver_gpu_count``: milliseconds), so that the engine host, which only resolves the
    devices, does not import torch (~3 s of every start on the H200, before any engine
    process starts); torch answers whenever the driver does not say yes."""
    count = _driver_gpu_count()
    if count:
        return count
    import torch  # only to probe for a GPU; the server itself never touches tensors

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _driver_gpu_count() -> int | None:
    """The CUDA driver's device count (it honours ``CUDA_VISIBLE_DEVICES`` as torch does), or
    None when unsure: no driver, an error, or a torch built without CUDA (read from its
    ``version.py``, not imported), which could not use a GPU the driver sees."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    built_for = re.search(r"^cuda\b.*=\s*(.+)$", version, re.MULTILINE)
    if built_for is None or built_for.group(1).strip() == "None":
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return count.value


def _no_cuda_why() -> str:
    """Why torch sees no GPU, in the words an operator can act on."""
    import torch

    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is built without CUDA"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}")
