"""The precompiled pieces' bookkeeping (engines/fastpath/precompiled.py), in this process: what
keys a variant, where the marks go, which pieces are precompiled at all, and the way back to
torch.compile.  Loading saved variants in a fresh process: tests/test_compile_artifacts.py."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from engines.fastpath import precompiled
from engines.fastpath.compiled import compile_dynamic


def double_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def test_the_source_hash_follows_every_file(tmp_path: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "lm.py").write_text("A = 1\n")
    before = precompiled.source_hash.__wrapped__(tmp_path)
    (tmp_path / "model" / "lm.py").write_text("A = 2\n")
    assert precompiled.source_hash.__wrapped__(tmp_path) != before
    assert precompiled.directory_name("cpu-torch2.13").endswith(f"-src{precompiled.source_hash()}")


def test_a_variant_is_keyed_by_what_its_guards_specialise_on():
    key = precompiled.variant_key
    assert key((torch.zeros(3, 1, 5),)) == key((torch.zeros(7, 1, 9),))  # dynamic sizes: 2 or more
    assert key((torch.zeros(1, 1, 5),)) != key((torch.zeros(2, 1, 5),))  # 0 and 1 are specialised
    assert key((torch.zeros(3),)) != key((torch.zeros(3, dtype=torch.bfloat16),))
    weight = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)
    assert key((weight,)) != key((torch.nn.Parameter(torch.zeros(3, 5), requires_grad=False),))
    assert key((torch.zeros(3), 0.5, "w8a16", None)) != key((torch.zeros(3), 0.25, "w8a16", None))


def test_marks_leave_the_tensor_for_the_key_and_come_back_for_tracing():
    """A loaded variant's guards refuse a marked tensor: the key takes the marks off (static
    dims then count by size) and tracing puts them back."""
    marked = torch.zeros(3, 4)
    torch._dynamo.mark_static(marked, 1)
    key = precompiled.variant_key((marked,))
    assert not hasattr(marked, "_has_dynamo_dim_marking") and not hasattr(marked, "_dynamo_static_indices")
    assert precompiled.variant_key((marked,)) == key  # the same variant after the marks went
    assert key != precompiled.variant_key((torch.zeros(3, 4),))
    other = torch.zeros(3, 5)
    torch._dynamo.mark_static(other, 1)
    assert precompiled.variant_key((other,)) != key  # a static size counts as itself
    with precompiled._marks_on((marked,)):
        assert marked._dynamo_static_indices == {1} and marked._has_dynamo_dim_marking
    assert not hasattr(marked, "_dynamo_static_indices")


def test_only_named_fullgraph_pieces_of_an_engine_being_built_are_precompiled(tmp_path: Path):
    assert not isinstance(compile_dynamic(double_tanh), precompiled.Precompiled)
    with precompiled.storing_in(tmp_path):
        assert isinstance(compile_dynamic(double_tanh), precompiled.Precompiled)
        assert not isinstance(compile_dynamic(double_tanh, fullgraph=False), precompiled.Precompiled)
        assert not isinstance(compile_dynamic(lambda x: x + 1), precompiled.Precompiled)
    assert precompiled.current_directory() is None


def test_a_piece_aot_compile_refuses_goes_back_to_torch_compile(tmp_path: Path, caplog, monkeypatch):
    import torch._dynamo.aot_compile as aot_compile

    def refuse(*args, **kwargs):
        raise NotImplementedError("not this one")

    monkeypatch.setattr(aot_compile, "aot_compile_fullgraph", refuse)
    monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
    with precompiled.storing_in(tmp_path):
        piece = compile_dynamic(double_tanh)
    x = torch.randn(4, 3)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        assert torch.allclose(piece(x), double_tanh(x))
        assert torch.allclose(piece(x[:3]), double_tanh(x[:3]))  # the same variant: 3 and 4 rows
    assert "aot_compile refused it (NotImplementedError: not this one)" in caplog.text
    assert "plain torch.compile for it instead" in caplog.text
    assert precompiled.TALLY.count(precompiled.FELL_BACK) == 1 and list(tmp_path.iterdir()) == []


def scaled_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight * 0.5


def test_a_loaded_variant_takes_the_marked_tensors_it_was_compiled_for(tmp_path: Path, monkeypatch):
    """Weights marked static (``static_shapes``) in this start and the next: the next loads the
    variant the first saved instead of compiling it again."""
    def marked_weight() -> torch.Tensor:
        weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
        torch._dynamo.mark_static(weight)
        return weight

    x = torch.randn(5, 4)
    with precompiled.storing_in(tmp_path), torch.inference_mode():
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
        first = compile_dynamic(scaled_rows)(x, marked_weight())
        assert precompiled.TALLY.count(precompiled.COMPILED) == 1
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())  # a restart: a new piece, new weights
        again = compile_dynamic(scaled_rows)(x, marked_weight())
    assert precompiled.TALLY.counts == {precompiled.LOADED: 1}
    assert torch.equal(first, again)


def few_rows_branch(x: torch.Tensor) -> torch.Tensor:
    """A product that takes another path for a few rows, as fp8 weights' ``layers.linear`` does
    (the few-row kernel up to ``GEMV_ROWS`` rows)."""
    from engines.fastpath.fp8_gemv import GEMV_ROWS

    if x.shape[0] <= GEMV_ROWS:
        return x * 3
    return x * 2


def test_a_tick_of_a_few_rows_is_a_variant_of_its_own(tmp_path: Path, monkeypatch, caplog):
    """The 2-session tick graph guards its batch to 2 where the code branches on the row count:
    4 and 8 sessions need another variant, shared between them, not a guard miss at the call
    that sends the whole piece back to torch.compile (an H100's fp8 restart, 2026-12-05)."""
    monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
    with precompiled.storing_in(tmp_path):
        piece = compile_dynamic(few_rows_branch)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        for batch in (2, 4, 8, 2):
            x = torch.randn(batch, 3)
            assert torch.equal(piece(x), few_rows_branch(x)), batch
    assert "plain torch.compile" not in caplog.text
    assert piece._fallback is None
    assert precompiled.TALLY.count(precompiled.COMPILED) == 2  # 2 rows; 4 and 8 (one dynamic variant)


def test_a_loaded_variant_tried_on_trust_is_compiled_again_alone_when_its_call_refuses(tmp_path: Path, monkeypatch,
                                                                                         caplog):
    """Where guards cannot be checked before the call (torch 2.11 cannot check a global), a
    loaded variant is tried; if the call's guards refuse it, that variant is compiled again
    and the piece stays precompiled (here: the 2-row variant's file put where the 4-row
    variant's belongs)."""
    import shutil

    def key(x: torch.Tensor):
        return (True, False, precompiled.variant_key((x,)))

    two, four = torch.randn(2, 3), torch.randn(4, 3)
    with precompiled.storing_in(tmp_path), torch.inference_mode():
        first = compile_dynamic(few_rows_branch)
        first(two), first(four)
        shutil.copyfile(first._path(key(two)), first._path(key(four)))
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
        monkeypatch.setattr(precompiled, "_accepts", lambda compiled, full: None)
        again = compile_dynamic(few_rows_branch)  # a restart
        with caplog.at_level(logging.WARNING):
            assert torch.equal(again(four), four * 2)
            assert torch.equal(again(two), two * 3)
    assert "refused its first call" in caplog.text and again._fallback is None
    assert precompiled.TALLY.counts == {precompiled.LOADED: 2, precompiled.COMPILED: 1}


def test_a_refusal_naming_a_global_alone_is_tried_at_the_call(tmp_path: Path, monkeypatch):
    """A refusal of a global alone is tried, and the load installs the import aliases tracing
    would have (taken away here as a new process would lack them)."""
    alias = "__import_engines_dot_fastpath_dot_fp8_gemv"
    x = torch.randn(4, 3)
    with precompiled.storing_in(tmp_path), torch.inference_mode():
        compile_dynamic(few_rows_branch)(x)
        vars(sys.modules[__name__]).pop(alias, None)
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
        monkeypatch.setattr(precompiled, "_accepts", lambda compiled, full: False)
        monkeypatch.setattr(precompiled, "_refusal", lambda compiled, full: (
            """GuardDebugInfo( result=0, verbose_code_parts=["'LAYER_NORM_EPS'"], num_guards_executed=27)"""))
        assert torch.equal(compile_dynamic(few_rows_branch)(x), x * 2)
    assert precompiled.TALLY.counts == {precompiled.LOADED: 1}
    assert alias in vars(sys.modules[__name__])


NORM_EPS = 1e-5  # a module float read by a compiled piece, as Mimi's LAYER_NORM_EPS is


def normed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, NORM_EPS) * 2


def test_a_piece_reading_a_float_global_loads_at_the_next_start(tmp_path: Path, monkeypatch, caplog):
    """Under dynamic shapes the float is first traced as a symbol that layer_norm cannot take
    (aot_compile raises where torch.compile would trace again: traced again here), then fixed
    to its value by shape guards that read the module's globals; a loaded variant's guards
    read them from its own module (torch builds them over the globals pickled with the guards,
    which hold none: an H200's fp8 restart compiled 8 variants again for it)."""
    torch._dynamo.reset()  # dynamo's process-wide note of floats to fix, which would hide the retrace
    x, weight, bias = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    with precompiled.storing_in(tmp_path), torch.inference_mode(), caplog.at_level(logging.WARNING):
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
        first = compile_dynamic(normed)(x, weight, bias)
        assert precompiled.TALLY.counts.keys() == {precompiled.COMPILED}, precompiled.TALLY.counts
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())  # a restart: a new piece
        again = compile_dynamic(normed)(x, weight, bias)
        assert precompiled.TALLY.counts == {precompiled.LOADED: 1}, (precompiled.TALLY.counts, caplog.text)
    assert torch.equal(first, again) and torch.allclose(first, normed(x, weight, bias), atol=1e-5)


def test_a_loaded_variant_is_refused_when_its_global_changes(tmp_path: Path, monkeypatch):
    """The guards read the module's value at each call, not a copy taken at the load: a loaded
    variant that has run is refused once the float changes, and the call computes with the new
    value (here through torch.compile), never with the old one."""
    x, weight, bias = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    with precompiled.storing_in(tmp_path), torch.inference_mode():
        compile_dynamic(normed)(x, weight, bias)
        monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
        piece = compile_dynamic(normed)  # a restart: loads the variant
        piece(x, weight, bias)
        assert precompiled.TALLY.counts == {precompiled.LOADED: 1}, precompiled.TALLY.counts
        monkeypatch.setattr(sys.modules[__name__], "NORM_EPS", 10.0)
        changed = piece(x, weight, bias)
    expected = torch.nn.functional.layer_norm(x, (8,), weight, bias, 10.0) * 2
    assert torch.allclose(changed, expected, atol=1e-5), (changed - expected).abs().max()


class TwoPieces(torch.nn.Module):
    """Two compiled methods kept on their instance, as the quantizer keeps its encode and decode."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.scaled = self._scaled
        self.shifted = self._shifted

    def compile_pieces(self) -> None:
        self.scaled = compile_dynamic(self._scaled)
        self.shifted = compile_dynamic(self._shifted)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight * 2

    def _shifted(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + 1


def test_a_second_piece_kept_on_the_same_instance_is_precompiled_and_loads(tmp_path: Path, monkeypatch):
    """The second piece's guards pickle the instance with the first piece on it, which once
    could not be pickled: aot_compile refused it (the H200's quantizer decode fell back)."""
    model = TwoPieces()
    x = torch.randn(3, 4)
    with precompiled.storing_in(tmp_path), torch.inference_mode():
        for start in ("first", "restart"):
            monkeypatch.setattr(precompiled, "TALLY", precompiled.Tally())
            model.compile_pieces()
            assert torch.allclose(model.scaled(x), x @ model.weight * 2)
            assert torch.allclose(model.shifted(x), x @ model.weight + 1)
            expected = {precompiled.COMPILED if start == "first" else precompiled.LOADED: 2}
            assert precompiled.TALLY.counts == expected, (start, precompiled.TALLY.counts)
