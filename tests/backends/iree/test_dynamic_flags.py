"""Flags for modules with a dynamic size (`IreeTarget.dynamic_flags`, `IreeBackend.perf_flags_for`): on AVX2 a
module with a Dim (or a size read at run time) has its vector loops over dynamic sizes peeled instead of masked
(IREE 3.13 masks each vector with `vmaskmovps`, slow on Zen 3; docs/iree-3.13-findings.md); a static module's
flags are the ISA's as before. Small compiles (AVX2 code runs on any AVX2 host)."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree import targets as t
from fx_rewrites.backends.iree.cache import cache_key
from tests.backends.iree.rules.float32_error import assert_within_torch_error
from tests.backends.iree.test_cpu_isas import X86

PEEL = "--iree-llvmcpu-vector-pproc-strategy=peel"


class Exponentials(torch.nn.Module):
    """A block of attention's exponentials, keys x rows with the rows (dynamic) innermost, summed with values."""

    def forward(self, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        weights = torch.exp(s - s.amax(1, keepdim=True))
        return v.transpose(-2, -1) @ weights / weights.sum(1, keepdim=True)


def _inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 24, rows, generator=g) * 3, torch.randn(2, 24, 16, generator=g)


def _backend() -> IreeBackend:
    return IreeBackend(target=t.llvm_cpu("avx2"), driver="local-sync", cache=CompileCache())


def test_only_avx2_takes_the_dynamic_flags():
    assert t.CPU_ISAS["avx2"].dynamic_flags == (PEEL,)
    assert t.CPU_ISAS["avx512"].dynamic_flags == ()
    assert t.llvm_cpu("avx2").dynamic_flags == (PEEL,)
    assert t.llvm_cpu("avx512").dynamic_flags == ()
    assert PEEL not in t.llvm_cpu("avx2").perf_flags  # not for static modules


@pytest.mark.skipif(not (X86 and t.host_isa() in ("avx2", "avx512")), reason="AVX2 code runs on an AVX2 x86 host")
@pytest.mark.parametrize("dynamic", [True, False], ids=["dim", "static"])
def test_a_module_with_a_dim_is_peeled_and_matches_eager(dynamic):
    backend = _backend()
    shapes = ({2: Dim("rows", min=2, max=512)}, None) if dynamic else None
    program = torch.export.export(Exponentials(), _inputs(37, 0), dynamic_shapes=shapes)
    fn = backend.compile(fx_rewrites.apply(program, backend.rules).program, _inputs(37, 0))
    flags = backend.perf_flags_for(fn.mlir)
    assert (PEEL in flags) is dynamic
    assert flags[: len(backend.perf_flags)] == backend.perf_flags
    # the flags the module was compiled with are in its cache key: the peeled module is not a masked one's entry
    assert fn.key == cache_key(fn.mlir, (backend.target.name, *backend.flags, *flags))
    without = attrs.evolve(backend, target=attrs.evolve(backend.target, dynamic_flags=()))
    assert without.perf_flags_for(fn.mlir) == backend.perf_flags
    inputs = [_inputs(37, 0), _inputs(64, 1)] if dynamic else [_inputs(37, 0), _inputs(37, 1)]
    assert_within_torch_error(fn, Exponentials(), inputs)


def test_no_dynamic_flags_without_performance_flags():
    """The retry without performance flags (a module IREE rejects with them) drops the dynamic ones too."""
    backend = attrs.evolve(_backend(), perf_flags=())
    assert backend.perf_flags_for("func.func @main(%arg0: !torch.vtensor<[2,?],f32>)") == ()
    assert _backend().perf_flags_for("func.func @main(%arg0: !torch.vtensor<[2,?],f32>)")[-1] == PEEL
    assert _backend().perf_flags_for("func.func @main(%arg0: !torch.vtensor<[2,3],f32>)") == _backend().perf_flags
