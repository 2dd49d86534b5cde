"""float8 and bfloat16 weights are IREE parameters whatever their size (backends/iree/parameters.py,
NEVER_INLINE): inline, IREE 3.13 fails on a float8 one over 256 bytes ("unhandled float element bit width 8")
and on a small bfloat16 one ("'arith.constant' op failed to verify that all of {value, result} have same
type"). Each case is first compiled with the weights inline (`is_parameter` as it was) to show IREE's failure,
so the test fails once IREE compiles them inline (then NEVER_INLINE can go)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeCompileError, IreeUnsupportedError, parameters


class Weighted(torch.nn.Module):
    """x @ w.float().t() + b.float(), w [n, k] and b [n] held in `dtype`."""

    def __init__(self, n: int, k: int, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", (torch.randn(n, k, generator=g) * 4).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))

    def forward(self, x):
        return x @ self.w.float().t() + self.b.float()


CASES = {
    # name: (n, k, dtype, IREE's error with the weights inline)
    "float8_e4m3fn-16x24": (16, 24, torch.float8_e4m3fn, "unhandled float element bit width 8"),
    "float8_e5m2-32x32": (32, 32, torch.float8_e5m2, "unhandled float element bit width 8"),
    "bfloat16-8x8": (8, 8, torch.bfloat16, "all of {value, result} have same type"),
}


def _inline_as_before(tensor: torch.Tensor, limit: int) -> bool:
    return tensor.numel() > 1 and tensor.dtype != torch.bool and parameters.nbytes(tensor) >= limit


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("name", list(CASES))
def test_narrow_float_weights_compile_as_parameters(name, dynamic, monkeypatch):
    n, k, dtype, inline_error = CASES[name]
    module = Weighted(n, k, dtype).eval()
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(3, k, generator=g),), (torch.randn(5 if dynamic else 3, k, generator=g),)]
    ep = rt.export(module, *inputs[0], dynamic_shapes=[{0: Dim("m")}] if dynamic else None)
    iree = backends.get("iree")
    program = rt.apply_rules(ep, iree.rules).program
    with monkeypatch.context() as patched:
        patched.setattr(parameters, "is_parameter", _inline_as_before)
        with pytest.raises(IreeCompileError, match=inline_error):
            iree.compile(program, inputs[0])
    compiled = iree.compile(program, inputs[0])
    for (x,) in inputs:
        # the same float32 ops on the same widened weights, in another summation order
        torch.testing.assert_close(compiled(x), module(x), rtol=4 * torch.finfo().eps, atol=4 * torch.finfo().eps * k)


def test_float8_weights_save_beside_the_module_and_refuse_inside(tmp_path):
    """Saved with params=, the float8 weights go to the .irpa and load back; a self-contained .vmfb would embed
    them, which IREE 3.13 cannot compile: a named error with the fix."""
    module = Weighted(16, 24, torch.float8_e4m3fn).eval()
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(2))
    compiled = fx_rewrites.compile(module, (x,))
    compiled.save(tmp_path / "m.vmfb", params=tmp_path / "m.irpa")
    loaded = fx_rewrites.load(tmp_path / "m.vmfb", params=tmp_path / "m.irpa")
    assert torch.equal(loaded(x), compiled(x))
    with pytest.raises(IreeUnsupportedError, match=r"float8 weights \(b, w\).*fix: save the weights beside it"):
        compiled.save(tmp_path / "inside.vmfb")
