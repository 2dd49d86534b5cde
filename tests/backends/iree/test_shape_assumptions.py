"""What the import tells IREE about dynamic sizes, and the promise it makes: an ExportedProgram's Dims reach
IREE as `torch.bind_symbolic_shape` on the function's arguments, which IREE 3.13's torch input pipeline
(`torch-iree-bind-symbolic-shapes`) makes `util.assume.int` (the range, and the divisor of a derived Dim such as
`8 * Dim("n")`). The module may compile on that promise, so a call that breaks it (a size that is not a
multiple, sizes of one symbol that disagree) is refused by the call convention before it reaches the module:
torch's own guards check only the range. Small compiles."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from fx_rewrites import apply, backends
from fx_rewrites.backends.convention import InputMismatch, size_form
from fx_rewrites.backends.iree import assumptions
from fx_rewrites.backends.iree.calling import MISS, fast_call
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules
from fx_rewrites.backends.iree.preparing import prepare_program


class Rows(torch.nn.Module):
    """Exponentials of a row's scores times values: the product's rows are the dynamic size."""

    def forward(self, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.exp(s - s.amax(-1, keepdim=True)) @ v


class Tied(torch.nn.Module):
    """One input of 8 * n rows, another of n: torch ties the two sizes."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 8, x.shape[-1]).sum(1) * y[:, None]


@pytest.fixture(autouse=True)
def _assume_shapes(monkeypatch):
    """The assumptions on (off by default: `assumptions.ASSUME_SHAPES`); a test may turn them off again."""
    monkeypatch.setattr(assumptions, "ASSUME_SHAPES", True)


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randn(32, 16, generator=g)


def _export(model: torch.nn.Module, args: tuple, shapes: tuple) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, dynamic_shapes=shapes)


def _eights() -> torch.export.ExportedProgram:
    return _export(Rows(), _rows(16), ({0: 8 * Dim("n", min=1, max=64)}, None))


def _input_phase(mlir: str) -> str:
    """`mlir` (torch dialect) after IREE's input pipeline, as text."""
    tools = iree_modules().compiler.tools
    out = tools.compile_str(mlir, input_type="torch", target_backends=["llvm-cpu"], extra_args=["--compile-to=input"])
    return out.decode() if isinstance(out, bytes) else out


def test_a_dim_multiple_of_8_reaches_iree_as_an_assumption_with_its_divisor():
    mlir = import_mlir(iree_modules(), prepare_program(_eights())[0])
    assert "torch.bind_symbolic_shape %arg0" in mlir and "s0 * 8" in mlir
    lowered = _input_phase(mlir)
    assert "util.assume.int" in lowered
    assert "umin = 8, umax = 512, udiv = 8" in lowered


def test_a_plain_dim_gives_its_range_only(monkeypatch):
    program = _export(Rows(), _rows(16), ({0: Dim("n", min=2, max=100)}, None))
    lowered = _input_phase(import_mlir(iree_modules(), prepare_program(program)[0]))
    assert "umin = 1, umax = 100>" in lowered  # IREE drops torch's min (1, not 2) and assumes no divisor
    assert "udiv" not in lowered
    monkeypatch.setattr(assumptions, "ASSUME_SHAPES", False)
    assert "bind_symbolic_shape" not in import_mlir(iree_modules(), prepare_program(_eights())[0])


@pytest.fixture(scope="module")
def eights():
    iree = backends.get("iree")
    program = apply(_eights(), iree.rules).program
    return iree.compile(program, _rows(16))


@pytest.mark.parametrize("n", [16, 40, 512])
def test_numerics_equal_eager_at_sizes_of_the_form(eights, n):
    s, v = _rows(n, seed=n)
    want = Rows()(s.double(), v.double())
    got = eights(s, v)
    # torch's own float32 error here, measured against float64, bounds the module's
    bound = float((Rows()(s, v).double() - want).abs().max())
    assert float((got.double() - want).abs().max()) <= 4 * max(bound, 1e-6)


@pytest.mark.parametrize("n", [12, 9, 511])
def test_a_size_not_a_multiple_is_refused_not_computed(eights, n):
    s, v = _rows(n)
    assert fast_call(eights.plan, eights.function)((s, v)) is MISS
    with pytest.raises(InputMismatch, match=rf"dim 0 \(8\*s\w+\) is {n}, not of that form \(a multiple of 8\)"):
        eights(s, v)
    with pytest.raises(InputMismatch, match="not of that form"):
        eights.call_bound(s, v)  # the general path: convention.bind


def test_a_size_past_the_range_is_refused(eights):
    with pytest.raises(InputMismatch, match=r"is 520, outside the range \[8, 512\]"):
        eights(*_rows(520))


def test_sizes_of_one_symbol_must_agree():
    iree = backends.get("iree")
    n = Dim("n", min=1, max=16)
    x, y = torch.randn(24, 4), torch.randn(3)
    compiled = iree.compile(apply(_export(Tied(), (x, y), ({0: 8 * n}, {0: n})), iree.rules).program, (x, y))
    torch.testing.assert_close(compiled(x, y), Tied()(x, y))
    x2, y2 = torch.randn(40, 4), torch.randn(5)
    torch.testing.assert_close(compiled(x2, y2), Tied()(x2, y2))
    with pytest.raises(InputMismatch, match=r"gives s\w+ = 3, and the program was exported with the two equal"):
        compiled(x, torch.randn(4))


@pytest.mark.parametrize(
    "expr, form",
    [
        ("s0", ("s0", 1, 0)),
        ("8*s68", ("s68", 8, 0)),
        ("4*s1 + 2", ("s1", 4, 2)),
        ("2*s0*s1", ("2*s0*s1", 2, 0)),
        ("s0 + s1", ("s0 + s1", 1, 0)),
        ("Max(2, s0)", ("Max(2, s0)", 1, 0)),
    ],
)
def test_size_form(expr, form):
    assert size_form(expr) == form
