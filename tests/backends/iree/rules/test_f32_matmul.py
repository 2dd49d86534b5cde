"""`linear_as_f32_dispatch` (backends/iree/rules/f32_matmul.py) and its kernel (backends/iree/f32_dispatch.py).

Real torch 2.13 exports of a linear (with and without a bias, over rows of rank 2 and 3, ViT's 788 rows, K in several
sums); the graph after (no linear: the weight laid out [N/S, K, S] by a view and permute, one `f32_linear` taking the
bias, or `f32_matmul` without one; S 16 for AVX2's rule, 32 for AVX-512's);
numerics as near float64 as torch's own float32 on two input sets; what it declines (a Dim on the rows: the kernel
is static; a weight passed in; N off 16; few rows; float64); the layout's round trip; the AVX2 route end to end on
IREE (the dispatch spliced and run) against float64, and
AVX-512's on an AVX-512 host. (Its speed: benchmarks/f32_dispatch.py, docs/performance.md.)
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.f32_dispatch import (
    F32_LINEAR,
    F32_MATMUL,
    LINEAR_MARK,
    MARK,
    PREFETCH,
    X_PAD,
    executable,
    pack,
    splice,
    unpack,
    x_columns,
)
from fx_rewrites.backends.iree.grouped_experts_dispatch import GROUPED_PACKED_MATMUL
from fx_rewrites.backends.iree.legality import SPLICED
from fx_rewrites.backends.iree.rules.f32_matmul import (
    linear_as_f32_dispatch,
    linear_as_f32_dispatch_avx512,
    linear_over_rows_as_grouped_dispatch_avx512,
)
from fx_rewrites.ruleset import RuleSet
from tests.backends.iree.rules.float32_error import assert_within_torch_error, in_float64

aten = torch.ops.aten


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(k: int, n: int, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(k, n, bias=bias).eval()


#: name -> (in, out, bias, x's shape)
CASES = {
    "matrix_bias": (64, 48, True, (70,)),
    "rank3_no_bias": (36, 32, False, (4, 20)),
    "vit_mlp": (32, 128, True, (4, 197)),
    # K 320: K blocks of 160 in sums of 80 (the bias in the first store, the later sums added to y); 90 rows: 15
    # blocks of 6, 7 blocks of 12 and 6 rows
    "deep_bias": (320, 64, True, (3, 30)),
    "wide_no_bias": (64, 96, False, (75,)),
    # K 512, N 1024: x's rows copied to a stride of 528 before the kernel (f32_dispatch.X_PAD: AVX-512's 16; through
    # IREE both ISAs' set to 16 here); 70 rows: 5 blocks of 12 and 10 rows, 11 blocks of 6 and 4
    "padded_rows": (512, 1024, True, (70,)),
}
#: the rule -> its strip (the op's tile: strip / 8)
STRIPS = {linear_as_f32_dispatch: 16, linear_as_f32_dispatch_avx512: 32}


@pytest.mark.parametrize("which", list(STRIPS), ids=lambda r: r.name)
@pytest.mark.parametrize("name", list(CASES))
def test_linear_as_f32_dispatch(name, which):
    k, n, bias, lead = CASES[name]
    strip = STRIPS[which]
    module = _linear(k, n, bias)
    inputs = [(_randn(0, *lead, k),), (3.0 * _randn(1, *lead, k),)]
    result = rt.apply_rules(rt.export(module, *inputs[0]), which)
    if n % strip:
        rt.assert_not_fired(result, which)
        return
    rt.assert_fired(result, which, times=1)
    op = F32_LINEAR if bias else F32_MATMUL
    absent = [aten.linear.default, aten.addmm.default, aten.mm.default, aten.add.Tensor, F32_LINEAR, F32_MATMUL]
    rt.assert_ops(result, absent=[a for a in absent if a is not op], present=[op])
    (call,) = [node for node in rt.graph_module(result).graph.nodes if node.target is op]
    x, packed, *rest = call.args
    assert tuple(x.meta["val"].shape) == (torch.Size(lead).numel(), k)
    assert tuple(packed.meta["val"].shape) == (n * k,) and rest[-3:] == [n, strip // 8, 4]
    assert not bias or tuple(rest[0].meta["val"].shape) == (n,), "the bias passed to the kernel"
    assert packed.target is aten.reshape.default and packed.args[0].target is aten.permute.default
    assert packed.args[0].args[0].meta["val"].shape[1:] == (strip, k)
    assert_within_torch_error(result.program.module(), in_float64(module), inputs)
    rt.assert_idempotent(result, which)


class WeightIn(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.linear(x, w)


def test_linear_as_f32_dispatch_declines():
    """A Dim on the rows (static: the same linear taken), a weight passed in, N off 16, K off 4, few rows, float64."""
    module, x = _linear(64, 48), _randn(0, 2, 40, 64)
    rt.assert_fired(rt.apply_rules(rt.export(module, x), linear_as_f32_dispatch), linear_as_f32_dispatch, times=1)
    ep = rt.export(module, x, dynamic_shapes=({0: Dim("batch", min=2, max=16)},))
    rt.assert_not_fired(rt.apply_rules(ep, linear_as_f32_dispatch), linear_as_f32_dispatch)
    cases = [
        (WeightIn(), (x, _randn(1, 48, 64))),
        (_linear(64, 40), (x,)),
        (_linear(62, 48), (_randn(0, 80, 62),)),
        (_linear(64, 48), (_randn(0, 8, 64),)),
        (_linear(64, 48).double(), (x.double(),)),
    ]
    for m, args in cases:
        rt.assert_not_fired(rt.apply_rules(rt.export(m, *args), linear_as_f32_dispatch), linear_as_f32_dispatch)


def test_layout_and_executable():
    """`pack` lays W out [N/16, K, 16] and `unpack` inverts it; the executable's name holds the shape and blocking,
    the op is named spliced; a module without the call is refused by `splice`."""
    w = _randn(0, 32, 8)
    packed = pack(w)
    assert torch.equal(packed.view(2, 8, 16)[1, 3], w[16:32, 3]) and torch.equal(unpack(packed, 32), w)
    assert torch.equal(unpack(pack(_randn(1, 64, 8), 32), 64, 32), _randn(1, 64, 8))
    name, text = executable(70, 48, 64, 2, 4)
    assert name in text and "vector<8xf32>" in text and "70x64x48" in name and "%bb" not in text
    name, text = executable(70, 64, 64, 4, 4, bias=True)
    assert "vector<16xf32>" in text and "r12x32" in name and "%bm[" in text and name.startswith("f32lin")
    with pytest.raises(ValueError, match="no register block has a strip of 48"):
        executable(70, 48, 64, 6, 4)
    assert {"fx_rewrites.f32_matmul.default", "fx_rewrites.f32_linear.default"} <= set(SPLICED)
    with pytest.raises(ValueError, match=r"no fx_rewrites\.f32_matmul call"):
        splice("module {\n}")
    assert (MARK, LINEAR_MARK) == ("torch.fx_rewrites.f32_matmul", "torch.fx_rewrites.f32_linear")


def test_x_rows_padded_where_k_is_a_multiple_of_512():
    """AVX-512's kernel reads x [M, K] with rows K + 16 floats apart where K is a multiple of 512 (rows 2-4 KiB apart
    share L1 sets) and N at least 1024 (the copy paid for N / 32 strips), copied there by a dispatch of its own;
    other K, fewer channels and AVX2's kernel (X_PAD 0) read x as it is."""
    assert X_PAD == {"avx2": 0, "avx512": 16}
    sizes = [(1024, 1024, 4), (512, 2048, 4), (320, 1024, 4), (1024, 256, 4), (1024, 1024, 2)]
    assert [x_columns(*size) for size in sizes] == [1040, 528, 320, 1024, 1024]
    name, text = executable(70, 1024, 1024, 4, 4)
    assert "_ld1040" in name and "memref<72800xf32>" in text  # x read as 70 rows of 1040
    assert "_ld1024" in executable(70, 256, 1024, 4, 4)[0]
    mlir = (
        "module {\n"
        "  func.func @main(%x: !torch.vtensor<[70,1024],f32>, %w: !torch.vtensor<[1048576],f32>) -> "
        "!torch.vtensor<[70,1024],f32> {\n"
        "    %n = torch.constant.int 1024\n    %t = torch.constant.int 4\n    %p = torch.constant.int 4\n"
        '    %y = torch.operator "torch.fx_rewrites.f32_matmul"(%x, %w, %n, %t, %p) : (!torch.vtensor<[70,1024],f32>, '
        "!torch.vtensor<[1048576],f32>, !torch.int, !torch.int, !torch.int) -> !torch.vtensor<[70,1024],f32>\n"
        "    return %y : !torch.vtensor<[70,1024],f32>\n  }\n}"
    )
    spliced = splice(mlir)
    assert spliced.count("stream.executable private @rows_70x1024_to_1040 ") == 1
    assert "(%fxfy_0) : (tensor<70x1024xf32>) -> tensor<70x1040xf32>" in spliced
    assert "(%fxfy_p, %fxfy_1) : (tensor<70x1040xf32>, tensor<1048576xf32>)" in spliced
    assert "rows_" not in splice(mlir.replace("%t = torch.constant.int 4", "%t = torch.constant.int 2"))
    with mock.patch.dict(X_PAD, {"avx512": 0}):
        assert "rows_" not in splice(mlir) and "_ld1024" in splice(mlir)


def test_the_next_weight_block_prefetched_on_avx512():
    """The row blocks of the first row chunk prefetch the weight one K block of a strip ahead into L2 (`PREFETCH`:
    one `memref.prefetch` in the K loop, before the step's loads; row block j AVX-512's line j % 8 of an unrolled
    step, AVX2's j % 4), named in the executable; the later chunks (from row 96), the remainder's block and
    PREFETCH 0 prefetch nothing."""
    assert PREFETCH == {8: 2, 16: 2}
    name, text = executable(70, 1024, 1024, 4, 4)
    assert name.endswith("_ld1040_pf2") and text.count("memref.prefetch") == 1
    assert "memref.prefetch %wm[%wpf], read, locality<2>, data : memref<1048576xf32>" in text
    assert text.index("memref.prefetch") < text.index("%b0_0 = vector.load %wm")
    assert "%pfd" not in text.split("%mt = ")[1]  # the 10 rows left over: none
    text = executable(200, 1024, 1024, 4, 4)[1]  # 16 blocks of 12 and 8 rows: the first 8 blocks prefetch
    assert text.count("memref.prefetch") == 1 and "scf.for %mb = %c0 to %c96w step %c12w {\n        %pfj = " in text
    assert "scf.for %mc = %c96w to %c192w step %c96w" in text
    assert "%pfl = arith.remui %pfj, %c8w" in text
    name, text = executable(70, 1024, 1024, 2, 4)
    assert name.endswith("_pf2") and text.count("memref.prefetch") == 1 and "%pfl = arith.remui %pfj, %c4w" in text
    with mock.patch.dict(PREFETCH, {8: 0, 16: 0}):
        assert "prefetch" not in executable(70, 1024, 1024, 2, 4)[1]
        name, text = executable(70, 1024, 1024, 4, 4)
        assert name.endswith("_ld1040") and "prefetch" not in text


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_prefetch_leaves_the_sums_as_they_were(isa):
    """The same product through each ISA's kernel with and without the prefetch: the same bits (the prefetch moves
    no sum), over 4 workgroups of 4 strips (8 of AVX2's), K in 2 blocks and 110 rows (the first chunk of 96 rows
    prefetching, 14 rows after it: AVX-512 a block of 12 and 2, AVX2 two blocks of 6 and 2)."""
    if targets.host_isa() not in ("avx512", isa):
        pytest.skip(f"llvm-cpu code for {isa} runs on such a host only")
    k, n, bias, lead = 512, 512, True, (110,)
    module, x = _linear(k, n, bias), _randn(0, *lead, k)
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    result = fx_rewrites.apply(rt.export(module, x), iree.rules)
    rt.assert_fired(result, linear_as_f32_dispatch_avx512 if isa == "avx512" else linear_as_f32_dispatch, times=1)
    program = result.program
    with_it = iree.compile(program, (x,))(x)
    with mock.patch.dict(PREFETCH, {8: 0, 16: 0}):
        without = IreeBackend(target=targets.llvm_cpu(isa)).compile(program, (x,))(x)
    assert torch.equal(with_it, without)
    assert (with_it - module(x)).abs().max() < 1e-4


def test_each_isa_takes_its_own_block():
    """AVX2 the 6x16 rule, AVX-512 the 12x32 one (each measured on its ISA), neither the other's."""
    assert linear_as_f32_dispatch.name in targets.CPU_ISAS["avx2"].perf_rules
    assert linear_as_f32_dispatch_avx512.name not in targets.CPU_ISAS["avx2"].perf_rules
    assert linear_as_f32_dispatch_avx512.name in targets.CPU_ISAS["avx512"].perf_rules
    assert linear_as_f32_dispatch.name not in targets.CPU_ISAS["avx512"].perf_rules


def _through_iree(name: str, isa: str, rule) -> None:
    """CASES[name] through `isa`'s route: `rule` fires once, the dispatch is spliced and run, and on two inputs the
    result is as near float64 as torch's float32, within a step (`padded_rows`: x's rows copied 16 floats apart)."""
    if name == "padded_rows":
        with mock.patch.dict(X_PAD, dict.fromkeys(X_PAD, 16)):
            return _compiled_and_checked(name, isa, rule)
    return _compiled_and_checked(name, isa, rule)


def _compiled_and_checked(name: str, isa: str, rule) -> None:
    k, n, bias, lead = CASES[name]
    module = _linear(k, n, bias)
    inputs = [(_randn(0, *lead, k),), (3.0 * _randn(1, *lead, k),)]
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    result = fx_rewrites.apply(rt.export(module, *inputs[0]), iree.rules)
    rt.assert_fired(result, rule, times=1)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, in_float64(module), inputs)


@pytest.mark.parametrize("name", ["matrix_bias", "vit_mlp", "deep_bias", "padded_rows"])
def test_linear_as_f32_dispatch_on_iree(name):
    """Through the AVX2 route (any AVX2 or AVX-512 host runs its code): the rule fires, the dispatch is spliced and
    run, and on two inputs the result is as near float64 as torch's float32, within a step (the rows a block of 6
    and a remainder: 70 = 11 x 6 + 4, 788 = 131 x 6 + 2)."""
    if targets.host_isa() == "":
        pytest.skip("llvm-cpu code for AVX2 runs on an x86-64 host with AVX2 only")
    _through_iree(name, "avx2", linear_as_f32_dispatch)


@pytest.mark.parametrize("name", ["vit_mlp", "deep_bias", "wide_no_bias", "padded_rows"])
def test_linear_as_f32_dispatch_avx512_on_iree(name):
    """AVX-512's 12x32 block through the AVX-512 route (an AVX-512 host only): the rule fires among AVX-512's rules,
    the dispatch is spliced and run, on two inputs as near float64 as torch's float32 (the rows 12-blocks and a
    remainder: 788 = 65 x 12 + 8, 90, 75, 70; K 512: x's rows copied to a stride of 528 first)."""
    if targets.host_isa() != "avx512":
        pytest.skip("llvm-cpu code for AVX-512 runs on an AVX-512 host only")
    _through_iree(name, "avx512", linear_as_f32_dispatch_avx512)


ROWS_RULE = linear_over_rows_as_grouped_dispatch_avx512
#: name -> (in, out, bias, x's shape, the Dim's axis): compile_lm's prefill [1, T, K], a matrix of rows
DIM_CASES = {"prefill_bias": (64, 96, True, (1, 37), 1), "deep_no_bias": (320, 64, False, (45,), 0)}


def _dim_export(name: str):
    k, n, bias, lead, axis = DIM_CASES[name]
    module = _linear(k, n, bias)
    other = list(lead)
    other[axis] = 13 if lead[axis] > 20 else 61
    inputs = [(_randn(0, *lead, k),), (3.0 * _randn(1, *other, k),)]
    return module, inputs, rt.export(module, *inputs[0], dynamic_shapes=({axis: Dim("rows", min=2, max=128)},))


@pytest.mark.parametrize("name", list(DIM_CASES))
def test_a_linear_over_a_dim_of_rows_takes_the_grouped_kernel(name):
    """AVX-512: a Dim on the rows (what `linear_as_f32_dispatch_avx512` declines) becomes the grouped kernel with one
    group: no linear left, one `grouped_packed_matmul`, a bias added after; eager-equal on two row counts."""
    module, inputs, ep = _dim_export(name)
    rt.assert_not_fired(rt.apply_rules(ep, linear_as_f32_dispatch_avx512), linear_as_f32_dispatch_avx512)
    result = rt.apply_rules(ep, ROWS_RULE)
    rt.assert_fired(result, ROWS_RULE, times=1)
    found = rt.targets(result)
    assert aten.linear.default not in found and found.count(GROUPED_PACKED_MATMUL) == 1
    assert (aten.add.Tensor in found) == DIM_CASES[name][2]
    rt.assert_matches_eager(result, module, inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, ROWS_RULE)
    # off by default: the prefill's packed copy beside the decode's weight (a module holds each projection twice)
    assert ROWS_RULE.name not in targets.CPU_ISAS["avx512"].perf_rules
    assert ROWS_RULE.name not in targets.CPU_ISAS["avx2"].perf_rules


def test_the_grouped_linear_declines():
    """Static rows (the 12x32 static kernel's), N off 32, K off 4, a weight passed in, float64."""
    x = _randn(0, 1, 40, 64)
    dim = ({1: Dim("rows", min=2, max=128)},)
    rt.assert_not_fired(rt.apply_rules(rt.export(_linear(64, 64), x), ROWS_RULE), ROWS_RULE)
    cases = [
        (_linear(64, 48), (x,), dim),
        (_linear(62, 64), (_randn(0, 1, 40, 62),), dim),
        (WeightIn(), (x, _randn(1, 64, 64)), ({1: Dim("rows", min=2, max=128)}, None)),
        (_linear(64, 64).double(), (x.double(),), dim),
    ]
    for m, args, shapes in cases:
        rt.assert_not_fired(rt.apply_rules(rt.export(m, *args, dynamic_shapes=shapes), ROWS_RULE), ROWS_RULE)


@pytest.mark.parametrize("name", list(DIM_CASES))
def test_the_grouped_linear_on_iree(name):
    """Through the AVX-512 route with the Dim (an AVX-512 host only): the rule fires, the kernel is spliced and run
    over two row counts (37 and 13: 3 blocks of 12 and 1, 1 block and 1; 45 and 61), as near float64 as torch."""
    if targets.host_isa() != "avx512":
        pytest.skip("llvm-cpu code for AVX-512 runs on an AVX-512 host only")
    module, inputs, ep = _dim_export(name)
    iree = IreeBackend(target=targets.llvm_cpu("avx512"))
    result = fx_rewrites.apply(ep, iree.rules | RuleSet([ROWS_RULE], name="the rule, off by default"))
    rt.assert_fired(result, ROWS_RULE, times=1)
    assert_within_torch_error(iree.compile(result.program, inputs[0]), in_float64(module), inputs)


class Stem(torch.nn.Module):
    """Whisper's audio stem: two 1-D convolutions of 3 taps (stride 1, then 2), a ReLU between them (Whisper's GELU
    comes out of the route 5.0e-7 from float64 against eager's 1.8e-7 here with or without the dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv1d(16, 32, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv1d(32, 32, kernel_size=3, stride=2, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_weight_seen_through_layout_ops(isa):
    """conv1d_as_matmul's linear, whose weight is the convolution's permuted and reshaped, takes the dispatch (IREE
    evaluates the layout of a weight the program holds once); a weight passed in stays declined through them, and
    conv_as_im2col_matmul's layout (a 4-D weight permuted); on the ISA's route the stem is as near float64 as torch's
    float32."""
    rule = linear_as_f32_dispatch if isa == "avx2" else linear_as_f32_dispatch_avx512
    inputs = [(_randn(0, 2, 16, 80),), (3.0 * _randn(1, 2, 16, 80),)]  # 2 x 80 rows, then 2 x 40
    iree = IreeBackend(target=targets.llvm_cpu(isa))
    result = fx_rewrites.apply(rt.export(Stem().eval(), *inputs[0]), iree.rules)
    rt.assert_fired(result, "conv1d_as_matmul", times=2)
    rt.assert_fired(result, rule, times=2)

    class Passed(torch.nn.Module):
        def forward(self, x, w):
            return torch.nn.functional.linear(x, w.permute(1, 0).reshape(48, 64))

    passed = rt.apply_rules(rt.export(Passed(), _randn(0, 80, 64), _randn(1, 64, 48)), rule)
    rt.assert_not_fired(passed, rule)

    class Im2colWeight(torch.nn.Module):  # conv_as_im2col_matmul's layout (a 4-D weight permuted): not measured
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(_randn(2, 32, 4, 2, 2))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.w.permute(0, 2, 3, 1).reshape(32, 16))

    im2col = rt.apply_rules(rt.export(Im2colWeight(), _randn(0, 80, 16)), rule)
    rt.assert_not_fired(im2col, rule)
    if isa not in {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(targets.host_isa(), []):
        return
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, in_float64(Stem().eval()), inputs)
