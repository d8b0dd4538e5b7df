"""Compiled pieces saved whole and loaded at the next start: no tracing at a restart.

A restart with warm caches still has dynamo trace every compiled piece before Inductor's
caches answer (~14 s of an H200's start, issue 36).  torch's ahead-of-time compilation
(``torch.compile(...).aot_compile``) keeps the traced graph, its guards and Inductor's output in
one file that a fresh process loads without tracing.  ``Precompiled`` puts that behind
``compile_dynamic`` for every compiled piece, while an engine is built inside ``storing_in``.

One compilation specialises on what its guards check, so a piece has several variants (the
batch of 1 that a prefill runs and the 2 or more of the ticks, per device, per grad mode): each
call picks its variant by a cheap key of its arguments (``variant_key``) and the variant is, in
order, held in memory, loaded from its file, one held already whose guards take the call (the
depformer's first step marks its key buffers static, the later steps pass the step's outputs,
unmarked: one compilation serves both, as under torch.compile), or compiled now and saved.

The guards stay and are checked per call; a loaded variant whose guards refuse the call it was
keyed for is compiled again and its file replaced (logged).  A piece aot_compile cannot take,
or whose keys do not separate what its guards do, goes back to plain torch.compile (logged):
slower to start, never wrong.  The files do not record the source they were traced from, so
their directory is named by a hash of the engine's source (``source_hash``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engines.fastpath.fp8_gemv import GEMV_ROWS

log = logging.getLogger(__name__)

ENGINES = Path(__file__).resolve().parents[1]  # the package whose source the files depend on
GUARD_MISS = "GuardManager check failed"  # how a loaded variant's __call__ refuses
# Dynamic sizes a compilation may be specialised to: dynamo specialises 0 and 1, and fp8
# weights' products branch on the row count (the few-row kernel up to GEMV_ROWS rows), so a
# tick of 2 sessions guards its batch to 2 and is no variant for 4 (seen on an H100, torch
# 2.11: every tick graph past 2 slots fell back to torch.compile).
EXACT_SIZES = max(1, GEMV_ROWS)
# The dimension marks dynamo reads from a tensor (torch._dynamo.decorators); its guards check them.
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
          "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")

# Set while an engine is built (``storing_in``); per thread, as engines of several devices
# may be built at once.
_directory: ContextVar[Path | None] = ContextVar("precompiled_directory", default=None)


@contextlib.contextmanager
def storing_in(directory: Path | None) -> Iterator[None]:
    """Pieces compiled (``compile_dynamic``) inside this keep their variants in ``directory``;
    ``None``: plain torch.compile, as everywhere outside it."""
    token = _directory.set(directory)
    try:
        yield
    finally:
        _directory.reset(token)


def current_directory() -> Path | None:
    return _directory.get()


@lru_cache(maxsize=None)
def source_hash(root: Path = ENGINES) -> str:
    """A hash of every ``*.py`` under ``root`` (paths and contents; the engine's package by
    default): a saved variant was traced from this source, and torch does not check that it
    still matches.  Once per process."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def directory_name(artifact_stem: str) -> str:
    """The variants' directory beside the artifact file of ``artifact_stem``: also named by
    Python's version (the files hold bytecode) and the engine's source."""
    return f"{artifact_stem}-py{sys.version_info.major}.{sys.version_info.minor}-src{source_hash()}"


def variant_key(value: Any) -> Any:
    """What separates the compilations of one piece, from its arguments, cheaply (no tensor
    data): a tensor's class, dtype, device, layout, grad and inference flags, its dimension
    marks and its sizes, where a dynamic size counts as itself up to ``EXACT_SIZES`` and as
    "more" above, and a static one (a parameter's, a marked one) as itself; scalars and strings
    by value; modules by class.  Takes the marks off the tensors it is given (``_take_marks``)."""
    if isinstance(value, torch.Tensor):
        marks = _take_marks(value)
        static = dict(marks).get("_dynamo_static_indices", ()) if marks else ()
        if isinstance(value, torch.nn.Parameter):
            sizes = tuple(value.shape)
        else:
            sizes = tuple(s if s <= EXACT_SIZES or i in static else EXACT_SIZES + 1
                          for i, s in enumerate(value.shape))
        return (value.__class__, value.dtype, value.device, sizes, value.is_contiguous(), value.requires_grad,
                value.is_inference(), marks)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(variant_key(item) for item in value)
    return type(value)  # a module, anything else: by class, its guards decide the rest


# Dimension marks (``torch._dynamo.mark_static``, ``fastpath.compiled.static_shapes``) are read
# when a piece is traced; a loaded variant's guards hold them as absent (its example tensors
# are not saved), and refuse a tensor that carries any.  So a precompiled piece's tensors carry
# their marks only while it is traced: the first call takes them off into ``_MARKS_TAKEN``
# (which no guard reads) and tracing puts them back for its length (``_marks_on``).
_MARKS_TAKEN = "_precompiled_marks"


def _take_marks(tensor: torch.Tensor) -> tuple | None:
    """``tensor``'s dimension marks as ((attribute, dims), ...), taken off it; None: unmarked."""
    # torch 2.13 flags a marked tensor with ``_has_dynamo_dim_marking``; 2.11's ``mark_static``
    # sets its index set alone: either counts.
    present = [name for name in _MARKS if hasattr(tensor, name)]
    if present or getattr(tensor, "_has_dynamo_dim_marking", False):
        taken = tuple((name, tuple(sorted(getattr(tensor, name)))) for name in present)
        for name in present:
            delattr(tensor, name)
        if hasattr(tensor, "_has_dynamo_dim_marking"):
            del tensor._has_dynamo_dim_marking
        setattr(tensor, _MARKS_TAKEN, taken)
        return taken
    return getattr(tensor, _MARKS_TAKEN, None)


@contextlib.contextmanager
def _marks_on(args: tuple) -> Iterator[None]:
    """The marks ``_take_marks`` took off the tensors of ``args`` back on them, for tracing."""
    marked = [t for t in _tensors(args) if hasattr(t, _MARKS_TAKEN)]
    for tensor in marked:
        _put_marks(tensor)
    try:
        yield
    finally:
        for tensor in marked:
            _take_marks(tensor)


def _put_marks(tensor: torch.Tensor) -> None:
    for name, dims in getattr(tensor, _MARKS_TAKEN):
        setattr(tensor, name, set(dims))
    tensor._has_dynamo_dim_marking = True
    delattr(tensor, _MARKS_TAKEN)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


@dataclass
class Tally:
    """What the precompiled pieces of this process did: variants per source, seconds each."""

    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def count(self, kind: str) -> int:
        return self.counts.get(kind, 0)


LOADED, SHARED, COMPILED, FELL_BACK = "loaded", "shared", "compiled", "fell back"
TALLY = Tally()


def report() -> str:
    """One line for the start's log: variants loaded, shared, compiled and left to torch.compile."""
    return ", ".join(f"{TALLY.count(kind)} {kind} ({TALLY.seconds.get(kind, 0.0):.1f} s)"
                     for kind in (LOADED, SHARED, COMPILED, FELL_BACK))


class Precompiled:
    """``fn`` compiled ahead of time per variant of its arguments, the variants kept in
    ``directory`` (one file each); ``compile_dynamic``'s settings (dynamic shapes, no graph
    breaks).  A bound method is compiled as its function, its instance the first argument."""

    def __init__(self, fn: Callable, directory: Path) -> None:
        self.directory = directory
        self.instance = getattr(fn, "__self__", None)
        self.function = fn.__func__ if self.instance is not None else fn
        self.name = f"{self.function.__module__}.{self.function.__qualname__}"
        self._fn = fn
        self._variants: dict[Any, Callable] = {}
        self._fallback: Callable | None = None  # plain torch.compile, once this piece needs it
        self._fallback_keys: set = set()
        self._unaccounted = 0.0  # seconds of a failed aot_compile, counted with the fallback
        self._file_stem: str | None = None
        # Keys of loaded variants whose guards could not be checked here, or refused a global
        # that this process may hold another way (``_global_refusal``): tried at their first call.
        self._unproven: set = set()

    def __reduce__(self) -> tuple:
        # A variant whose arguments include a module instance pickles, with its guards, the
        # instance's callable attributes, this piece among them when it is kept on the
        # instance (the quantizer's encode and decode): its variants hold guard managers,
        # which cannot be pickled, so aot_compile refused the second piece of the instance
        # to be compiled (on the H200, the quantizer's decode went back to torch.compile at
        # every start).  No guard reads this copy: it travels as its name only.
        return _unpickled_piece, (self.name,)

    def __call__(self, *args: Any) -> Any:
        if self._fallback is not None:
            return self._call_fallback(args)
        key = (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), variant_key(args))
        variant = self._variants.get(key)
        if variant is None:
            variant = self._resolve(key, args)
            if variant is None:  # given up: torch.compile from now on
                return self._call_fallback(args)
            self._variants[key] = variant
        try:
            result = variant(*self._full(args))
        except RuntimeError as exc:
            if not str(exc).startswith(GUARD_MISS):
                raise
            if key not in self._unproven:
                self._give_up(f"its variant keys do not separate what its guards check ({_short(exc)})")
                return self._call_fallback(args)
            # A loaded variant tried on trust: this one only is compiled again.
            self._unproven.discard(key)
            log.warning("precompiled %s: a loaded variant refused its first call (%s); compiling it again",
                        self.name, _short(exc))
            variant = self._compile(self._path(key), self._full(args))
            if variant is None:
                return self._call_fallback(args)
            self._variants[key] = variant
            return variant(*self._full(args))
        if self._unproven:
            self._unproven.discard(key)
        return result

    # Finding a variant ------------------------------------------------------------------
    def _resolve(self, key: Any, args: tuple) -> Callable | None:
        """The variant for a call of ``key``: loaded, shared, or compiled now; None where the
        piece cannot be compiled ahead of time (``_fallback`` is then set)."""
        full = self._full(args)
        path = self._path(key)
        stale = None
        if path.is_file():
            start = time.perf_counter()
            _install_import_aliases(self._globals())
            try:
                with path.open("rb") as file:
                    loaded = torch.compiler.load_compiled_function(file, f_globals=self._globals())
                _bind_guard_globals(loaded, self._globals())
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign file is compiled again
                stale = f"could not load it ({type(exc).__name__}: {exc})"
            else:
                accepted = _accepts(loaded, full)
                refusal = _refusal(loaded, full) if accepted is False else ""
                if accepted is not False or _global_refusal(refusal):
                    # None: this torch cannot say; a global: see _global_refusal.  Tried at the call.
                    if accepted is not True:
                        self._unproven.add(key)
                    TALLY.add(LOADED, time.perf_counter() - start)
                    return loaded
                stale = f"its guards refuse the call it is keyed for ({_short(refusal)})"
        else:
            start = time.perf_counter()
            for held in {id(held): held for held in self._variants.values()}.values():
                if _accepts(held, full):  # None (cannot ask): not shared, compiled on its own
                    TALLY.add(SHARED, time.perf_counter() - start)
                    return held
        if stale is not None:
            log.warning("precompiled %s: %s %s; compiling it again", self.name, path.name, stale)
        return self._compile(path, full)

    def _compile(self, path: Path, full: tuple) -> Callable | None:
        import torch._dynamo.config as dynamo_config

        start = time.perf_counter()
        try:
            for attempt in (1, 2):
                try:
                    with dynamo_config.patch(enable_aot_compile=True), _marks_on(full):
                        compiled = torch.compile(self.function, dynamic=True, fullgraph=True).aot_compile((full, {}))
                    break
                except Exception as exc:  # noqa: BLE001 - see below
                    # A float that its graph needs as a constant (a global eps under dynamic
                    # shapes) stops the first trace; torch.compile traces again, aot_compile
                    # leaves that to its caller, and dynamo has noted the float to fix by then.
                    if attempt == 2 or type(exc).__name__ != "TensorifyScalarRestartAnalysis":
                        raise
        except Exception as exc:  # noqa: BLE001 - whatever aot_compile refuses, torch.compile takes
            self._give_up(f"aot_compile refused it ({type(exc).__name__}: {_short(exc)})")
            self._unaccounted = time.perf_counter() - start
            return None
        self._save(compiled, path)
        seconds = time.perf_counter() - start
        TALLY.add(COMPILED, seconds)
        log.info("precompiled %s: compiled %s in %.1f s", self.name, path.name, seconds)
        return compiled

    def _save(self, compiled: Any, path: Path) -> None:
        """Write the variant's file atomically (a reader never sees half a file); a directory
        that cannot be written leaves the variant in memory only."""
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(partial))
            partial.replace(path)
        except Exception as exc:  # noqa: BLE001 - unsaved is slower at the next start, not wrong
            partial.unlink(missing_ok=True)
            log.warning("precompiled %s: could not write %s (%s: %s)", self.name, path, type(exc).__name__, exc)

    # Plain torch.compile ----------------------------------------------------------------
    def _give_up(self, why: str) -> None:
        log.warning("precompiled %s: %s; plain torch.compile for it instead", self.name, why)
        self._fallback = torch.compile(self._fn, dynamic=True, fullgraph=True)
        self._variants.clear()

    def _call_fallback(self, args: tuple) -> Any:
        """torch.compile's call; the first of each variant timed (with the failed attempt
        before it) as the variant's compilation."""
        key = (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), variant_key(args))
        for tensor in _tensors(args):  # torch.compile reads the marks at every call
            if hasattr(tensor, _MARKS_TAKEN):
                _put_marks(tensor)
        if key in self._fallback_keys:
            return self._fallback(*args)
        start = time.perf_counter()
        result = self._fallback(*args)
        self._fallback_keys.add(key)
        TALLY.add(FELL_BACK, time.perf_counter() - start + self._unaccounted)
        self._unaccounted = 0.0
        return result

    def _full(self, args: tuple) -> tuple:
        """The compiled function's arguments: a bound method's instance first."""
        return args if self.instance is None else (self.instance,) + args

    # Naming -----------------------------------------------------------------------------
    def _path(self, key: Any) -> Path:
        return self.directory / f"{self._stem()}-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}.aot"

    def _globals(self) -> dict:
        return vars(sys.modules[self.function.__module__])

    def _stem(self) -> str:
        """The piece's part of its files' names: its qualified name and, for a bound method,
        its instance's structure (the encoder's and the decoder's SEANet share ``_run``)."""
        if self._file_stem is None:
            stem = self.name.replace("<", "").replace(">", "")
            if self.instance is not None:
                structure = repr(self.instance) + repr(
                    [(name, tuple(p.shape), p.dtype) for name, p in self.instance.named_parameters()])
                stem += "-" + hashlib.sha256(structure.encode()).hexdigest()[:12]
            self._file_stem = stem
        return self._file_stem


def _unpickled_piece(name: str) -> Callable:
    """What a piece pickled with another variant's guards is when loaded: never called."""
    def piece(*args: Any) -> Any:
        raise RuntimeError(f"{name}: a copy pickled with a compiled variant's guards cannot be called")
    return piece


def _accepts(compiled: Any, full: tuple) -> bool | None:
    """Whether ``compiled``'s guards take these arguments (without calling it); None where this
    torch offers no way to ask (the attributes below are torch's own and change between
    versions): a loaded variant is then tried, and a guard miss at the call falls back."""
    try:
        check = getattr(compiled, "guard_check", None)  # torch 2.13; the same, spelled out, before
        if check is not None:
            return bool(check(*full))
        return bool(compiled._artifacts.guard_manager.check(compiled.prepare_f_locals(*full)))
    except Exception as exc:  # noqa: BLE001 - see above
        log.debug("cannot check the guards of %s: %s", compiled, exc)
        return None


def _install_import_aliases(namespace: dict) -> None:
    """The names dynamo gives the engine's modules in a traced function's globals.  Tracing
    reads another module's global (``layers.linear``'s constants, inlined into ``lm``) through
    an alias it installs there (``__import_engines_dot_model_dot_layers``); a variant loaded in
    a new process was never traced in it, and its guards and code look the alias up (an H100's
    fp8 restart, torch 2.11: every LM piece refused on it).  Installing them is what tracing
    would have done."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("engines."):
            namespace.setdefault(f"__import_{name.replace('.', '_dot_')}", module)


def _bind_guard_globals(loaded: Any, namespace: dict) -> None:
    """Point a loaded variant's shape guards at ``namespace`` (the traced function's module).

    With dynamic shapes a float global (``LAYER_NORM_EPS``, ``layers``' constants) is traced as
    a symbolic float and then specialised, which leaves shape guards such as
    ``G['LAYER_NORM_EPS'] == 1e-05``.  torch (2.11 and 2.13) builds a loaded variant's shape
    guards over the globals pickled with its guards, which hold none of the module's (its
    global guards are filtered out before saving), not over ``f_globals``: every such guard
    then fails on the missing name, and the refusal names it bare.  Rebuilt over the module's
    own namespace, the guards read its values at each call.  Where this torch is built
    otherwise the variant keeps its guards: refused, it is compiled again (slower, never a
    call its guards should refuse)."""
    import dataclasses

    try:
        from torch._dynamo.package import load_guard_manager, load_guards_state

        artifacts = loaded._artifacts
        state = load_guards_state(artifacts.guards_state)
        for name, value in state.output_graph.global_scope.items():  # the builtins dict it names
            namespace.setdefault(name, value)
        state.output_graph = dataclasses.replace(state.output_graph, global_scope=namespace)
        artifacts.guard_manager = load_guard_manager(state, artifacts.original_code, loaded.fn.__globals__)
    except Exception as exc:  # noqa: BLE001 - torch's own structures: left as loaded
        log.debug("cannot rebuild the guards of %s over its module: %s", loaded, exc)


def _global_refusal(refusal: str) -> bool:
    """Whether a guard refusal names a global only (torch words a global its guard check cannot
    find as the bare quoted name): not a reason to recompile before the call has been tried.
    Since ``_bind_guard_globals`` the guards find the module's globals; this remains for a
    torch whose guards it cannot rebind."""
    return re.search(r"verbose_code_parts=\[\s*['\"]'[A-Za-z_][A-Za-z0-9_]*'['\"]\s*\]", refusal) is not None


def _refusal(compiled: Any, full: tuple) -> str:
    """Which guard refuses the arguments, where torch can say."""
    try:
        return str(compiled._artifacts.guard_manager.check_verbose(compiled.prepare_f_locals(*full)))
    except Exception as exc:  # noqa: BLE001 - only for the log line
        return f"(torch cannot say: {type(exc).__name__})"


def _short(reason: Any) -> str:
    """A guard failure or an exception in one line a log can carry."""
    return " ".join(str(reason).split())[:400]
