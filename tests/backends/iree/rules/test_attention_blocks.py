"""attention_by_key_blocks (backends/iree/rules/attention_blocks.py): masked attention a block of keys at a time.

Real exports (static and with a Dim on the queries, as compile_lm's prefill), the graph after (a run-time row
count a block, no softmax), numerics against eager on two input sets (a causal mask over a static cache from
position 0 and a shorter prompt at position 5 with padding; a random mask with fully masked rows), declines, and
the default llvm-cpu route end to end on IREE. (Its speed: docs/performance.md, not here.)
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree.rules.attention_blocks import ALIGN, MIN_GROUP, attention_by_key_blocks
from tests.backends.iree.rules.float32_error import assert_within_torch_error

aten = torch.ops.aten
KEYS = 600  # two blocks of 300


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _key_blocks_route():
    """The default `iree` route without the ISA's flash dispatch (rules/flash_attention.py:
    `attention_as_flash_dispatch[_avx512]`), which takes a masked prefill's attention over a Dim before this rule."""
    iree = backends.get("iree")
    flash = [n for n in ("attention_as_flash_dispatch_avx512", "attention_as_flash_dispatch") if n in iree.rules]
    return attrs.evolve(iree, rules=iree.rules.without(*flash)) if flash else iree


class CachedCausal(torch.nn.Module):
    """A prefill's attention as transformers writes it over a static cache: the bool mask of the positions each
    query may see (its own and earlier ones, not padding), key heads repeated or passed with enable_gqa."""

    def __init__(self, gqa: bool = False) -> None:
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v, positions, keep):
        allowed = (torch.arange(k.shape[-2])[None, :] <= positions[:, None]) & keep[None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[None, None], enable_gqa=self.gqa
        )


def _math_kernel(module: torch.nn.Module):
    """`module` with torch's math SDPA kernel: torch runs a masked SDPA on the CPU by its flash kernel or its math
    one, and its own float32 error is the larger of the two (the math kernel's: 7.3e-8 against 6.2e-8 on the short
    prompt of MANY on an AMD EPYC, AVX2, where IREE's is 9.1e-8)."""

    def run(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return module(*args)

    return run


def _causal_inputs(rows: int, start: int, pad: int, seed: int, kv_heads: int = 2, keys: int = KEYS):
    keep = torch.ones(keys, dtype=torch.long)
    keep[:pad] = 0
    return (
        _randn(seed, 1, 2, rows, 16),
        _randn(seed + 1, 1, kv_heads, keys, 16),
        _randn(seed + 2, 1, kv_heads, keys, 16),
        torch.arange(start, start + rows),
        keep,
    )


#: a full prompt from position 0; a short one at position 5 after 2 padded positions (the second block lets no row in)
CAUSAL = [_causal_inputs(300, 0, 0, 0), _causal_inputs(40, 5, 2, 10)]
QUERIES = Dim("queries", min=2, max=KEYS)
CAUSAL_DIMS = ({2: QUERIES}, None, None, {0: QUERIES}, None)


def _check(module, inputs, dynamic_shapes, blocks: int = 2, size: int = 16):
    ep = rt.export(module, *inputs[0], dynamic_shapes=dynamic_shapes)
    result = rt.apply_rules(ep, attention_by_key_blocks)
    rt.assert_fired(result, attention_by_key_blocks)
    rt.assert_ops(
        result, present=[aten.item.default, aten.exp.default], absent=[aten.scaled_dot_product_attention.default]
    )
    nodes = result.graph_module.graph.nodes
    items = [n for n in nodes if n.target is aten.item.default]
    assert len(items) == blocks  # one row count a block of keys
    # the scores as keys x rows: each block's product of its keys [b, h, keys, e] and the queries [b, h, e, rows]
    products = [n for n in nodes if n.target is aten.matmul.default and n.args[0].meta["val"].shape[-1] == size]
    assert len(products) == blocks
    for product in products:
        keys, rows = product.meta["val"].shape[-2:]
        assert isinstance(keys, int) and keys % ALIGN == 0 and not isinstance(rows, int)  # the rows: read at run time
    assert_within_torch_error(result.program.module(), module, inputs)
    rt.assert_idempotent(result, attention_by_key_blocks)
    return result


def test_causal_over_a_static_cache_with_a_dim():
    _check(CachedCausal(), CAUSAL, CAUSAL_DIMS)


def test_causal_over_a_static_cache_static():
    _check(CachedCausal(), [CAUSAL[0], _causal_inputs(300, 7, 3, 20)], None)


def test_grouped_query_heads():
    inputs = [_causal_inputs(300, 0, 0, 0, kv_heads=1), _causal_inputs(40, 5, 2, 10, kv_heads=1)]
    _check(CachedCausal(gqa=True), inputs, CAUSAL_DIMS)


#: 2309 keys: nine blocks of 272 (the last 133, padded to 144); a full prompt, and a short one late in the cache
MANY_KEYS = 9 * 256 + 5
MANY = [_causal_inputs(300, 0, 0, 0, keys=MANY_KEYS), _causal_inputs(40, 2000, 2, 10, keys=MANY_KEYS)]
MANY_DIMS = ({2: Dim("queries", min=2, max=MANY_KEYS)}, None, None, {0: Dim("queries", min=2, max=MANY_KEYS)}, None)


def test_heads_of_128_over_eight_keys_a_unit():
    """Qwen3-30B-A3B's head size (128) over 1041 keys, 8.1 keys a unit: four blocks."""
    inputs = []
    for rows, start, seed in ((300, 0, 0), (40, 900, 10)):
        q, k, v = _randn(seed, 1, 2, rows, 128), _randn(seed + 1, 1, 2, 1041, 128), _randn(seed + 2, 1, 2, 1041, 128)
        inputs.append((q, k, v, torch.arange(start, start + rows), torch.ones(1041, dtype=torch.long)))
    _check(CachedCausal(), inputs, CAUSAL_DIMS_1041, blocks=4, size=128)


CAUSAL_DIMS_1041 = ({2: Dim("queries", min=2, max=1041)}, None, None, {0: Dim("queries", min=2, max=1041)}, None)


def test_many_blocks_merged_one_after_another():
    """Nine blocks of keys: each merged into the running result over the rows it lets in (the short prompt's rows
    are let in by the last two blocks only), the last one padded with masked zero keys to a multiple of ALIGN."""
    _check(CachedCausal(), MANY, MANY_DIMS, blocks=9)


class AnyMask(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_any_mask_with_fully_masked_rows():
    """The blocks are exact for any mask: a random one (each block's first row let in varies), with two rows
    masked whole, which give 0 as torch's CPU kernel gives."""
    inputs = []
    for seed in (0, 10):
        q, k, v = _randn(seed, 1, 2, 300, 16), _randn(seed + 1, 1, 2, KEYS, 16), _randn(seed + 2, 1, 2, KEYS, 16)
        mask = torch.rand(1, 2, 300, KEYS, generator=torch.Generator().manual_seed(seed + 3)) < 0.05
        mask[..., :120, :300] = False  # rows 0-119 see only the last block
        mask[0, 1, 7] = False
        mask[0, 0, 250] = False
        inputs.append((q, k, v, mask))
    queries = Dim("queries", min=2, max=KEYS)
    _check(AnyMask(), inputs, ({2: queries}, None, None, {2: queries}))
    assert (AnyMask()(*inputs[0])[0, 1, 7] == 0).all()


def test_declines():
    q, k, v = CAUSAL[0][:3]
    mask = torch.ones(1, 1, 300, KEYS, dtype=torch.bool)
    short = (q, k[:, :, :300], v[:, :, :300], torch.ones(1, 1, 300, 300, dtype=torch.bool))
    one_query = (q[:, :, :1], k, v, mask[:, :, :1])
    float_mask = (q, k, v, torch.zeros(1, 1, 300, KEYS))
    wide_heads = tuple(torch.cat([x] * 8, -1) for x in (q, k, v)) + (mask,)  # 600 keys, size 128
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = [
        (lambda q, k, v: sdpa(q, k, v), (q, k, v)),  # no mask
        (AnyMask(), short),  # fewer than two blocks of keys
        (AnyMask(), one_query),  # a decode step: one static query
        (AnyMask(), float_mask),
        (AnyMask(), wide_heads),  # fewer than 8 keys a unit of head size
        (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m[:, :, :1]), (q, k, v, mask)),  # one mask row for all queries
    ]
    for module, inputs in cases:
        result = rt.apply_rules(rt.export(module, *inputs), attention_by_key_blocks)
        rt.assert_not_fired(result, attention_by_key_blocks)


def test_on_iree_with_a_dim():
    """The default `iree` route (llvm-cpu, performance phase on): the rule fires on the prefill's form and IREE
    matches eager at both prompt lengths of one compiled module."""
    iree = _key_blocks_route()
    assert "attention_by_key_blocks" in [r.name for r in iree.rules.rules]
    result = fx_rewrites.apply(rt.export(CachedCausal(), *CAUSAL[0], dynamic_shapes=CAUSAL_DIMS), iree.rules)
    rt.assert_fired(result, attention_by_key_blocks)
    fn = iree.compile(result.program, CAUSAL[0])
    # measured: IREE within 2.4e-7 of eager, and as close to a float64 run (5.1e-7) as torch's float32 (4.1e-7)
    assert_within_torch_error(fn, CachedCausal(), CAUSAL, torch_forms=[_math_kernel(CachedCausal())])


def test_nine_blocks_load_and_run_on_iree():
    """Nine blocks: the module loads (combined in one dispatch, nine blocks' run-time row counts exceeded the 64
    constants IREE 3.13's runtime allows a dispatch, docs/iree-3.13-findings.md section 32) and matches."""
    iree = _key_blocks_route()
    result = fx_rewrites.apply(rt.export(CachedCausal(), *MANY[0], dynamic_shapes=MANY_DIMS), iree.rules)
    rt.assert_fired(result, attention_by_key_blocks)
    fn = iree.compile(result.program, MANY[0])
    assert_within_torch_error(fn, CachedCausal(), MANY, torch_forms=[_math_kernel(CachedCausal())])


class RepeatedCausal(torch.nn.Module):
    """`CachedCausal` with the keys and values repeated per query head as transformers' `repeat_kv` writes it (an
    expand of `x[:, :, None]` and a reshape), SDPA without gqa: compile_lm's prefill of a grouped-query model."""

    def forward(self, q, k, v, positions, keep):
        allowed = (torch.arange(k.shape[-2])[None, :] <= positions[:, None]) & keep[None, :].bool()
        b, kv, keys, size = k.shape
        group = q.shape[1] // kv
        k = k[:, :, None].expand(b, kv, group, keys, size).reshape(b, kv * group, keys, size)
        v = v[:, :, None].expand(b, kv, group, keys, size).reshape(b, kv * group, keys, size)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])


def _grouped_inputs(heads: int, kv_heads: int, second: tuple[int, ...] = (40, 5, 2, 10), first_seed: int = 0):
    """A full prompt from position 0 and (`second`: rows, start, padded positions, seed) a short one at position 5
    after 2 padded positions, `heads` over `kv_heads`."""
    out = []
    for rows, start, pad, seed in ((300, 0, 0, first_seed), second):
        _, k, v, positions, keep = _causal_inputs(rows, start, pad, seed, kv_heads=kv_heads)
        out.append((_randn(seed + 5, 1, heads, rows, 16), k, v, positions, keep))
    return out


def _check_grouped(module, inputs, dynamic_shapes):
    """The grouped form: no repeat of the keys (no expand), each block's scores one product a key-value head with the
    group's query heads as rows ([b, kv, keys, rows x group]), within torch's float32 error of eager."""
    ep = rt.export(module, *inputs[0], dynamic_shapes=dynamic_shapes)
    result = rt.apply_rules(ep, attention_by_key_blocks)
    rt.assert_fired(result, attention_by_key_blocks)
    rt.assert_ops(result, present=[aten.item.default], absent=[aten.scaled_dot_product_attention.default])
    nodes = result.graph_module.graph.nodes
    assert not [n for n in nodes if n.target is aten.expand.default and n.meta["val"].dim() == 5]
    kv_heads = inputs[0][1].shape[1]
    products = [n for n in nodes if n.target is aten.matmul.default and n.args[0].meta["val"].shape[-1] == 16]
    assert len(products) == 2
    for product in products:
        _, heads, keys, rows = product.meta["val"].shape  # rows: the group's query heads x the rows let in
        assert heads == kv_heads and keys % ALIGN == 0 and keys >= 256 and not isinstance(rows, int)
    # key blocks sum in another order than torch's kernels: within the largest error torch makes at these shapes
    # (the RMS over 20 draws: 4.09e-8 against torch's 3.94e-8 and 3.84e-8, its flash and math kernels; one draw's
    # maximum is above theirs plus a step once in 20)
    assert_within_torch_error(result.program.module(), module, inputs, torch_forms=[_math_kernel(module)], redraws=16)
    rt.assert_idempotent(result, attention_by_key_blocks)


def test_grouped_through_repeat_kv_with_a_dim():
    """8 query heads over 1 (a group of MIN_GROUP): transformers' repeated keys read in place, the group as rows."""
    assert MIN_GROUP == 8
    _check_grouped(RepeatedCausal(), _grouped_inputs(8, 1), CAUSAL_DIMS)


def test_grouped_through_repeat_kv_static():
    """Two key-value heads of 8 query heads each, static: a full prompt and one of as many rows later in the cache."""
    _check_grouped(RepeatedCausal(), _grouped_inputs(16, 2, second=(300, 7, 3, 20)), None)


def test_grouped_by_enable_gqa():
    _check_grouped(CachedCausal(gqa=True), _grouped_inputs(8, 1), CAUSAL_DIMS)


def test_small_groups_repeat_per_query_head():
    """A group of 2 (measured slower grouped): the keys repeated per query head, as before."""
    inputs = _grouped_inputs(4, 2)
    result = rt.apply_rules(
        rt.export(RepeatedCausal(), *inputs[0], dynamic_shapes=CAUSAL_DIMS), attention_by_key_blocks
    )
    rt.assert_fired(result, attention_by_key_blocks)
    products = [
        n
        for n in result.graph_module.graph.nodes
        if n.target is aten.matmul.default and n.args[0].meta["val"].shape[-1] == 16
    ]
    assert [p.meta["val"].shape[1] for p in products] == [4, 4]
    assert_within_torch_error(result.program.module(), RepeatedCausal(), inputs)


def test_grouped_on_iree_with_a_dim():
    """The grouped form through the default `iree` route: one module, both prompt lengths within torch's error."""
    iree = _key_blocks_route()
    inputs = _grouped_inputs(8, 1)
    result = fx_rewrites.apply(rt.export(RepeatedCausal(), *inputs[0], dynamic_shapes=CAUSAL_DIMS), iree.rules)
    rt.assert_fired(result, attention_by_key_blocks)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, RepeatedCausal(), inputs, torch_forms=[_math_kernel(RepeatedCausal())])


@pytest.mark.slow
def test_tiny_moe_over_a_long_cache_generates_as_transformers_does():
    """compile_lm of a two-layer Qwen3-MoE over a cache of 600 (heads of 8: two blocks of keys), a prompt of 300 and
    one of 30 (the second block lets no row in): the prefill's attention is written in key blocks (both layers) and
    the tokens equal model.generate's (both given the mask: the prompts hold the pad token 0, which generate would
    mask unasked)."""
    import transformers

    from tests import lm_models

    cls, config = lm_models.BUILDERS["qwen3_moe"](transformers)
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    lm = fx_rewrites.compile_lm(model, max_cache_len=600, backend=_key_blocks_route())
    assert lm.reports["prefill"].rewrites["attention_by_key_blocks"] == 2
    for length in (300, 30):
        ids = lm_models.prompt(length)
        expected = lm_models.reference(model, ids, new=6)
        assert lm_models.top2_margin(model, torch.cat([ids, expected], 1), length - 1) > 1e-3  # no near tie
        got = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)[0, length:]
        assert got.tolist() == expected[0].tolist(), length
    # the prompt in chunks (`prefill_chunk_size`): each chunk's rows over the cache at its offset, the blocks before
    # it whole, the block it ends in partly, the blocks after it with no row; lengths not a multiple of the chunk
    for length, chunk in ((530, 256), (300, 128), (300, 37)):
        ids = lm_models.prompt(length)
        expected = lm_models.reference(model, ids, new=6)
        assert lm_models.top2_margin(model, torch.cat([ids, expected], 1), length - 1) > 1e-3
        mask = torch.ones_like(ids)
        got = lm.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk)[0, length:]
        assert got.tolist() == expected[0].tolist(), (length, chunk)
