"""One line of help per server setting, grouped: what ``personaplex-serve --help`` prints.

``orchestrator/settings.py`` holds the settings (their types, defaults and checks, with the
reasons in its comments); this module says in one line each what an operator sets them for.
``tests/test_serve_cli.py`` holds the two to each other: every setting has exactly one line
here.  docs/ORCHESTRATOR.md, "Settings", has the long form.  Torch-free, Quart-free.
"""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, fields

from .settings import AUTO_SETTINGS, CONFIG_ENV, Settings, env_name

GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Model and devices", (
        ("checkpoint", "checkpoint directory, or Hugging Face repo id owner/name[@revision]; unset: the embedded "
                       "tiny demo model; random:personaplex-7b: random 7B weights (measurements)"),
        ("voice_dir", "a directory of voice .pt files served beside the checkpoint's own"),
        ("model_name", "the model id /v1/models reports (default: the repo id, else the engine's name)"),
        ("device", "auto (cuda if available), cpu, cuda or cuda:N"),
        ("devices", "one engine per listed device: 0,1 or cuda:0,cuda:1 or all; set this or --device"),
        ("backend", "torch, or trtllm with a convert_checkpoint.py build directory"),
        ("window", "attention window policy handed to the engine"),
        ("kv_cache", "auto (exact, the model dtype, unless max_sessions needs the 8-bit cache: fp8 on CUDA "
                     "8.9+, else int8), fp8 (~half the KV memory per session, CUDA 8.9+) or int8 (the same, any GPU)"),
        ("weights", "auto (as stored) or fp8 (LM projections quantized at load: ~9 GB instead of ~17)"),
        ("compile", "torch.compile the GPU fast path: auto (on for CUDA), on, off"),
        ("compile_artifacts", "torch.compile's portable artifacts: auto (in the cache directory), off, or a "
                              "directory (an image's or a volume's): a new machine starts like a restart"),
        ("precompile", "keep compiled pieces whole beside the artifacts so a restart loads them untraced "
                       "(torch's aot_compile, experimental): on, or off: torch.compile traces them every start"),
        ("gpu_arch", "GPU capability the engine takes: auto (the device's), or sm80/sm86/sm89/sm90 to act as that GPU"),
        ("cpu_threads", "torch intra-op threads of an engine on the CPU; 0: torch's default"),
    )),
    ("Capacity and device memory", (
        ("max_sessions", "sessions per device; auto: as many as the memory plan fits on a GPU, 8 on CPU"),
        ("memory_limit_gb", "the most device memory one engine plans with (share a GPU; plan on CPU)"),
        ("memory_margin_gb", "device memory kept free beside every planned item"),
        ("prefill_cache_gb", "device memory the cache of prepared system prompts may keep; 0: none"),
        ("concurrent_joins", "joins prepared at once per engine (the plan reserves room for each)"),
        ("join_wait_s", "longest an open waits for its turn to be prepared, then resource_exhausted"),
        ("max_connections_per_worker", "connections one front-end worker holds; past it, HTTP 503"),
    )),
    ("Lockstep", (
        ("tick_policy", "paced (large batches under load) or window (tick as soon as every frame is in)"),
        ("tick_busy_target", "paced: the share of time the engine is kept busy"),
        ("batch_window_ms", "window: longest a ready frame waits; paced: the shortest tick interval"),
        ("silence_grace_s", "input stall after which silence is fed; 0: never"),
        ("warmup_frames", "silent frames stepped before /ready"),
        ("run_dir", "where one server's processes meet (sockets, layout, metrics files)"),
    )),
    ("Protocol and per-session limits", (
        ("frames_per_delta", "80 ms frames per response.output_audio.delta"),
        ("first_message_timeout_s", "connect to first session.update"),
        ("idle_timeout_s", "no client event for this long closes the session"),
        ("ready_wait_s", "how long an open waits for the engines to finish loading"),
        ("close_timeout_s", "how long a closing session may take to flush its events"),
        ("max_event_bytes", "largest client event (Realtime)"),
        ("max_native_message_bytes", "largest binary message (/api/chat)"),
        ("max_pending_input_bytes", "client audio queued per session before input_backpressure"),
        ("max_output_buffer_bytes", "server events unsent per session before output_backpressure"),
        ("max_instructions_chars", "longest persona (each token is one prefill step)"),
        ("opus_codec", "/api/chat Opus: auto, libopus (off the interpreter lock) or sphn"),
        ("opus_library", "libopus's file; unset: the system's (Debian libopus0)"),
        ("opus_encode_threads", "threads per worker that encode native sessions' output"),
    )),
    ("Access and client limits", (
        ("auth", "auto (keys required unless every listener is loopback), required or off"),
        ("api_keys", "accepted Authorization: Bearer keys, comma-separated"),
        ("api_keys_file", "more keys, one per line, read at start"),
        ("bind", "the listening addresses, for when the sockets cannot be inspected (use --bind)"),
        ("allowed_origins", "browser Origins besides the server's own; * = any"),
        ("trusted_proxies", "peers whose X-Forwarded-For names the client"),
        ("max_sessions_per_key", "concurrent websockets per API key; 0: no limit"),
        ("max_sessions_per_ip", "concurrent websockets per client address; 0: no limit"),
        ("opens_per_minute_per_key", "websocket opens per key per minute; 0: no limit"),
        ("opens_per_minute_per_ip", "websocket opens per address per minute; 0: no limit"),
        ("max_events_per_s", "client events per second per socket; 0: no limit"),
        ("max_input_bytes_per_s", "client bytes per second per socket; 0: no limit"),
        ("refuse_when_full", "event (accept, then resource_exhausted) or http (503 before accepting)"),
    )),
    ("Faults", (
        ("watchdog_deadline_s", "an engine call running longer is a stall; 0: off"),
        ("unhealthy_after_failed_ticks", "consecutive ticks with no output before /health says 503"),
        ("fault_injection", "TESTING ONLY: engine fault plans (orchestrator/fault_injection.py)"),
    )),
)


# Settings with no flag of their own: ``--bind`` is hypercorn's (it makes the sockets).
FLAGLESS = ("bind",)


def flag_name(name: str) -> str:
    """The command-line flag of a setting: ``max_sessions`` -> ``--max-sessions``."""
    return "--" + name.replace("_", "-")


def setting_flags() -> dict[str, str]:
    """Flag -> setting name, for every setting that has a flag."""
    return {flag_name(f.name): f.name for f in fields(Settings) if f.name not in FLAGLESS}


def default_text(name: str) -> str:
    """A setting's default as an operator writes it."""
    field = next(f for f in fields(Settings) if f.name == name)
    value = field.default if field.default is not MISSING else None
    if value is None:
        return "auto" if name in AUTO_SETTINGS else "unset"
    if isinstance(value, tuple):
        return ",".join(value) if value else "unset"
    return str(value)


def settings_help() -> str:
    """Every setting, grouped: flag, environment variable, default, what it is for."""
    lines = textwrap.wrap(f"Settings: each a flag, or its environment variable (which wins where both are set), "
                          f"or the same name in lower case in the TOML file that {CONFIG_ENV} names.", 96)
    for title, entries in GROUPS:
        lines.append(f"\n  {title}:")
        for name, text in entries:
            flag = "" if name in FLAGLESS else f"{flag_name(name)} / "
            lines.append(f"    {flag}{env_name(name)} (default {default_text(name)})")
            lines += textwrap.wrap(text, 96, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)
