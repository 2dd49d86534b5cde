"""`attention_as_flash_dispatch_avx512`, `attention_as_flash_dispatch` (AVX2) and their unmasked forms
(backends/iree/rules/flash_attention.py) and the kernel's two register blocks (backends/iree/flash_attention_dispatch.py).

Real torch 2.13 exports of a prefill's attention as transformers writes it over a static cache (`repeat_kv` of the
cache's heads, a bool mask of the positions each query may see, padding included), with a Dim on the query rows and
static; the graph after (one `flash_attention` of the queries, the keys laid out in blocks, the mask as int8, no SDPA);
what the rule declines (static rows, a float mask, no mask, is_causal, a head size off the vectors); and the default
AVX-512 route end to end on IREE against float64 on two input sets (row counts off the row block and under it, a tail
key block, fully masked rows, a mask per head, a head size of 128, enable_gqa, a batch of 2 with its own padding a
row), each ISA's block (AVX2's: znver3 code, which an AVX-512 host runs); an encoder's attention (static rows, no
mask: ViT's 197 tokens, a tail key block, rows under a row block) through the unmasked rules on both ISAs; compile_lm of a tiny Qwen3-MoE generating as transformers does. (Its speed: docs/performance.md,
"MoE prefill's attention as a dispatch of our own".)
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

import fx_rewrites
from fx_rewrites import testing as rt
from fx_rewrites.backends.iree import IreeBackend, targets
from fx_rewrites.backends.iree.flash_attention_dispatch import (
    BLOCKS,
    FLASH_ATTENTION,
    KEYS,
    MARK,
    ROWS,
    Shape,
    executable,
    splice,
)
from fx_rewrites.backends.iree.legality import SPLICED
from fx_rewrites.backends.iree.rules import flash_attention as fa
from fx_rewrites.backends.iree.rules import performance
from fx_rewrites.backends.iree.rules.flash_attention import attention_as_flash_dispatch_avx512 as RULE
from fx_rewrites.ruleset import Phases, RuleSet
from tests.backends.iree.rules.float32_error import assert_within_torch_error

aten = torch.ops.aten
#: per ISA: the masked rule, the unmasked one
ISA_RULES = {
    "avx512": (RULE, fa.unmasked_attention_as_flash_dispatch_avx512),
    "avx2": (fa.attention_as_flash_dispatch, fa.unmasked_attention_as_flash_dispatch),
}
#: the ISAs this host runs the code of (znver3's AVX2 code runs on an AVX-512 host)
RUNS = {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(targets.host_isa(), [])


def _backend(isa: str) -> IreeBackend:
    """The ISA's default backend with both its flash rules first in its performance rules (on by default or not)."""
    iree = IreeBackend(target=targets.llvm_cpu(isa), driver="local-sync")
    perf = performance.for_target("llvm-cpu", isa)
    names = [r.name for r in ISA_RULES[isa]]
    chosen = RuleSet([*ISA_RULES[isa], *perf.without(*(n for n in names if n in perf))], name=perf.name)
    sets = [chosen if s is perf else s for s in iree.rules.sets]
    return IreeBackend(target=targets.llvm_cpu(isa), driver="local-sync", rules=Phases(*sets, name=iree.rules.name))


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Prefill(torch.nn.Module):
    """transformers' prefill attention over a static cache: `repeat_kv` (or enable_gqa), the bool mask of the
    positions a query may see and the cache's kept (unpadded) positions, one for every head or per head."""

    def __init__(self, gqa: bool = False, per_head: bool = False) -> None:
        super().__init__()
        self.gqa, self.per_head = gqa, per_head

    def forward(self, q, k, v, positions, keep):
        allowed = (torch.arange(k.shape[-2])[None, :] <= positions[:, None])[None] & keep.view(
            -1, 1, k.shape[-2]
        ).bool()
        allowed = allowed[:, None]  # [b or 1, 1, rows, keys]: keep [keys] or one row a batch entry
        if self.per_head:  # head h also shuts every key of rows h, h + 3, ...: fully masked rows per head
            rows = torch.arange(q.shape[-2])[None, :] % 3 != torch.arange(q.shape[1])[:, None] % 3
            allowed = allowed & rows[None, :, :, None]
        if not self.gqa:
            group = q.shape[1] // k.shape[1]
            b, kv, n, e = k.shape
            k = k[:, :, None].expand(b, kv, group, n, e).reshape(b, kv * group, n, e)
            v = v[:, :, None].expand(b, kv, group, n, e).reshape(b, kv * group, n, e)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.gqa)


def _inputs(rows: int, start: int, pad: int, seed: int, heads=4, kv=2, keys=200, size=64, batch=1):
    keep = torch.ones(keys, dtype=torch.long) if batch == 1 else torch.ones(batch, keys, dtype=torch.long)
    keep[..., :pad] = 0
    if batch > 1:
        keep[1:, : pad + 2] = 0  # left padding of its own a batch entry
    return (
        _randn(seed, batch, heads, rows, size),
        _randn(seed + 1, batch, kv, keys, size),
        _randn(seed + 2, batch, kv, keys, size),
        torch.arange(start, start + rows),
        keep,
    )


def _dims(keys: int):
    rows = Dim("rows", min=2, max=keys)
    return ({2: rows}, None, None, {0: rows}, None)


def _math(module):
    def run(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return module(*args)

    return run


def test_with_a_dim():
    inputs = [_inputs(37, 0, 0, 0), _inputs(5, 150, 3, 10)]
    result = rt.apply_rules(rt.export(Prefill(), *inputs[0], dynamic_shapes=_dims(200)), RULE)
    rt.assert_fired(result, RULE, times=1)
    rt.assert_ops(result, present=[FLASH_ATTENTION], absent=[aten.scaled_dot_product_attention.default])
    call = next(n for n in result.graph_module.graph.nodes if n.target is FLASH_ATTENTION)
    _, k, v, mask = (a.meta["val"] for a in call.args[:4])
    assert tuple(k.shape) == (1, 2, -(-200 // KEYS), 64, KEYS)  # the cache's own 2 heads, read through repeat_kv
    assert tuple(v.shape) == (1, 2, -(-200 // KEYS) * KEYS, 64) and mask.dtype == torch.int8
    assert call.args[4:] == (64**-0.5, 200, 16)  # the scale, the keys, AVX-512's 16 lanes
    assert_within_torch_error(result.program.module(), Prefill(), inputs)  # the op's eager form
    rt.assert_idempotent(result, RULE)


def test_declines():
    inputs = _inputs(37, 0, 0, 0)
    static = rt.apply_rules(rt.export(Prefill(), *inputs), RULE)
    rt.assert_not_fired(static, RULE)  # static rows: not where it was measured

    class Other(torch.nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.how = how

        def forward(self, q, k, v, positions, keep):
            allowed = (torch.arange(k.shape[-2])[None, :] <= positions[:, None])[None, None]
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
            if self.how == "float":
                mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            if self.how == "causal":
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    for how in ("float", "causal", "none"):
        ep = rt.export(Other(how), *inputs, dynamic_shapes=_dims(200))
        rt.assert_not_fired(rt.apply_rules(ep, RULE), RULE)
    odd = _inputs(37, 0, 0, 0, size=24)  # a head size off the 16-lane vectors
    rt.assert_not_fired(rt.apply_rules(rt.export(Prefill(), *odd, dynamic_shapes=_dims(200)), RULE), RULE)
    unmasked = fa.unmasked_attention_as_flash_dispatch
    for how in ("float", "causal"):  # the unmasked rule: neither a mask nor is_causal
        ep = rt.export(Other(how), *inputs, dynamic_shapes=_dims(200))
        rt.assert_not_fired(rt.apply_rules(ep, unmasked), unmasked)
    rt.assert_not_fired(rt.apply_rules(rt.export(Prefill(), *inputs), unmasked), unmasked)  # masked


class Encoder(torch.nn.Module):
    """An encoder's self-attention as ViT's and Whisper's encoder call it: SDPA of q, k, v, no mask."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _encoder_inputs(seed: int, b: int, heads: int, tokens: int, size: int) -> tuple[torch.Tensor, ...]:
    return tuple(_randn(seed + i, b, heads, tokens, size) for i in range(3))


def test_unmasked_static():
    inputs = [_encoder_inputs(0, 2, 4, 197, 64), _encoder_inputs(10, 2, 4, 197, 64)]
    for isa, (_, rule) in ISA_RULES.items():
        result = rt.apply_rules(rt.export(Encoder(), *inputs[0]), rule)
        rt.assert_fired(result, rule, times=1)
        call = next(n for n in result.graph_module.graph.nodes if n.target is FLASH_ATTENTION)
        assert call.args[3] is None and call.args[4:] == (64**-0.5, 197, BLOCKS[isa].lanes)
        assert_within_torch_error(result.program.module(), Encoder(), inputs)  # the op's eager form


def test_executable_and_splice():
    assert "fx_rewrites.flash_attention.default" in SPLICED and MARK == "torch.fx_rewrites.flash_attention"
    name, text = executable(Shape(1, 8, 4, 2081, 64, 1, 0.125))
    assert name == "flash_1x8x4_k2081_d64_m1_s3e000000_r6x64l16" and f"stream.executable private @{name}" in text
    assert "math.exp" in text and "scf.if" in text  # the online softmax, the shut key blocks skipped
    assert "vector<16xf32>" in text and "vector<8xf32>" not in text and "%sbuf" not in text  # zmm, scores in registers
    name, text = executable(Shape(1, 8, 4, 2081, 64, 1, 0.125, lanes=8))
    assert name.endswith("_r6x16l8") and "vector<8xf32>" in text and "%sbuf" in text  # ymm, 16 keys a pass
    name, text = executable(Shape(2, 4, 4, 197, 64, 0, 0.125, lanes=8))  # no mask: no mask binding, no skip
    assert "%bm" not in text and "scf.if %f" not in text
    with pytest.raises(ValueError, match="lanes=4"):
        executable(Shape(1, 8, 4, 2081, 64, 1, 0.125, lanes=4))
    with pytest.raises(ValueError, match="no flash_attention call"):
        splice("module {\n}")
    with pytest.raises(ValueError, match="unknown form"):
        splice(f'module {{\n  %0 = torch.operator "{MARK}"(%a) : (!torch.int) -> !torch.int\n}}')


#: name -> (module, [(rows, start, pad, seed)] x 2, heads, kv, keys, size[, batch])
CASES = {
    # 37 rows: six row blocks, the last of one row; 200 keys: a tail key block of 8; padding: fully masked rows
    "repeat_kv": (Prefill(), [(37, 0, 0, 0), (40, 0, 3, 10)], 4, 2, 200, 64),
    "under_a_row_block": (Prefill(), [(ROWS - 1, 190, 0, 0), (2, 0, 1, 10)], 4, 2, 200, 64),
    "per_head_mask": (Prefill(per_head=True), [(23, 0, 0, 0), (9, 100, 2, 10)], 4, 4, 130, 32),
    "gqa_head_128": (Prefill(gqa=True), [(30, 0, 0, 0), (7, 60, 0, 10)], 8, 2, 2 * KEYS, 128),
    "batch_2_own_padding": (Prefill(), [(20, 0, 2, 0), (9, 40, 0, 10)], 4, 2, 100, 16, 2),
}


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("name", list(CASES))
def test_on_iree(name, isa):
    if isa not in RUNS:
        pytest.skip(f"this host does not run {isa} code")
    module, sets, heads, kv, keys, size, *batch = CASES[name]
    inputs = [_inputs(*s, heads=heads, kv=kv, keys=keys, size=size, batch=(batch or [1])[0]) for s in sets]
    iree = _backend(isa)
    result = fx_rewrites.apply(rt.export(module, *inputs[0], dynamic_shapes=_dims(keys)), iree.rules)
    rt.assert_fired(result, ISA_RULES[isa][0], times=1)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, module, inputs, torch_forms=[_math(module)], redraws=16)


#: name -> [(seed, b, heads, tokens, size)] x 2: ViT's 197 tokens (a tail key block of 5, a last row block of 5),
#: 70 tokens of 128 (a tail block of 6), 5 tokens (under a row block: keys all in the tail block)
ENCODER_CASES = {
    "vit_197": [(0, 2, 4, 197, 64), (10, 2, 4, 197, 64)],
    "head_128": [(0, 1, 2, 70, 128), (10, 1, 2, 70, 128)],
    "under_a_row_block": [(0, 3, 2, 5, 32), (10, 3, 2, 5, 32)],
}


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("name", list(ENCODER_CASES))
def test_unmasked_on_iree(name, isa):
    if isa not in RUNS:
        pytest.skip(f"this host does not run {isa} code")
    inputs = [_encoder_inputs(*s) for s in ENCODER_CASES[name]]
    iree = _backend(isa)
    result = fx_rewrites.apply(rt.export(Encoder(), *inputs[0]), iree.rules)
    rt.assert_fired(result, ISA_RULES[isa][1], times=1)
    fn = iree.compile(result.program, inputs[0])
    assert_within_torch_error(fn, Encoder(), inputs, torch_forms=[_math(Encoder())], redraws=16)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_tiny_moe_generates_as_transformers_does(isa):
    """compile_lm of a two-layer Qwen3-MoE over a cache of 600 on the ISA's default route: both layers' prefill
    attention through the ISA's dispatch, and the tokens equal model.generate's for a prompt of 300, one of 30, and the
    first in chunks (`prefill_chunk_size`: each chunk's rows over the cache at its offset)."""
    if isa not in RUNS:
        pytest.skip(f"this host does not run {isa} code")
    import transformers

    from tests import lm_models

    cls, config = lm_models.BUILDERS["qwen3_moe"](transformers)
    config.max_position_embeddings, config.head_dim = 1024, 16  # heads of 16: one vector (the tiny models' 8: none)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    lm = fx_rewrites.compile_lm(model, max_cache_len=600, backend=IreeBackend(target=targets.llvm_cpu(isa)))
    assert lm.reports["prefill"].rewrites[ISA_RULES[isa][0].name] == 2
    for length, chunk in ((300, None), (30, None), (300, 37)):
        ids = lm_models.prompt(length)
        expected = lm_models.reference(model, ids, new=6)
        assert lm_models.top2_margin(model, torch.cat([ids, expected], 1), length - 1) > 1e-3  # no near tie
        mask = torch.ones_like(ids)
        got = lm.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk)[0, length:]
        assert got.tolist() == expected[0].tolist(), (length, chunk)
