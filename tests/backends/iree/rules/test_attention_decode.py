"""attention_one_query_as_grouped_sums (backends/iree/rules/attention_decode.py): a decode step's attention.

Real exports (static and with a Dim on the keys, as compile_lm's decode reads its cache), the graph after (no SDPA,
no matmul: reductions; transformers' `repeat_kv` of the cache read through), numerics against eager on two input sets (grouped-query heads, a padding mask, a row masked
whole), declines, and the default llvm-cpu route end to end on IREE. (Its speed: docs/performance.md.)
"""

from __future__ import annotations

import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.attention_decode import attention_one_query_as_grouped_sums
from tests.backends.iree.rules.float32_error import assert_within_torch_error

aten = torch.ops.aten
RULE = attention_one_query_as_grouped_sums


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Decode(torch.nn.Module):
    """One query row over the cache as transformers calls SDPA: a bool mask over the keys, grouped heads."""

    def __init__(self, gqa: bool = True) -> None:
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


def _inputs(keys: int, seed: int, heads: int = 8, kv_heads: int = 2, batch: int = 2, mask_heads: int = 1):
    mask = torch.ones(batch, mask_heads, 1, keys, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of the first row
    return (
        _randn(seed, batch, heads, 1, 16),
        _randn(seed + 1, batch, kv_heads, keys, 16),
        _randn(seed + 2, batch, kv_heads, keys, 16),
        mask,
    )


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' `repeat_kv` (integrations/sdpa_attention.py), as its exported decode calls it."""
    b, kv, keys, size = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, keys, size).reshape(b, kv * n, keys, size)


class RepeatedDecode(torch.nn.Module):
    """transformers' decode under torch.export: the keys and values repeated per query head, SDPA without gqa."""

    def forward(self, q, k, v, mask):
        n = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask)


KEYS = Dim("keys", min=4, max=64)
DIMS = (None, {2: KEYS}, {2: KEYS}, {3: KEYS})


def _check(module, inputs, dynamic_shapes, absent=()):
    ep = rt.export(module, *inputs[0], dynamic_shapes=dynamic_shapes)
    result = rt.apply_rules(ep, RULE)
    rt.assert_fired(result, RULE)
    rt.assert_ops(
        result,
        present=[aten.sum.dim_IntList, aten.exp.default],
        absent=[aten.scaled_dot_product_attention.default, aten.matmul.default, aten.bmm.default, *absent],
    )
    # measured: the rewritten graph within 2.4e-7 of eager and 1.7e-7 of a float64 run (eager's own: 2.4e-7)
    assert_within_torch_error(result.program.module(), module, inputs)
    rt.assert_idempotent(result, RULE)
    return result


def test_grouped_heads_with_a_dim():
    _check(Decode(), [_inputs(40, 0), _inputs(23, 10)], DIMS)


def test_grouped_heads_static():
    _check(Decode(), [_inputs(40, 0), _inputs(40, 10)], None)


def test_equal_heads_and_a_mask_per_head():
    inputs = [_inputs(40, seed, heads=4, kv_heads=4, mask_heads=4) for seed in (0, 10)]
    _check(Decode(gqa=False), inputs, DIMS)


def test_a_row_masked_whole_gives_zero():
    inputs = [_inputs(40, seed) for seed in (0, 10)]
    for *_, mask in inputs:
        mask[1] = False
    _check(Decode(), inputs, DIMS)
    assert (Decode()(*inputs[0])[1] == 0).all()  # torch 2.13 CPU eager: 0, which the rule keeps


def test_no_mask():
    class NoMask(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    _check(NoMask(), [_inputs(40, seed)[:3] for seed in (0, 10)], DIMS[:3])


def _grouped_reads(result):
    """The rewritten graph's products read the keys and values as they came in: [b, kv heads, 1, keys, size]."""
    products = [n for n in result.program.graph.nodes if n.target is aten.mul.Tensor and n.meta["val"].dim() == 5]
    assert len(products) == 2, products
    return [tuple(n.meta["val"].shape[1:3]) for n in products]


def test_repeated_keys_and_values_read_once_with_a_dim():
    """transformers' exported decode repeats the cache per query head (`repeat_kv`): the rule reads the cache's
    own heads instead, the query heads of a group as rows (no expand left: IREE would copy the cache)."""
    result = _check(RepeatedDecode(), [_inputs(40, 0), _inputs(23, 10)], DIMS, absent=[aten.expand.default])
    assert _grouped_reads(result) == [(2, 4), (2, 4)]  # 2 key-value heads, 4 query heads each


def test_repeated_keys_and_values_static_with_a_mask_per_head():
    inputs = [_inputs(40, seed, heads=6, kv_heads=3, mask_heads=6) for seed in (0, 10)]
    result = _check(RepeatedDecode(), inputs, None, absent=[aten.expand.default])
    assert _grouped_reads(result) == [(3, 2), (3, 2)]


def test_a_repeat_in_another_order_stays():
    """Heads tiled (`x[:, None]`: head r * kv + j reads head j), not transformers' interleaving: not a grouping
    of consecutive query heads, so the repeat is kept (and the rule still writes one head per head)."""

    class Tiled(torch.nn.Module):
        def forward(self, q, k, v, mask):
            b, kv, keys, size = k.shape
            n = q.shape[1] // kv
            k, v = (x[:, None].expand(b, n, kv, keys, size).reshape(b, n * kv, keys, size) for x in (k, v))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    result = _check(Tiled(), [_inputs(40, 0), _inputs(23, 10)], DIMS)
    rt.assert_ops(result, present=[aten.expand.default])
    assert _grouped_reads(result) == [(8, 1), (8, 1)]


def test_declines():
    q, k, v, mask = _inputs(40, 0)
    two_rows = (torch.cat([q, q], 2), k, v, torch.cat([mask, mask], 2))
    float_mask = (q, k, v, torch.zeros(2, 1, 1, 40))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = [
        (Decode(), two_rows),  # a prefill: more than one query row
        (Decode(), float_mask),
        (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), (q, k, v)),
        (lambda q, k, v: sdpa(q.double(), k.double(), v.double(), enable_gqa=True), (q, k, v)),
    ]
    for module, inputs in cases:
        result = rt.apply_rules(rt.export(module, *inputs), RULE)
        rt.assert_not_fired(result, RULE)


def test_on_iree_with_a_dim():
    """The default `iree` route (llvm-cpu, performance phase on): the rule fires on the decode's form and IREE
    matches eager at both key lengths of one compiled module."""
    iree = backends.get("iree")
    assert "attention_one_query_as_grouped_sums" in [r.name for r in iree.rules.rules]
    inputs = [_inputs(40, 0), _inputs(23, 10)]
    for module in (Decode(), RepeatedDecode()):
        result = fx_rewrites.apply(rt.export(module, *inputs[0], dynamic_shapes=DIMS), iree.rules)
        rt.assert_fired(result, RULE)
        fn = iree.compile(result.program, inputs[0])
        assert_within_torch_error(fn, module, inputs)
