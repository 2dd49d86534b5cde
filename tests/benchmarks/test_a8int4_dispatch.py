"""benchmarks/a8int4_dispatch.py: the backend's int8 x int4 kernel (intrinsics) and its arith variant for LLVM's
pattern matching compile through IREE as hand-written modules and compute torchao's dequantized x times the int4
g32 weight within torch's own float32 error against float64; the bytes round-trip every value at every position."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

pytest.importorskip("torchao.quantization", reason="torchao is not installed")
from a8int4_dispatch import a8, a8_module, compile_mlir, generic, quantize_rows, run_vmfb  # noqa: E402

from tests.backends.iree.rules.float32_error import assert_within_torch_error  # noqa: E402


@pytest.mark.parametrize("tile", [1, 4])
def test_the_bytes_and_groups_unpack_to_the_weight(tile):
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (64, 256), dtype=torch.int8, generator=generator)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    q[1, 4:20] = torch.arange(-8, 8, dtype=torch.int8)
    s = torch.rand(64, 8, generator=generator)
    packed = a8.pack_bytes(q, tile)
    assert packed.dtype == torch.int8 and packed.numel() == 64 * 256 // 2  # two values a byte
    assert torch.equal(a8.unpack(packed, 64, tile), q)
    groups = a8.pack_groups(q, s, tile)
    assert torch.equal(a8.unpack_scales(groups, 64, tile), s)
    sums = groups.view(64 // (8 * tile), 8, 2, tile, 8)[:, :, 1].permute(0, 2, 3, 1).reshape(64, 8)
    assert torch.equal(sums, q.view(64, 8, 32).sum(-1).float())


@pytest.mark.parametrize(("n", "k", "tile"), [(256, 1024, 4), (32000, 1024, 4), (64, 2816, 1)])
def test_the_kernel_prefetches_each_line_of_a_group_ahead_within_the_bytes(n, k, tile):
    # the bytes of a group (128 tile bytes: 2 tile cache lines) PREFETCH bytes ahead, the index clamped to the
    # buffer's last group, so no prefetch reads past the bytes
    nbytes = n * k // 2
    text = a8.executable(1, n, k, tile, 8)
    consts = dict(re.findall(r"(%c\d+w) = arith.constant (\d+) : index", text))
    ahead = re.search(r"%pfa = arith.addi %wbase, (%c\d+w)", text)
    clamp = re.search(r"%pfb = arith.minui %pfa, (%c\d+w)", text)
    lines = [int(consts[c]) for c in re.findall(r"%pf\d+ = arith.addi %pfb, (%c\d+w)", text)]
    assert a8.PREFETCH == 16384 and a8.LINE == 64
    assert ahead and int(consts[ahead.group(1)]) == a8.PREFETCH
    assert clamp and int(consts[clamp.group(1)]) == nbytes - 128 * tile
    assert lines == list(range(0, 128 * tile, a8.LINE))
    assert text.count("memref.prefetch %wm[%pf") == len(lines) == 2 * tile
    assert text.count(f"read, locality<0>, data : memref<{nbytes}xi8>") == 2 * tile
    assert int(consts[clamp.group(1)]) + max(lines) + a8.LINE <= nbytes


def test_the_generic_form_has_no_intrinsic_calls():
    text = generic(a8.executable(1, 64, 128, 4, 8))
    assert "llvm.call_intrinsic" not in text and "arith.extui" in text
    assert "llvm.x86.avx2.pmadd.ub.sw" in a8.executable(1, 64, 128, 4, 8)


@pytest.mark.parametrize("form", ["intrinsic", "generic"])
def test_both_forms_compute_the_product_within_torchs_error(form, tmp_path):
    from cpu_isa import backend

    from fx_rewrites.backends.iree.targets import host_isa

    if host_isa() not in ("avx2", "avx512"):
        pytest.skip("the kernel's intrinsics are AVX2's")
    n, k = 256, 512
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator)
    s = torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3
    x = torch.randn(1, k, generator=generator) * 3 + 1  # an offset: zero points not 0
    assert int(quantize_rows(x)[2][0]) != 0
    wd = (q.view(n, -1, 32).double() * s.double().unsqueeze(-1)).view(n, k)

    def dequantized(x: torch.Tensor) -> torch.Tensor:
        qx, sx, zx = quantize_rows(x)
        return (qx.double() - zx.double().unsqueeze(1)) * sx.double().unsqueeze(1)

    vmfb = tmp_path / f"{form}.vmfb"
    compile_mlir(a8_module(1, n, k, 4, 8, form), [*backend("host").flags], vmfb, asm=False)
    words = [a8.pack_bytes(q, 4).numpy(), a8.pack_groups(q, s, 4).numpy()]

    def got(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(run_vmfb(vmfb, [t.numpy() for t in quantize_rows(x)] + words))

    # the kernel sums in another order than torch's: within the largest error torch makes at these shapes
    assert_within_torch_error(
        got,
        lambda x: dequantized(x).float() @ wd.float().t(),
        [(x,)],
        exact_of=lambda x: dequantized(x) @ wd.t(),
        redraws=16,
    )
