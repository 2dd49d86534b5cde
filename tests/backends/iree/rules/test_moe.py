"""transformers' grouped matmul of MoE experts on IREE (backends/iree/rules/moe.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.export import Dim

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.errors import IreeCompileError
from fx_rewrites.backends.iree.rules.moe import grouped_mm_for_iree

moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


class Experts(torch.nn.Module):
    """The grouped matmul as transformers 5's MoE layers call it: rows sorted by expert, offs their ends."""

    def forward(self, x, weight, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, weight, offs) * 2.0


def _inputs(rows: int, offs: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(3, 4, 5, generator=g), torch.tensor(offs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_grouped_mm_becomes_a_gathered_bmm_on_iree(dynamic):
    # an expert with no rows, and a row past the last offset (0 in the op)
    inputs = [_inputs(7, [2, 2, 6], 0), _inputs(9 if dynamic else 7, [3, 5, 7] if dynamic else [0, 4, 7], 1)]
    shapes = ({0: Dim("rows")}, None, None) if dynamic else None
    ep = rt.export(Experts(), *inputs[0], dynamic_shapes=shapes)
    iree = backends.get("iree")
    with pytest.raises(IreeCompileError, match="grouped_mm_fallback"):
        iree.compile(ep, inputs[0])
    result = rt.apply_rules(ep, grouped_mm_for_iree)
    rt.assert_fired(result, "grouped_mm_to_gathered_bmm_for_iree", times=1)
    assert not any("grouped_mm" in str(t) for t in rt.targets(result))
    rt.assert_matches_eager(result, Experts(), inputs, rtol=1e-5, atol=1e-5)
    rt.assert_idempotent(result, grouped_mm_for_iree)
    compiled = iree.compile(rt.apply_rules(ep, iree.rules).program, inputs[0])
    for args in inputs:
        torch.testing.assert_close(compiled(*args), Experts()(*args), rtol=1e-4, atol=1e-5)


def test_grouped_mm_rule_declines_a_symbolic_number_of_experts():
    """The rule writes the number of experts into the graph as a literal; exported with a Dim on the experts
    it must decline (its `when` once ended in `or True` and fired, leaving a graph that names an unbound
    SymInt), and it fires on the same program with the experts fixed."""
    x, weight, offs = _inputs(7, [2, 2, 6], 0)
    experts = Dim("experts")
    ep = rt.export(Experts(), x, weight, offs, dynamic_shapes=(None, {0: experts}, {0: experts}))
    result = rt.apply_rules(ep, grouped_mm_for_iree, explain=True)
    rt.assert_not_fired(result, "grouped_mm_to_gathered_bmm_for_iree")
    (attempt,) = result.report.explain("grouped_mm_to_gathered_bmm_for_iree")
    assert "a symbolic number of experts" in attempt.reason, attempt
    torch.testing.assert_close(result.program.module()(x, weight, offs), Experts()(x, weight, offs))
    fixed = rt.apply_rules(rt.export(Experts(), x, weight, offs), grouped_mm_for_iree)
    rt.assert_fired(fixed, "grouped_mm_to_gathered_bmm_for_iree", times=1)


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
