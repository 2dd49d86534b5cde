"""transformers' grouped matmul of MoE experts on IREE (backends/iree/rules/moe.py): each expert's weight read in
place, never a gathered copy per row."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.rules import moe as moe_rules
from fx_rewrites.backends.iree.rules.moe import per_expert_for_iree, per_row_for_iree
from tests import lm_models

moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback

aten = torch.ops.aten
PER_EXPERT, PER_ROW = "grouped_mm_per_expert_for_iree", "grouped_mm_per_row_for_iree"
PACKED_EXPERT, PACKED_ROW = "grouped_mm_packed_per_expert_for_iree", "grouped_mm_packed_per_row_for_iree"
PACKED_DISPATCH = "grouped_mm_packed_as_dispatch_for_iree"
PACKED_DISPATCH_AVX2 = "grouped_mm_packed_as_dispatch_for_iree_avx2"


def _lm_forms(pairs: bool = False) -> tuple[str, str]:
    """The rules compile_lm's prefill and decode experts take on the default backend's ISA: the packed forms
    (rules/moe_packed.py, float32 and N a multiple of 16): on AVX-512 the prefill's as one grouped dispatch where
    every product's N is a multiple of 32 (`pairs`), else per expert, the decode's per row; on AVX2 the grouped
    dispatch (its block's 16 channels) in both. Another ISA: moe.py's per-expert form in both."""
    isa = backends.get("iree").target.isa
    if isa == "avx512":
        return PACKED_DISPATCH if pairs else PACKED_EXPERT, PACKED_ROW
    if isa == "avx2":
        return PACKED_DISPATCH_AVX2, PACKED_DISPATCH_AVX2
    return PER_EXPERT, PER_EXPERT


class Experts(torch.nn.Module):
    """The grouped matmul as transformers 5's MoE layers call it: rows sorted by expert, offs their ends; the
    weight stored [E, N, K] and passed transposed, as `_grouped_linear` does."""

    def __init__(self, experts: int = 3, k: int = 4, n: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, generator=g), requires_grad=False)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight.transpose(-2, -1), offs) * 2.0


@pytest.fixture
def per_row(monkeypatch):
    """The per-row form on for static rows up to the number of experts (off by default: `PER_ROW_LIMIT` 0)."""
    monkeypatch.setattr(moe_rules, "PER_ROW_LIMIT", 1.0)


def _x(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed))


def _reference(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The op's meaning in float64, written independently of the rules: row r belongs to the first expert whose
    end is past r; rows past the last end are 0."""
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        later = [e for e in range(len(offs)) if r < int(offs[e])]
        if later:
            out[r] = x[r].double() @ weight[later[0]].double().T
    return out * 2.0


def _close_to_reference(got: torch.Tensor, module: Experts, x: torch.Tensor, offs: torch.Tensor) -> None:
    reference = _reference(x, module.weight, offs)
    eager_error = (module(x, offs).double() - reference).abs().max().item()
    # within a few times torch's own float32 error (K=4 terms: ~1e-6)
    assert (got.double() - reference).abs().max().item() <= 4 * eager_error + 1e-6


def _rewritten(ep, rule):
    result = rt.apply_rules(ep, rule)
    assert not any("grouped_mm" in str(t) for t in rt.targets(result))
    assert aten.index.Tensor not in rt.targets(result), "a gather: a copy of the weights per row"
    return result


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_grouped_mm_becomes_one_matmul_per_expert(dynamic):
    # 7 and 9 rows for 3 experts: the per-expert form; an expert with no rows, a row past the last offset (0)
    module = Experts()
    inputs = [(_x(7, 0), torch.tensor([2, 2, 6])), (_x(9 if dynamic else 7, 1), torch.tensor([0, 4, 7]))]
    ep = rt.export(module, *inputs[0], dynamic_shapes=({0: Dim("rows", min=4)}, None) if dynamic else None)
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="grouped_mm_fallback"):
        iree.compile(ep, inputs[0])
    result = _rewritten(ep, per_expert_for_iree)
    rt.assert_fired(result, PER_EXPERT, times=1)
    assert rt.targets(result).count(aten.mm.default) == 3  # one per expert, each weight selected in place
    assert rt.targets(result).count(aten.item.default) == 3  # the row ranges, read at run time
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)
    rt.assert_idempotent(result, per_expert_for_iree)
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        _close_to_reference(compiled(*args), module, *args)


def test_grouped_mm_with_few_static_rows_becomes_a_product_per_row(per_row):
    # decode: 3 rows (batch 1 x top 3) for 4 experts; one expert unused, and a row past the last offset
    module = Experts(experts=4)
    inputs = [(_x(3, 0), torch.tensor([1, 1, 2, 2])), (_x(3, 1), torch.tensor([0, 1, 2, 3]))]
    ep = rt.export(module, *inputs[0])
    result = _rewritten(ep, per_row_for_iree)
    rt.assert_fired(result, PER_ROW, times=1)
    assert aten.mm.default not in rt.targets(result) and rt.targets(result).count(aten.item.default) == 3
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)
    iree = backends.get("iree")
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        _close_to_reference(compiled(*args), module, *args)


class ExpertsStoredKN(torch.nn.Module):
    """The grouped matmul over a weight stored [E, K, N] and passed as is (N contiguous)."""

    def __init__(self, experts: int = 4, k: int = 4, n: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.weight = torch.nn.Parameter(torch.randn(experts, k, n, generator=g), requires_grad=False)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, offs) * 2.0


@pytest.mark.parametrize("stored", ["NK", "KN"])
def test_products_per_row_sum_along_the_dimension_the_weight_holds_contiguously(stored, per_row):
    """transformers stores [E, N, K] and passes the transpose: the sum runs over K as the last dimension of the
    stored [N, K] slice (over [K, N] as the outer dimension IREE read the weight strided, 2.3-4.3x slower); a
    weight stored [E, K, N] keeps the sum over its first dimension."""
    module = Experts(experts=4) if stored == "NK" else ExpertsStoredKN()
    inputs = [(_x(3, 0), torch.tensor([1, 1, 2, 2])), (_x(3, 1), torch.tensor([0, 1, 2, 3]))]
    ep = rt.export(module, *inputs[0])
    result = _rewritten(ep, per_row_for_iree)
    rt.assert_fired(result, PER_ROW, times=1)
    sums = [
        n
        for n in result.program.graph.nodes
        if n.target == aten.sum.dim_IntList and n.meta["val"].dtype.is_floating_point
    ]
    assert len(sums) == 3 and {tuple(n.args[1]) for n in sums} == ({(1,)} if stored == "NK" else {(0,)})
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)
    compiled = backends.get("iree").compile(rt.apply_rules(ep, backends.get("iree").rules).program, inputs[0])
    weight_nk = module.weight if stored == "NK" else module.weight.transpose(1, 2)
    for x, offs in inputs:
        reference = _reference(x, weight_nk, offs)
        eager_error = (module(x, offs).double() - reference).abs().max().item()
        assert (compiled(x, offs).double() - reference).abs().max().item() <= 4 * eager_error + 1e-6


def test_each_form_declines_the_other_ones_rows(per_row):
    few = rt.apply_rules(rt.export(Experts(experts=4), _x(3, 0), torch.tensor([1, 1, 2, 3])), per_expert_for_iree)
    many = rt.apply_rules(rt.export(Experts(), _x(7, 0), torch.tensor([2, 2, 6])), per_row_for_iree, explain=True)
    rt.assert_not_fired(few, PER_EXPERT)
    rt.assert_not_fired(many, PER_ROW)
    (attempt,) = many.report.explain(PER_ROW)
    assert "the per-expert form" in attempt.reason, attempt


def test_grouped_mm_rules_decline_a_symbolic_number_of_experts():
    """The rules write one product per expert; exported with a Dim on the experts they decline (a `when` once
    ended in `or True` and fired, leaving a graph that names an unbound SymInt)."""

    def grouped(x, weight, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offs)

    g = torch.Generator().manual_seed(0)
    x, weight, offs = torch.randn(7, 4, generator=g), torch.randn(3, 4, 5, generator=g), torch.tensor([2, 2, 6])
    experts = Dim("experts")
    ep = rt.export(grouped, x, weight, offs, dynamic_shapes=(None, {0: experts}, {0: experts}))
    result = rt.apply_rules(ep, per_expert_for_iree, per_row_for_iree, explain=True)
    rt.assert_not_fired(result, PER_EXPERT)
    (attempt,) = result.report.explain(PER_EXPERT)
    assert "a symbolic number of experts" in attempt.reason, attempt
    torch.testing.assert_close(result.program.module()(x, weight, offs), grouped(x, weight, offs))
    fixed = rt.apply_rules(rt.export(grouped, x, weight, offs), per_expert_for_iree)
    rt.assert_fired(fixed, PER_EXPERT, times=1)


def _qwen3_moe_block(experts_implementation: str = "grouped_mm") -> torch.nn.Module:
    """transformers' Qwen3-MoE sparse block (4 experts, top 2), seeded weights."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block


def test_qwen3_moe_experts_from_a_real_export():
    """transformers' own sparse MoE block (router, sort, two grouped matmuls), exported with a Dim on the tokens:
    both matmuls are written per expert (on AVX-512 as `packed_matmul`s over the packed layout), and IREE computes
    the block as eager does."""
    block = _qwen3_moe_block()
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(1, 6, 16, generator=g),), (torch.randn(1, 11, 16, generator=g),)]
    ep = rt.export(block, *inputs[0], dynamic_shapes=({1: Dim("tokens", min=2, max=64)},))
    iree = backends.get("iree")
    result = rt.apply_rules(ep, iree.rules)
    rt.assert_fired(result, _lm_forms()[0], times=2)  # gate_up and down
    assert aten.index.Tensor not in [n.target for n in result.graph_module.graph.nodes if "mm" in n.name]
    rt.assert_matches_eager(result, block, inputs, rtol=1e-5, atol=1e-6)
    compiled = iree.compile(result.program, inputs[0])
    in_float64 = _qwen3_moe_block("eager").double()  # torch's grouped_mm takes no float64; same weights
    with torch.no_grad():
        for (x,) in inputs:
            reference = in_float64(x.double())
            eager_error = (block(x).double() - reference).abs().max().item()
            assert (compiled(x).double() - reference).abs().max().item() <= 4 * eager_error + 1e-6


def test_few_static_rows_take_the_per_expert_form_by_default():
    """Without the per-row form (`PER_ROW_LIMIT` 0, the default) a decode step's few static rows are multiplied
    per expert, reading each expert's weight as the prefill does (the packed copy both share)."""
    module = Experts(experts=4)
    inputs = [(_x(3, 0), torch.tensor([1, 1, 2, 2])), (_x(3, 1), torch.tensor([0, 1, 2, 3]))]
    result = rt.apply_rules(rt.export(module, *inputs[0]), per_expert_for_iree, per_row_for_iree)
    rt.assert_fired(result, PER_EXPERT, times=1)
    rt.assert_not_fired(result, PER_ROW)
    rt.assert_matches_eager(result, module, inputs, rtol=1e-6, atol=1e-6)


def _one_layer_qwen3_moe(hidden: int, heads: int, kv: int, experts: int, intermediate: int) -> torch.nn.Module:
    """A seeded one-layer Qwen3-MoE (top 2, every layer sparse), no eos, pad 0."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        **{**lm_models._attention(hidden=hidden, heads=heads, kv=kv), "num_hidden_layers": 1},
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def test_tiny_moe_generates_through_compile_lm_as_transformers_does():
    """A one-layer Qwen3-MoE (4 experts, top 2) through compile_lm: the prefill (a Dim on the sequence) takes the
    per-expert form, the decode step (2 rows) the per-expert form too (AVX-512: the packed per-row form reading
    the prefill's packed weights); the tokens equal model.generate's."""
    import fx_rewrites

    model = _one_layer_qwen3_moe(hidden=16, heads=2, kv=1, experts=4, intermediate=8)
    ids = lm_models.prompt()
    expected = lm_models.reference(model, ids, new=6)
    sequence = torch.cat([ids, expected], dim=1)
    assert lm_models.top2_margin(model, sequence, ids.shape[1] - 1) > 1e-3  # no greedy step near a tie
    lm = fx_rewrites.compile_lm(model, max_cache_len=ids.shape[1] + 8)
    prefill, decode = _lm_forms()
    assert lm.reports["prefill"].rewrites[prefill] == 2  # gate_up and down
    assert lm.reports["decode"].rewrites[decode] == 2
    assert PER_ROW not in lm.reports["decode"].rewrites
    got = lm.generate(ids, max_new_tokens=6)[0, ids.shape[1] :].tolist()
    assert got == expected[0].tolist()


def test_a_saved_moe_archive_holds_its_experts_packed_once(tmp_path):
    """issue 34: a Qwen3-MoE (8 experts, top 2, experts 80% of its weights) through compile_lm, saved with
    `params=`: the archive holds the weights as the prefill and the decode read them, the experts packed once
    (with the decode's per-row form it held them twice, packed for the prefill and as they are for the decode:
    1.8x the weights); on AVX-512 the experts laid out once by the graph (rules/moe_packed.py) for both (the
    prefill's grouped dispatch and the decode's per-row products); the loaded module generates model.generate's
    tokens."""
    import fx_rewrites

    model = _one_layer_qwen3_moe(hidden=64, heads=4, kv=2, experts=8, intermediate=64)
    ids = lm_models.prompt(9)
    expected = lm_models.reference(model, ids, new=8)
    assert lm_models.top2_margin(model, torch.cat([ids, expected], dim=1), ids.shape[1] - 1) > 1e-3
    lm = fx_rewrites.compile_lm(model, max_cache_len=24)
    prefill, decode = _lm_forms(pairs=True)  # gate_up N 128, down N 64
    assert lm.reports["prefill"].rewrites[prefill] == 2 and lm.reports["decode"].rewrites[decode] == 2
    lm.save(tmp_path / "moe.vmfb", params=tmp_path / "moe.irpa")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
    assert experts > 0.7 * weights
    written = (tmp_path / "moe.irpa").stat().st_size  # with the KV cache's initial values (6 KB)
    assert written < weights + 0.2 * experts, f"{written} bytes archived for {weights} of weights ({experts} experts)"
    loaded = fx_rewrites.load(tmp_path / "moe.vmfb")
    assert loaded.generate(ids, max_new_tokens=8)[0, ids.shape[1] :].tolist() == expected[0].tolist()


#: a fresh process: compile a Linear first (the IREE phases' rule index is built while transformers' op does
#: not exist), then a tiny Qwen2-MoE, whose experts call the op registered when its MoE code is imported
_AFTER_ANOTHER_COMPILE = """
import sys
sys.modules["torchvision"] = None  # not needed; transformers' image utils would import it
import torch, fx_rewrites
assert not hasattr(torch.ops.transformers, "grouped_mm_fallback"), "the op must not exist yet"
linear = torch.nn.Linear(4, 3).eval()
x = torch.randn(2, 4)
torch.testing.assert_close(fx_rewrites.compile(linear, (x,))(x), linear(x))
import transformers
config = transformers.Qwen2MoeConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=64, max_position_embeddings=32, use_cache=False, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=32,
)
torch.manual_seed(0)
model = transformers.Qwen2MoeModel(config).eval()
class Hidden(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = model
    def forward(self, ids):
        return self.model(ids).last_hidden_state
ids = [torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
with torch.no_grad():
    compiled = fx_rewrites.compile(Hidden(), (ids[0],))
    for i in ids:
        torch.testing.assert_close(compiled(i), Hidden()(i), rtol=1e-4, atol=1e-5)
print("matched")
"""


@pytest.mark.slow
def test_moe_compiles_after_another_model_in_one_process():
    """Issue 27: the rule index was cached with the MoE rule's placeholder root, so a MoE model compiled
    after any other model in one process kept `grouped_mm_fallback` (IreeCompileError); first, it passed."""
    proc = subprocess.run(
        [sys.executable, "-c", _AFTER_ANOTHER_COMPILE], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "matched" in proc.stdout, proc.stderr[-3000:]
