"""The one interface between the orchestrator and a model engine.

An engine owns a fixed pool of session slots.  The orchestrator's tick scheduler decides
*which* slots advance in a tick; the engine decides *how* (tensors, batching, graphs).
Nothing here is thread-safe: every method is called from the single engine-owner thread,
never from the asyncio loop.

Audio crossing this interface is always mono float32 PCM at 24 kHz in whole 80 ms frames
of 1920 samples; format conversion and resampling happen in the orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol, Sequence, TypeVar

import numpy as np

from engines.config import DEFAULT_PERSONA, DEFAULT_VOICE, FRAME_SAMPLES, SAMPLE_RATE

T = TypeVar("T")



class _Waiting:
    def __repr__(self) -> str:
        return "WAITING"


# What a piece yields when it did no work because what it needs is held by another
# preparation under way (the GPU's one piece graph): call it again after that one's pieces.
WAITING = _Waiting()

# Work done a piece per ``next()`` (a prefill: see ``Engine.prepare_in_pieces``); each piece
# yields None, or ``WAITING``; the generator's return value is the result.
Pieces = Generator["_Waiting | None", None, T]


def to_completion(pieces: Pieces[T]) -> T:
    """Run every piece of ``pieces``; its result.  Pieces run this way must not wait (no
    other preparation can advance meanwhile): ``RuntimeError`` if one does."""
    while True:
        try:
            if next(pieces) is WAITING:
                pieces.close()
                raise RuntimeError("a preparation run to completion waited for another one under way")
        except StopIteration as done:
            return done.value


def in_one_piece(work: Callable[[], T]) -> Pieces[T]:
    """``work`` as pieces, for an engine whose preparation cannot be split."""
    result = work()
    yield from ()
    return result


class EngineError(Exception):
    """Base class of errors an engine reports to its caller.

    ``code`` is the protocol error code the orchestrator forwards to clients.
    """

    code = "engine_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidSessionSpec(EngineError):
    """The requested voice or persona cannot be used (client error)."""

    code = "invalid_voice"


def shown(value: object, limit: int = 64) -> str:
    """A client's value as it may appear in an error message or a log line: its ``repr``
    (control characters and quotes escaped, so it cannot forge a line) cut to ``limit``
    characters, saying how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def is_text(value: str) -> bool:
    """Whether ``value`` is text the tokenizer can take: a JSON string may hold lone UTF-16
    surrogates (``"\\ud800"``), which no UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_voice_name(name: str) -> None:
    """A voice is a bare ``.pt`` basename: no directories, no ``..``.  Here, not in
    ``voices.py``, so that the front end (no torch) checks names with the same rule."""
    if (
        not isinstance(name, str)
        or not name.endswith(".pt")
        or len(name) <= 3
        or "/" in name
        or "\\" in name
        or ".." in name
        or name.startswith(".")
        or "\x00" in name
    ):
        raise InvalidSessionSpec(f"invalid voice {shown(name)}: expected a bare '.pt' file name such as 'NATF2.pt'")


class PrefillUnavailable(EngineError):
    """The voice bundle or tokenizer could not be read for this session."""

    code = "prefill_unavailable"


class NoFreeSlot(EngineError):
    code = "resource_exhausted"


class SlotFault(EngineError):
    """``step`` failed for some of its slots only (e.g. non-finite values in their rows).

    ``slots``: the failed slots; their state is suspect and the caller restarts them.
    ``outputs``: aligned with the step's slots, a ``FrameOutput`` for every slot that did
    advance and None for a failed one; or None if no slot advanced at all (the caller then
    steps the others' frames again).  Any other exception from ``step`` tells the caller
    nothing about which slot failed, so it fails every slot of that step.
    """

    def __init__(self, message: str, slots: Sequence[int], outputs: Sequence[FrameOutput | None] | None = None):
        super().__init__(message)
        self.slots = tuple(slots)
        self.outputs = list(outputs) if outputs is not None else None


# The ranges the engine stores sampling settings in (float32 and int64 per slot).  Above
# MAX_TEMPERATURE sampling is uniform to float32 precision anyway; top-k wider than any
# vocabulary means "all tokens".
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one session (reference defaults)."""

    greedy: bool = False
    temp_audio: float = 0.8
    temp_text: float = 0.7
    topk_audio: int = 250
    topk_text: int = 25

    def __post_init__(self) -> None:
        for temperature in (self.temp_audio, self.temp_text):
            if not 0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN
                raise ValueError(f"temperatures must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
        for top_k in (self.topk_audio, self.topk_text):
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
                raise ValueError(f"top-k must be an integer in [1, {MAX_TOP_K}], got {top_k!r}")


@dataclass(frozen=True)
class SessionSpec:
    """What a session asks of the model: voice, persona, decoding and seed."""

    voice: str = DEFAULT_VOICE
    persona: str = DEFAULT_PERSONA
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None: drawn by the engine

    def __post_init__(self) -> None:
        if not isinstance(self.persona, str) or not is_text(self.persona):
            raise ValueError("the persona must be text (a lone surrogate cannot be tokenized)")

    @property
    def effective_persona(self) -> str:
        # An empty persona crashes the reference; we use the default one (protocol notes).
        return self.persona if self.persona and self.persona.strip() else DEFAULT_PERSONA


@dataclass(frozen=True)
class FrameOutput:
    """One 80 ms frame produced for one slot."""

    pcm: np.ndarray  # float32 [1920], 24 kHz mono
    text_id: int  # inner-monologue token of this frame
    text: str  # its piece with SentencePiece's "▁" as a space; "" for PAD/EPAD


@dataclass(frozen=True)
class EngineInfo:
    model: str  # model name reported by /v1/models and session objects
    backend: str  # "torch", "trtllm", ...
    device: str
    max_slots: int
    is_demo: bool = False  # the embedded untrained tiny model
    sample_rate: int = SAMPLE_RATE
    frame_samples: int = FRAME_SAMPLES


class VoiceCatalog(Protocol):
    """The voices an engine serves, as its callers use them (``engines.checkpoints.voices``
    has the store; the factory adds an operator's directory, the offline tool one voice)."""

    def names(self) -> list[str]: ...

    def check(self, name: str) -> None: ...

    def add_directory(self, directory: Any) -> list[str]: ...

    def register(self, name: str, data: dict) -> None: ...


class Engine(Protocol):
    info: EngineInfo
    voice_store: VoiceCatalog  # the voices it serves

    def voices(self) -> list[str]:
        """Names of the voices a session may ask for (e.g. ``"NATF2.pt"``)."""

    def validate(self, spec: SessionSpec) -> None:
        """Cheap checks of a session spec; raises ``InvalidSessionSpec``."""

    def prepare(self, spec: SessionSpec) -> Any:
        """Validate ``spec`` and compute (or find cached) its voice + persona prefill.

        May take a while on a cold cache; raises ``InvalidSessionSpec`` or
        ``PrefillUnavailable``.  ``open_slot`` calls it when not given its result.
        """

    def prepare_in_pieces(self, spec: SessionSpec) -> Pieces[Any]:
        """``prepare`` split into pieces of bounded cost, one per ``next()``, so that the
        caller can run live ticks between them; returns what ``prepare`` returns.  A piece
        that yields ``WAITING`` did nothing: another preparation under way holds what it
        needs, and the caller should run that one's pieces first."""

    def open_slot(self, spec: SessionSpec, prefill: Any = None) -> int:
        """Allocate a slot, install the prefill (``prepare``'s result, computed when None),
        return the slot id; ``NoFreeSlot`` if full."""

    def restart_slot(self, slot: int, prefill: Any = None) -> None:
        """Start a new epoch in ``slot``: fresh model context with the prefill of its session
        (``prepare``'s result, computed when None) replayed."""

    def step(self, slots: Sequence[int], pcm: np.ndarray) -> list[FrameOutput]:
        """Advance every slot in ``slots`` by one frame in one batched call.

        ``pcm`` is float32 [len(slots), 1920]; returns one ``FrameOutput`` per slot, in order.
        """

    def close_slot(self, slot: int) -> None:
        """Release ``slot``; its state can never reach another session."""

    def close_slots(self, slots: Sequence[int]) -> None:
        """``close_slot`` of every slot in ``slots``, in one wipe (many clients leaving
        together cost about what one does)."""

    def free_slots(self) -> int:
        """Number of slots that ``open_slot`` can still allocate."""

    def capture_graphs(self) -> None:
        """Do now, at start-up, the one-time work of first use (capturing and compiling the
        GPU graphs of every batch size) that would otherwise stall live sessions later."""
