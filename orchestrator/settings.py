"""Server configuration: one frozen dataclass, read from ``PERSONAPLEX_*`` environment
variables and optionally a TOML file.

Precedence: built-in defaults < the TOML file named by ``PERSONAPLEX_CONFIG`` < environment
variables.  The TOML file holds the same names as the dataclass fields, in lower case, at top
level or under a ``[personaplex]`` table (``max_sessions = 4``).  Every value is checked once
here, with a message naming the variable, so a typo fails at start-up and not mid-call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

ENV_PREFIX = "PERSONAPLEX_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

# Default admission on CPU: the tiny demo model steps a frame in a few ms per session on two
# cores, and 8 sessions is the CPU load target (spec/performance.md).
CPU_DEFAULT_MAX_SESSIONS = 8
# Upper bound of the derived default; the engine allocates one KV window per slot up front.
DERIVED_MAX_SESSIONS_CAP = 128


class SettingsError(ValueError):
    """A configuration value is missing, malformed or out of range."""


@dataclass(frozen=True)
class Settings:
    # Model ---------------------------------------------------------------------------------
    checkpoint: str | None = None  # checkpoint directory; None = embedded tiny demo model
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N"
    backend: str = "torch"
    window: str = "reference"  # attention window policy handed to the engine
    # Admission: None derives it from device memory and session_memory_gb (see resolve_*).
    max_sessions: int | None = None
    session_memory_gb: float = 1.6  # device memory of one session's full KV window (7B, bf16)
    # Lockstep scheduler ----------------------------------------------------------------------
    batch_window_ms: float = 20.0  # longest a ready frame waits for the other sessions' frames
    silence_grace_s: float = 3.0  # input stall after which silence is fed; 0 disables it
    warmup_frames: int = 4  # silent frames stepped through a throwaway slot before /ready
    # Protocol --------------------------------------------------------------------------------
    frames_per_delta: int = 1  # 80 ms frames per response.output_audio.delta
    first_message_timeout_s: float = 10.0  # connect -> first session.update
    idle_timeout_s: float = 300.0  # no client event for this long closes the session
    ready_wait_s: float = 180.0  # how long an open waits for the engine to finish loading
    max_event_bytes: int = 15 * 1024 * 1024  # larger client events get event_too_large
    max_pending_input_bytes: int = 16 * 1024 * 1024  # queued input (float32 at 24 kHz)
    max_output_buffer_bytes: int = 32 * 1024 * 1024  # unsent server events per session
    close_timeout_s: float = 5.0  # how long a closing session may take to flush its events
    api_keys: tuple[str, ...] = ()  # accepted "Authorization: Bearer" keys; empty = open
    model_name: str | None = None  # model id to report; None = the engine's name

    def __post_init__(self) -> None:
        def positive(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if value < 0 or (value == 0 and not allow_zero):
                raise SettingsError(f"{env_name(name)} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")

        if self.max_sessions is not None and not 1 <= self.max_sessions <= 4096:
            raise SettingsError(f"{env_name('max_sessions')} must be in [1, 4096], got {self.max_sessions!r}")
        for name in ("session_memory_gb", "frames_per_delta", "first_message_timeout_s", "idle_timeout_s",
                     "ready_wait_s", "max_event_bytes", "max_pending_input_bytes", "max_output_buffer_bytes",
                     "close_timeout_s"):
            positive(name)
        for name in ("batch_window_ms", "silence_grace_s", "warmup_frames"):
            positive(name, allow_zero=True)
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise SettingsError(f"{env_name('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.checkpoint is not None and not Path(self.checkpoint).is_dir():
            raise SettingsError(f"{env_name('checkpoint')}={self.checkpoint!r} is not a directory")

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
            if name not in by_name:
                raise SettingsError(f"unknown setting {name!r}; known: {', '.join(sorted(by_name))}")
            kwargs[name] = _coerce(name, by_name[name].type, raw)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    # Derived values ---------------------------------------------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only to probe for a GPU; the server itself never touches tensors

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_max_sessions(self, device: str) -> int:
        """The configured admission, or one derived from device memory and the KV budget.

        On a GPU: (total memory - checkpoint size on disk) * 0.9 / ``session_memory_gb``,
        clamped to [1, 128].  On CPU the demo default of 8.
        """
        if self.max_sessions is not None:
            return self.max_sessions
        if not device.startswith("cuda"):
            return CPU_DEFAULT_MAX_SESSIONS
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        weights = _dir_bytes(Path(self.checkpoint)) if self.checkpoint else 0
        budget = (total - weights) * 0.9
        return max(1, min(DERIVED_MAX_SESSIONS_CAP, int(budget // (self.session_memory_gb * 2**30))))


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
    if raw is None or (optional and isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
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


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
