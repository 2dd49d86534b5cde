"""Workgroup tiles per data-tiled matmul shape through an IREE tuning spec (`tuning_spec`, issue 32): the named shape's
`mmt4d` gets the spec's distribution in the configuration IREE dumps, another shape in the same module keeps IREE's
own, and the numbers are eager's."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

import fx_rewrites
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree import targets as t
from fx_rewrites.backends.iree.tuning_spec import FLAG, Mmt4dTiles, materialize, spec, spec_flag

pytestmark = pytest.mark.skipif(t.host_isa() == "", reason="AVX2 code runs on an x86-64 host with AVX2 and FMA")

#: the linear 1024 -> 1024 over 128 rows, packed for AVX2 (8x8x1 tiles): IREE's own distribution is [2, 4]
LINEAR = Mmt4dTiles("16x1024x8x1xf32", "128x1024x8x1xf32", (16, 4))
MMT4D = re.compile(
    r"linalg\.mmt4d \{lowering_config = #iree_cpu\.lowering_config<distribution = \[([\d, ]+)\].*?"
    r"ins\(%\w+, %\w+ : tensor<([^>]+)>, tensor<([^>]+)>\)"
)


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(1024, 1024)
        self.b = torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _configs(directory) -> dict[tuple[str, str], list[int]]:
    """(lhs, rhs) type -> distribution of every `mmt4d` in the dumped configurations."""
    found = {}
    for path in directory.glob("*.mlir"):
        for dist, lhs, rhs in MMT4D.findall(path.read_text()):
            found[(lhs, rhs)] = [int(d) for d in dist.split(",")]
    return found


def _compiled(tmp_path, flags, x, dynamic_shapes=None):
    torch.manual_seed(0)
    model = TwoLinears().eval()
    base = IreeBackend(target=t.llvm_cpu("avx2"), driver="local-sync", cache=CompileCache())
    dump = tmp_path / "configs"
    backend = attrs.evolve(
        base,
        perf_flags=(
            *(f for f in base.perf_flags if not f.startswith(FLAG)),
            *flags,
            f"--iree-hal-dump-executable-configurations-to={dump}",
        ),
    )
    program = torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes)
    rewritten = fx_rewrites.apply(program, backend.rules).program
    return model, backend.compile(rewritten, (x,)), _configs(dump)


def test_the_spec_sets_the_named_shape_and_leaves_the_others(tmp_path):
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(1))
    model, compiled, configs = _compiled(tmp_path, [spec_flag([LINEAR], tmp_path)], x)
    assert configs[(LINEAR.lhs, LINEAR.rhs)] == [16, 4, 0, 0, 0, 0]
    _, _, default = _compiled(tmp_path / "default", [], x)
    assert default[(LINEAR.lhs, LINEAR.rhs)] == [2, 4, 0, 0, 0, 0]  # IREE's own: the spec changed it
    others = {k: v for k, v in configs.items() if k != (LINEAR.lhs, LINEAR.rhs)}
    assert others and others == {k: v for k, v in default.items() if k in others}  # 1024 -> 256 as IREE sets it
    for seed in (1, 2):
        x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_dynamic_row_count_is_not_the_named_shape(tmp_path):
    """The spec names static sizes: a linear whose rows are a `Dim` keeps IREE's configuration, and computes right."""
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(1))
    rows = torch.export.Dim("rows", min=2, max=4096)
    model, compiled, configs = _compiled(tmp_path, [spec_flag([LINEAR], tmp_path)], x, ({0: rows},))
    _, _, default = _compiled(tmp_path / "default", [], x, ({0: rows},))
    assert configs == default and all(not lhs.startswith("16x") for lhs, _ in configs)
    for n in (128, 40):
        x = torch.randn(n, 1024, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_spec_file_is_named_by_its_text_and_written_when_needed(tmp_path):
    flag = spec_flag([LINEAR], tmp_path)
    assert flag == spec_flag([LINEAR], tmp_path) != spec_flag([attrs.evolve(LINEAR, distribution=(16, 8))], tmp_path)
    path = tmp_path / flag.split("=", 1)[1].rsplit("/", 1)[1]
    assert path.read_text() == spec([LINEAR]) and "tensor<16x1024x8x1xf32>" in path.read_text()
    path.unlink()  # a temporary directory cleaned since the flag was made
    materialize(["--iree-global-opt-data-tiling", flag])
    assert path.read_text() == spec([LINEAR])


def test_the_avx2_target_passes_its_table_as_a_spec():
    isa = t.CPU_ISAS["avx2"]
    flags = [f for f in t.llvm_cpu("avx2").perf_flags if f.startswith(FLAG)]
    assert flags == ([spec_flag(isa.mmt4d_tiles)] if isa.mmt4d_tiles else [])
    assert not any(f.startswith(FLAG) for f in t.llvm_cpu("avx512").perf_flags)
