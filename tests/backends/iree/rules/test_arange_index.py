"""index_by_arange_as_view (backends/iree/rules/arange_index.py): a gather by an arange over a whole dim, as the dim.

Real torch 2.13 exports: transformers' padding-mask form (`attention_mask.bool()[batch_idx, kv_idx]`, both aranges,
static and with Dims on the keys and the rows), an arange next to a real gather (adjacent and not), expanded and
int32 aranges, and the prefill of a tiny transformers Llama and Gemma3 over a static cache (`compile_lm`'s export,
batch 1 and 2, a Dim on the prompt): the graph after (no aten.index, or one over the other index alone), values
equal eager and the program before on two input sets; declines, each with its reason (start, step, end, a flip, a
diagonal, a Dim against a static arange); the llvm-cpu routes list it; through IREE, the mask with Dims equals
eager's, and compile_lm's tokens equal model.generate's. (Its speed: benchmarks/causal_mask.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.arange_index import index_by_arange_as_view
from fx_rewrites.backends.iree.rules.index_guards import int32_index_to_int64_for_iree

aten = torch.ops.aten
RULE = "index_by_arange_as_view"


def _indices(result) -> list[list]:
    """The index lists of the aten.index nodes in the graph of a Result or an ExportedProgram."""
    nodes = rt.graph_module(result).graph.nodes
    return [n.args[1] for n in nodes if n.target is aten.index.Tensor]


def _check_values(result: rt.Result, module: torch.nn.Module, inputs: list[tuple]) -> None:
    for args in inputs:
        want, got = module(*args), result.program.module()(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)  # the same elements: no arithmetic


class PadMask(torch.nn.Module):
    """transformers' `sdpa_mask` over a static cache: causal (keys <= the row's cache position) and the padding mask
    read as attention_mask[batch_idx, kv_idx], both index tensors aranges unsqueezed to [batch, 1, rows, keys]."""

    def forward(self, cache_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kv = torch.arange(attention_mask.shape[1])
        b = torch.arange(attention_mask.shape[0])
        causal = kv[None, None, None, :] <= cache_position[None, None, :, None]
        pad = attention_mask.bool()[b[:, None, None, None], kv[None, None, None, :]]
        return causal & pad


def _mask_inputs(batch: int, rows: int, keys: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.arange(rows) + keys - rows, torch.randint(0, 2, (batch, keys), generator=g)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_padding_mask_read_as_the_dims(dynamic):
    """Both aranges (the batch's and the keys') become the dims themselves: no gather is left."""
    module = PadMask()
    inputs = [_mask_inputs(2, 5, 12, 0), _mask_inputs(2, 5, 12, 1)]
    shapes = None
    if dynamic:  # a Dim on the rows and on the keys (the arange's end is then a symbol), two sizes each
        keys, rows = Dim("keys", min=4, max=64), Dim("rows", min=2, max=64)
        shapes = ({0: rows}, {1: keys})
        inputs = [_mask_inputs(2, 5, 12, 0), _mask_inputs(2, 9, 17, 1)]
    result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), index_by_arange_as_view)
    rt.assert_fired(result, RULE, times=1)
    rt.assert_ops(result, absent=[aten.index.Tensor])
    _check_values(result, module, inputs)
    rt.assert_idempotent(result, index_by_arange_as_view)


class ByRowsAndKeys(torch.nn.Module):
    """x[rows, keys]: a real gather of rows (an input) broadcast against an arange over every key."""

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x[rows[:, None], torch.arange(x.shape[1])[None, :]] * 2.0


class Apart(torch.nn.Module):
    """x[rows, :, keys]: index tensors that are not adjacent put their broadcast shape first."""

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x[rows[:, None], :, torch.arange(x.shape[2])] + 1.0


class Int32(torch.nn.Module):
    """x[:, keys] by an int32 arange: the route's guard casts it to int64 first (int32_index_to_int64_for_iree)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, torch.arange(x.shape[1], dtype=torch.int32)] * 3.0


class Expanded(torch.nn.Module):
    """x[:, keys] with the arange expanded over the rows it does not vary along."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, torch.arange(x.shape[1]).expand(3, x.shape[1])] - 1.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_an_arange_next_to_a_real_gather(dynamic):
    """The rows are still gathered, by their index alone; the keys' dim is read as it is."""
    g = torch.Generator().manual_seed(0)
    x, rows = torch.randn(6, 10, generator=g), torch.tensor([5, 0, 2, 2, -1])
    other = (torch.randn(6, 13, generator=g), torch.tensor([1, 3, -6]))
    shapes = ({1: Dim("keys", min=2, max=64)}, {0: Dim("picked", min=2, max=64)}) if dynamic else None
    result = rt.apply_rules(rt.export(ByRowsAndKeys(), x, rows, dynamic_shapes=shapes), index_by_arange_as_view)
    rt.assert_fired(result, RULE, times=1)
    (left,) = _indices(result)
    assert len(left) == 1 and left[0].meta["val"].dim() == 2  # the rows' index only, [picked, 1]
    _check_values(result, ByRowsAndKeys(), [(x, rows), other if dynamic else (-x, rows.flip(0))])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_apart_and_expanded(dynamic):
    g = torch.Generator().manual_seed(1)
    x3, rows = torch.randn(4, 3, 7, generator=g), torch.tensor([3, 1])
    x2 = torch.randn(5, 8, generator=g)
    cases = [
        (Apart(), [(x3, rows), (torch.randn(4, 3, 9, generator=g), torch.tensor([0, -1, 2]))], 1),
        (Expanded(), [(x2,), (torch.randn(6, 11, generator=g),)], 0),
        (Int32(), [(x2,), (torch.randn(6, 11, generator=g),)], 0),
    ]
    for module, inputs, left in cases:
        shapes = None
        if dynamic and isinstance(module, Apart):
            shapes = ({2: Dim("keys", min=2, max=64)}, {0: Dim("picked", min=1, max=64)})
        elif dynamic:
            shapes = ({0: Dim("rows", min=2, max=64), 1: Dim("keys", min=2, max=64)},)
        else:
            inputs = [inputs[0], tuple(-a if a.is_floating_point() else a for a in inputs[0])]
        rules = (
            [int32_index_to_int64_for_iree, index_by_arange_as_view]
            if isinstance(module, Int32)
            else [index_by_arange_as_view]
        )
        result = rt.apply_rules(rt.export(module, *inputs[0], dynamic_shapes=shapes), *rules)
        if isinstance(module, Int32):
            rt.assert_fired(result, int32_index_to_int64_for_iree, times=1)
        rt.assert_fired(result, RULE, times=1)
        assert [len(i) for i in _indices(result)] == [1] * left
        _check_values(result, module, inputs)


def _declined(fn, *args, reason: str) -> None:
    result = rt.apply_rules(rt.export(fn, *args), index_by_arange_as_view, explain=True)
    rt.assert_not_fired(result, RULE)
    (attempt,) = result.report.explain(RULE)
    assert reason in attempt.reason, attempt
    torch.testing.assert_close(result.program.module()(*args), fn(*args))


def test_declines_another_start_step_or_end():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    _declined(lambda x: x[:, torch.arange(1, 8)], x, reason="an arange from 1, not 0")
    _declined(lambda x: x[:, torch.arange(0, 8, 2)], x, reason="an arange by step 2, not 1")
    _declined(lambda x: x[:, torch.arange(7)], x, reason="an arange of 7, not the whole dim of 8")
    _declined(lambda x: x[:, torch.arange(8).flip(0)], x, reason="flip")
    _declined(lambda x: x[torch.arange(3), torch.arange(3)], x[:, :3].contiguous(), reason="varies along axis 0")


def test_declines_a_dim_whose_size_is_not_the_aranges():
    """A Dim on x's keys and an arange of a static 8: whether they are equal is not known."""
    x = torch.randn(3, 8)
    ep = rt.export(lambda x: x[:, torch.arange(8)], x, dynamic_shapes=[{1: Dim("keys", min=8, max=64)}])
    result = rt.apply_rules(ep, index_by_arange_as_view, explain=True)
    rt.assert_not_fired(result, RULE)
    (attempt,) = result.report.explain(RULE)
    assert "not the whole dim" in attempt.reason, attempt
    y = torch.randn(3, 9)
    assert torch.equal(result.program.module()(y), y[:, :8])


def test_on_the_llvm_cpu_routes():
    from fx_rewrites.backends.iree.rules import performance

    assert RULE in performance.ALL.names()
    for isa in ("avx2", "avx512"):
        assert RULE in performance.for_target("llvm-cpu", isa).names()
    assert RULE not in performance.for_target("cuda").names()


def test_on_iree_with_dims():
    """The default `iree` route on the padding-mask form with Dims on the rows and keys: the rule fires, no gather is
    left, and IREE's mask equals eager's at two sizes of one compiled module."""
    from fx_rewrites import backends

    iree = backends.get("iree")
    inputs = [_mask_inputs(2, 5, 12, 0), _mask_inputs(2, 30, 41, 1)]
    shapes = ({0: Dim("rows", min=2, max=64)}, {1: Dim("keys", min=4, max=64)})
    result = fx_rewrites.apply(rt.export(PadMask(), *inputs[0], dynamic_shapes=shapes), iree.rules)
    rt.assert_fired(result, RULE, times=1)
    rt.assert_ops(result, absent=[aten.index.Tensor])
    fn = iree.compile(result.program, inputs[0])
    for args in inputs:
        assert torch.equal(fn(*args), PadMask()(*args))


# -- a tiny transformers Llama's static-cache prefill ------------------------------------------------------------

CACHE = 24


def _model(name: str = "llama"):
    from tests import lm_models
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    model, _ = lm_models.build(name)
    return model


def _prefill_inputs(batch: int, length: int, padded: int) -> tuple[torch.Tensor, ...]:
    """A prompt of `length` over a cache of CACHE, left padded: row b's first `padded - b` positions are padding."""
    ids = torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(batch, CACHE, dtype=torch.long)
    positions = torch.empty(batch, length, dtype=torch.long)
    for b in range(batch):
        pad = max(padded - b, 0)
        mask[b, :pad] = 0
        positions[b] = (torch.arange(length) - pad).clamp(min=0)
    return ids, mask, positions, torch.tensor([0])


@pytest.mark.parametrize(("name", "batch", "masks"), [("llama", 1, 1), ("llama", 2, 1), ("gemma3", 2, 2)])
def test_transformers_prefill_export(name, batch, masks):
    """compile_lm's prefill export (a Dim on the prompt; Gemma3: a sliding-window mask and a full one): each mask's
    gather by batch_idx and kv_idx is gone, the logits equal the program before the rule exactly and the eager
    model's wrapper within float32 error, with and without left padding."""
    from fx_rewrites.app.lm.export import CachedLM, export_lm

    model = _model(name)
    program = export_lm(CachedLM(model, max_cache_len=CACHE, batch_size=batch))["prefill"]
    assert len(_indices(program)) == masks  # the export has the gathers
    result = rt.apply_rules(program, index_by_arange_as_view)
    rt.assert_fired(result, RULE, times=masks)
    rt.assert_ops(result, absent=[aten.index.Tensor, aten.squeeze.dims])  # squeeze.dims: IREE 3.13 cannot lower it
    for inputs in (_prefill_inputs(batch, 6, 0), _prefill_inputs(batch, 11, 3)):
        before, after = program.module()(*inputs), result.program.module()(*inputs)
        assert torch.equal(after, before)
        with torch.no_grad():
            eager = CachedLM(model, max_cache_len=CACHE, batch_size=batch)(*inputs)
        torch.testing.assert_close(after, eager)


@pytest.mark.slow
def test_llama_compile_lm_generates_as_transformers_does():
    """The default `iree` route: the rule fires once in the prefill and the tokens equal model.generate's."""
    from tests import lm_models

    model = _model()
    lm = fx_rewrites.compile_lm(model, max_cache_len=48)
    assert lm.reports["prefill"].rewrites[RULE] == 1
    for length in (7, 13):
        ids = lm_models.prompt(length)
        expected = lm_models.reference(model, ids, new=8)
        assert lm_models.top2_margin(model, torch.cat([ids, expected], 1), length - 1) > 1e-3
        got = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)[0, length:]
        assert got.tolist() == expected[0].tolist(), length
