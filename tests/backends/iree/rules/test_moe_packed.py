"""MoE experts on AVX-512 through one packed copy of their weights (backends/iree/rules/moe_packed.py,
backends/iree/packed_experts.py): the prefill's products per expert as IREE's mmt4d over the packed strips, the
decode step's per row over the same tensor."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, grouped_experts_dispatch, packed_experts, targets
from fx_rewrites.backends.iree.rules import moe_packed
from fx_rewrites.backends.iree.rules.moe_packed import (
    packed_as_dispatch_for_iree,
    packed_as_dispatch_for_iree_avx2,
    packed_per_expert_for_iree,
    packed_per_row_for_iree,
)
from fx_rewrites.ruleset import Phases

pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback

aten = torch.ops.aten
PER_EXPERT, PER_ROW = "grouped_mm_packed_per_expert_for_iree", "grouped_mm_packed_per_row_for_iree"
AS_DISPATCH, AS_DISPATCH_AVX2 = "grouped_mm_packed_as_dispatch_for_iree", "grouped_mm_packed_as_dispatch_for_iree_avx2"
GROUPED = grouped_experts_dispatch.GROUPED_PACKED_MATMUL
avx512_host = pytest.mark.skipif(targets.host_isa() != "avx512", reason="AVX-512 code runs on an AVX-512 host")
avx2_host = pytest.mark.skipif(not targets.host_isa(), reason="AVX2 code runs on an AVX2 or AVX-512 host")


class Experts(torch.nn.Module):
    """The grouped matmul as transformers 5's MoE layers call it: rows sorted by expert, `offs` their ends; the
    weight stored [E, N, K] and passed transposed, as `_grouped_linear` does."""

    def __init__(self, experts: int = 4, k: int = 8, n: int = 32, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, generator=g, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight.transpose(-2, -1), offs) * 2.0


def _x(rows: int, seed: int, k: int = 8) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


def _reference(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The op's meaning in float64, written apart from the rules: row r belongs to the first expert whose end is
    past r; rows past the last end are 0."""
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        later = [e for e in range(len(offs)) if r < int(offs[e])]
        if later:
            out[r] = x[r].double() @ weight[later[0]].double().T
    return out * 2.0


def _within_torch_error(got: torch.Tensor, module: Experts, x: torch.Tensor, offs: torch.Tensor) -> None:
    reference = _reference(x, module.weight, offs)
    eager_error = (module(x, offs).double() - reference).abs().max().item()
    assert (got.double() - reference).abs().max().item() <= 4 * eager_error + 1e-6  # K=8 terms: ~1e-6


def _avx512() -> IreeBackend:
    return IreeBackend(target=targets.llvm_cpu("avx512"), driver="local-sync")


def _avx2() -> IreeBackend:
    return IreeBackend(target=targets.llvm_cpu("avx2"), driver="local-sync")


def test_the_rules_per_isa():
    """AVX-512: the dispatch with its block, the per-expert and per-row forms; AVX2: the dispatch with its own
    block alone, for the prefill and the decode step (the per-row form decoded at 0.86-1.00x eager there)."""
    assert {AS_DISPATCH, PER_EXPERT, PER_ROW} <= set(targets.CPU_ISAS["avx512"].first_rules)
    assert AS_DISPATCH_AVX2 not in targets.CPU_ISAS["avx512"].first_rules
    assert AS_DISPATCH_AVX2 in targets.CPU_ISAS["avx2"].first_rules
    assert not {AS_DISPATCH, PER_EXPERT, PER_ROW} & set(targets.CPU_ISAS["avx2"].first_rules)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_many_rows_take_one_packed_product_per_expert(dynamic):
    # 7 and 9 rows for 4 experts (over 4: the per-expert form); an expert without rows, a row past the last offset
    module = Experts()
    inputs = [(_x(7, 0), torch.tensor([2, 2, 5, 6])), (_x(9 if dynamic else 7, 1), torch.tensor([0, 4, 4, 7]))]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("rows", min=5)}, None) if dynamic else None)
    result = rt.apply_rules(ep, packed_per_expert_for_iree)
    rt.assert_fired(result, PER_EXPERT, times=1)
    found = rt.targets(result)
    assert found.count(packed_experts.PACKED_MATMUL) == 4 and aten.mm.default not in found
    assert aten.index.Tensor not in found, "a gather: a copy of the weights per row"
    assert found.count(aten.item.default) == 8  # the row ranges and the experts' indices, read at run time
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)
    rt.assert_idempotent(result, packed_per_expert_for_iree)


def test_few_static_rows_take_a_product_per_row_over_the_same_layout():
    # a decode step: 3 rows (batch 1 x top 3) for 4 experts; one expert unused, a row past the last offset
    module = Experts()
    inputs = [(_x(3, 0), torch.tensor([1, 1, 2, 2])), (_x(3, 1), torch.tensor([0, 1, 2, 3]))]
    result = rt.apply_rules(rt.export(module, *inputs[0]), packed_per_expert_for_iree, packed_per_row_for_iree)
    rt.assert_fired(result, PER_ROW, times=1)
    rt.assert_not_fired(result, PER_EXPERT)
    found = rt.targets(result)
    assert aten.mm.default not in found and found.count(packed_experts.PACKED_MATMUL) == 3  # one a row
    assert found.count(aten.item.default) == 3
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "module, why",
    [
        (Experts(n=24), "not a multiple of 16"),
        (Experts(dtype=torch.float64), "float32"),
    ],
    ids=["n24", "float64"],
)
def test_declined(module, why):
    ep = rt.export(module, _x(7, 0).to(module.weight.dtype), torch.tensor([2, 2, 5, 6]))
    result = rt.apply_rules(ep, packed_per_expert_for_iree, packed_per_row_for_iree)
    rt.assert_not_fired(result, PER_EXPERT)
    rt.assert_not_fired(result, PER_ROW)
    node = next(n for n in ep.graph.nodes if "grouped_mm" in str(n.target))
    assert why in str(moe_packed._many_rows(node))


def test_a_weight_stored_k_major_is_declined():
    class StoredKN(Experts):
        def forward(self, x, offs):  # the [E, N, K] parameter read as [E, K, N] by a reshape: K not contiguous
            return torch.ops.transformers.grouped_mm_fallback(x, self.weight.reshape(4, 8, 32), offs)

    module = StoredKN()
    result = rt.apply_rules(rt.export(module, _x(7, 0), torch.tensor([2, 2, 5, 6])), packed_per_expert_for_iree)
    rt.assert_not_fired(result, PER_EXPERT)


def _moe_py_route() -> IreeBackend:
    """The AVX-512 backend without these rules: moe.py's per-expert form, IREE's data tiling packing the experts."""
    sets = [
        s.without(AS_DISPATCH, PER_EXPERT, PER_ROW) if PER_EXPERT in {r.name for r in s.rules} else s
        for s in _avx512().rules.sets
    ]
    return IreeBackend(target=targets.llvm_cpu("avx512"), driver="local-sync", rules=Phases(*sets))


@avx512_host
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("k", [8, 64])
def test_through_iree_on_avx512(dynamic, k):
    """Both forms through the AVX-512 backend's rules (the mmt4d spliced: 16-row tiles, and one row's narrow tile),
    on two inputs each: equal bit for bit to moe.py's form through IREE (the data-tiled product over the same tiles,
    K summed in the same order); at K 8 as near float64 as torch's float32 (at K 64 IREE's sums in K order, in both
    forms, read 5x torch's blocked ones)."""
    module = Experts(k=k, n=48)
    many = [(_x(21, 0, k), torch.tensor([5, 5, 18, 20]))]
    many.append((_x(40 if dynamic else 21, 1, k), torch.tensor([0, 9, 9, 17])))
    few = [(_x(3, 2, k), torch.tensor([1, 1, 2, 2])), (_x(3, 3, k), torch.tensor([0, 1, 3, 3]))]
    shapes = ({0: Dim("rows", min=5)}, None) if dynamic else None
    for inputs, rule, ep in ((many, PER_EXPERT, rt.export(module, *many[0], dynamic_shapes=shapes)),
                             (few, PER_ROW, rt.export(module, *few[0]))):  # fmt: skip
        result = fx_rewrites.apply(ep, _avx512().rules)
        rt.assert_fired(result, rule, times=1)
        compiled = _avx512().compile(result.program, inputs[0])
        before = _moe_py_route()
        compiled_before = before.compile(fx_rewrites.apply(ep, before.rules).program, inputs[0])
        for args in inputs:
            got = compiled(*args)
            assert torch.equal(got, compiled_before(*args))
            if k == 8:
                _within_torch_error(got, module, *args)


def test_the_splice_writes_irees_pack_mmt4d_and_unpack():
    line = (
        '    %5 = torch.operator "torch.fx_rewrites.packed_matmul"(%3, %4) : (!torch.vtensor<[?,64],f32>, '
        "!torch.vtensor<[3,64,16],f32>) -> !torch.vtensor<[?,48],f32>"
    )
    text = packed_experts.splice(f"module {{\n{line}\n}}")
    assert "torch.operator" not in text
    assert "linalg.mmt4d ins(%pmm5_w4, %pmm5_l : tensor<3x64x16x1xf32>, tensor<?x64x16x1xf32>)" in text
    assert "linalg.unpack %pmm5_p outer_dims_perm = [1, 0]" in text
    one_row = line.replace("[?,64]", "[1,64]").replace("[?,48]", "[1,48]")  # a decode step's row: the narrow tile
    text = packed_experts.splice(f"module {{\n{one_row}\n}}")
    assert "linalg.mmt4d ins(%pmm5_l, %pmm5_w4 : tensor<1x64x1x1xf32>, tensor<3x64x16x1xf32>)" in text
    with pytest.raises(ValueError, match="no packed_matmul call"):
        packed_experts.splice("module {\n}")
    assert moe_packed.PER_ROW_LIMIT == 1.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_many_rows_take_one_grouped_dispatch(dynamic, isa):
    # 7 and 9 rows for 4 experts, N 64 (two pairs of strips); an expert without rows, a row past the last offset
    module = Experts(n=64)
    inputs = [(_x(7, 0), torch.tensor([2, 2, 5, 6])), (_x(9 if dynamic else 7, 1), torch.tensor([0, 4, 4, 7]))]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("rows", min=5)}, None) if dynamic else None)
    rule, name = (packed_as_dispatch_for_iree, AS_DISPATCH) if isa == "avx512" else (
        packed_as_dispatch_for_iree_avx2, AS_DISPATCH_AVX2)  # fmt: skip
    result = rt.apply_rules(ep, rule, packed_per_expert_for_iree, packed_per_row_for_iree)
    rt.assert_fired(result, name, times=1)
    rt.assert_not_fired(result, PER_EXPERT)
    found = rt.targets(result)
    assert found.count(GROUPED) == 1 and packed_experts.PACKED_MATMUL not in found and aten.mm.default not in found
    (call,) = (n for n in result.graph_module.graph.nodes if n.target == GROUPED)
    assert call.args[3] == {"avx512": 4, "avx2": 2}[isa]  # the ISA's register block
    assert aten.item.default not in found and aten.index.Tensor not in found  # no host reads, no gathered weights
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)
    rt.assert_idempotent(result, rule)


def test_sizes_off_the_dispatch_s_block_take_the_per_expert_form():
    module = Experts(n=48)  # a multiple of 16 (the packed layout and AVX2's block), not of 32 (AVX-512's block)
    ep = rt.export(module, _x(7, 0), torch.tensor([2, 2, 5, 6]))
    result = rt.apply_rules(ep, packed_as_dispatch_for_iree, packed_per_expert_for_iree)
    rt.assert_not_fired(result, AS_DISPATCH)
    rt.assert_fired(result, PER_EXPERT, times=1)
    node = next(n for n in ep.graph.nodes if "grouped_mm" in str(n.target))
    assert "not a multiple of the dispatch's 32" in str(moe_packed._many_rows_in_pairs(node))
    rt.assert_fired(rt.apply_rules(ep, packed_as_dispatch_for_iree_avx2), AS_DISPATCH_AVX2, times=1)
    odd_k = Experts(k=6, n=32)  # K steps unrolled by 4
    ep = rt.export(odd_k, _x(7, 0, 6), torch.tensor([2, 2, 5, 6]))
    for rule, name in (
        (packed_as_dispatch_for_iree, AS_DISPATCH),
        (packed_as_dispatch_for_iree_avx2, AS_DISPATCH_AVX2),
    ):
        result = rt.apply_rules(ep, rule, packed_per_expert_for_iree)
        rt.assert_not_fired(result, name)
        rt.assert_fired(result, PER_EXPERT, times=1)


def test_the_op_s_eager_meaning():
    x, packed_w = _x(9, 0), packed_experts.pack(Experts(n=32).weight)
    ends = torch.tensor([3, 3, 7, 20], dtype=torch.int32)  # an expert without rows; the last end past the rows
    got = grouped_experts_dispatch.grouped_packed_matmul(x, packed_w, ends, 4)
    assert torch.equal(got, grouped_experts_dispatch.grouped_packed_matmul(x, packed_w, ends, 2))
    with pytest.raises(ValueError, match="no register block"):
        grouped_experts_dispatch.grouped_packed_matmul(x, packed_w, ends, 3)
    weight = Experts(n=32).weight
    assert torch.equal(got[:3], x[:3] @ weight[0].t()) and torch.equal(got[3:7], x[3:7] @ weight[2].t())
    assert torch.equal(got[7:], x[7:] @ weight[3].t())


def _splice_line(tile: str = "%int4") -> str:
    return (
        "    %int4 = torch.constant.int 4\n    %int2 = torch.constant.int 2\n"
        f'    %7 = torch.operator "torch.fx_rewrites.grouped_packed_matmul"(%3, %4, %5, {tile}) : '
        "(!torch.vtensor<[?,64],f32>, !torch.vtensor<[4,10,64,16],f32>, !torch.vtensor<[4],si32>, !torch.int) "
        "-> !torch.vtensor<[?,160],f32>"
    )


def test_the_splice_writes_one_dispatch_over_experts_and_strips():
    line = _splice_line()
    text = grouped_experts_dispatch.splice(f"module {{\n{line}\n}}")
    assert "torch.operator" not in text
    assert "%gpmm7_n = arith.constant 8 : index" in text  # 4 experts x ceil(5 pairs / 4 a workgroup)
    assert "tensor<?x64xf32>{%gpmm7_r}, tensor<4x10x64x16xf32>, tensor<4xi32>, index) -> tensor<?x160xf32>" in text
    assert "stream.executable private @gpmm_e4_64x160_r12x32_p4" in text and "scf.index_switch %tail" in text
    assert "vector<16xf32>" in text and "vector<8xf32>" not in text
    # AVX2's block: 6 x 16 channels (one strip, two ymm of 8), 8 strips a workgroup (128 channels)
    text = grouped_experts_dispatch.splice(f"module {{\n{_splice_line('%int2')}\n}}")
    assert "%gpmm7_n = arith.constant 8 : index" in text  # 4 experts x ceil(10 strips / 8 a workgroup)
    assert "stream.executable private @gpmm_e4_64x160_r6x16_p8" in text
    assert "vector<8xf32>" in text and "vector<16xf32>" not in text and "case 5 {" in text and "case 6 {" not in text
    with pytest.raises(ValueError, match="operands"):
        grouped_experts_dispatch.splice(f"module {{\n{line.replace('16],f32', '8],f32')}\n}}")
    with pytest.raises(ValueError, match="not a constant"):
        grouped_experts_dispatch.splice(f"module {{\n{_splice_line('%arg9')}\n}}")
    with pytest.raises(ValueError, match="no grouped_packed_matmul call"):
        grouped_experts_dispatch.splice("module {\n}")


@pytest.mark.parametrize("isa", [pytest.param("avx512", marks=avx512_host), pytest.param("avx2", marks=avx2_host)])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("k, n", [(8, 64), (512, 160)])
def test_the_grouped_dispatch_through_iree(dynamic, k, n, isa):
    """The dispatch through each ISA's backend rules (AVX-512's 12 x 32 block, AVX2's 6 x 16) on two inputs each
    (an expert without rows, ranges with and without a tail of fewer than the block's rows, rows past the last
    offset, K in blocks at 512, a workgroup's partial strips at 160): as near float64 as torch's float32."""
    module = Experts(k=k, n=n)
    many = [
        (_x(37, 0, k), torch.tensor([5, 5, 30, 36])),
        (_x(61 if dynamic else 37, 1, k), torch.tensor([0, 13, 13, 37])),
    ]
    shapes = ({0: Dim("rows", min=5)}, None) if dynamic else None
    backend = _avx512() if isa == "avx512" else _avx2()
    result = fx_rewrites.apply(rt.export(module, *many[0], dynamic_shapes=shapes), backend.rules)
    rt.assert_fired(result, AS_DISPATCH if isa == "avx512" else AS_DISPATCH_AVX2, times=1)
    rt.assert_not_fired(result, PER_EXPERT)
    compiled = backend.compile(result.program, many[0])
    for args in many:
        got = compiled(*args)
        assert torch.equal(got[args[1][-1] :], torch.zeros_like(got[args[1][-1] :]))
        _within_torch_error(got, module, *args)


def test_few_static_rows_take_the_dispatch_on_avx2():
    """AVX2's rule takes a decode step's few static rows too (AVX-512's leaves them to the per-row form)."""
    module = Experts(n=32)
    ep = rt.export(module, _x(3, 0), torch.tensor([1, 1, 2, 2]))
    result = rt.apply_rules(ep, packed_as_dispatch_for_iree, packed_as_dispatch_for_iree_avx2, packed_per_row_for_iree)
    rt.assert_fired(result, AS_DISPATCH_AVX2, times=1)
    rt.assert_not_fired(result, AS_DISPATCH)
    rt.assert_not_fired(result, PER_ROW)


@avx2_host
@pytest.mark.parametrize("k", [8, 512])
def test_the_decode_s_rows_through_the_dispatch_on_avx2(k):
    """AVX2: a decode step's 3 static rows (batch 1 x top 3) through the AVX2 backend's rules take the grouped
    dispatch, as the prefill does (one packed tensor); two input sets (an expert unused, a row past the last
    offset): rows past the last offset 0, as near float64 as torch's float32."""
    module = Experts(k=k, n=48)
    few = [(_x(3, 2, k), torch.tensor([1, 1, 2, 2])), (_x(3, 3, k), torch.tensor([0, 1, 3, 3]))]
    result = fx_rewrites.apply(rt.export(module, *few[0]), _avx2().rules)
    rt.assert_fired(result, AS_DISPATCH_AVX2, times=1)
    found = rt.targets(result)
    assert found.count(GROUPED) == 1 and packed_experts.PACKED_MATMUL not in found and aten.mm.default not in found
    compiled = _avx2().compile(result.program, few[0])
    for args in few:
        got = compiled(*args)
        assert torch.equal(got[args[1][-1] :], torch.zeros_like(got[args[1][-1] :]))
        _within_torch_error(got, module, *args)
