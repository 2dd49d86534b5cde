"""Performance rules for IREE, per compile target, chosen by measurement.

Each rule rewrites a form IREE 3.13 compiles correctly but slowly into one it
compiles well, with the same numbers. `benchmarks/runtime.py` measures each
rule's gain (the model with the target's rules, and without that one rule);
a rule is in a target's default set only where that benchmark shows a gain
on every model it fires on (docs/performance.md has the table).

- `attention_as_matmul_softmax` (backends/iree/rules/attention.py): llvm-cpu.
  Its scores are scaled after `q @ k^T` and its softmax comes before `@ v`.
- `attention_by_head_groups`: llvm-cpu. Attention whose scores exceed a
  core's cache is computed in groups of heads whose scores fit (Whisper).
- `index_by_arange_as_view` (backends/iree/rules/arange_index.py): llvm-cpu.
  A gather by an arange over a whole dim (transformers' padding mask over a
  static cache) read as the dim itself: IREE's gather is an unvectorized loop.
- `attention_one_query_as_grouped_sums` (backends/iree/rules/attention_decode.py):
  llvm-cpu. One query row (a decode step) per key-value head as multiplies
  and sums over the cache in place: no repeat of the keys, no packing.
- `mlp_rows_padded_to_tiles` (backends/iree/rules/mlp_tiles.py): llvm-cpu,
  AVX2 (ViT 0.88x of the route with it). An MLP over static rows off the 8-row tiles (ViT's 4 x 197) with its
  rows padded to them before the first linear, sliced after the second.
- `attention_padded_to_tiles` (backends/iree/rules/attention_tiles.py): llvm-cpu,
  for AVX2, on for no ISA yet (1-2% on ViT and Whisper, inside the noise).
  Attention over a static length off the 8x8 tiles (ViT 197, Whisper 500)
  written out over queries and keys padded to them.
- `attention_by_key_blocks` (backends/iree/rules/attention_blocks.py):
  llvm-cpu. Masked attention over long static keys, a block of keys at a
  time over the query rows the block's mask lets in (a causal prefill over
  compile_lm's static cache computes half its scores).
- `softmax_matmul_normalized_after`: llvm-cpu. `softmax(s) @ v` scales the
  product's rows instead of the weights, the row sums from a matrix-vector
  product: IREE's row reductions are slow (Whisper's attention 1.14x).
- `softmax_as_exp_times_reciprocal`: llvm-cpu. IREE's own softmax op runs
  1.5-15x slower than softmax written out as torch's CPU kernel computes it.
- `patch_conv_as_matmul`: llvm-cpu. A convolution whose stride is its
  kernel (ViT's 16x16 patch embedding) is a reshape and a matmul; IREE
  lowers the convolution 30x slower.
- `conv1d_as_matmul`: llvm-cpu. A 1-D convolution (Whisper's audio stem)
  is shifted row slices side by side and one matmul; IREE's 1-D convolution
  runs at 1 to 2 GFLOP/s.
- im2col.py: llvm-cpu. 1x1 convolutions as a matmul over the channels
  (AVX-512 and AVX2), wide kxk ones (AVX-512) (256 channels or more, small maps) as im2col +
  matmul, the rest left to IREE's direct convolution: im2col per shape, in
  place of IREE's global im2col flag.
- conv_taps.py: llvm-cpu, AVX2. A 3x3 convolution at stride 1 as nine
  products of the weight's taps by the padded input's shifted windows,
  summed: no im2col matrix, whose pack IREE runs one float at a time.
- `max_pool_without_unread_indices` (backends/iree/rules/pool_indices.py): llvm-cpu. The torch.compile
  route's `max_pool2d_with_indices(...)[0]` as export's `max_pool2d`: IREE stores the unread indices.
- conv_performance.py: llvm-cpu. Strided 1x1, 3-D, depthwise and grouped
  convolutions, which IREE 3.13 lowers 3-12x slower than eager, in forms it
  runs well (ResNet-50 1.76x eager -> 0.79x).

GPU targets get no performance rule until one is measured there
(docs/performance.md, the GPU section). Vulkan needs attention written out
to compile at all: IREE 3.13's SPIR-V code generation cannot lower its
online attention ("failed to legalize ... iree_linalg_ext.online_attention").
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fx_rewrites import schema
from fx_rewrites.backends.iree.rules import conv_performance as conv
from fx_rewrites.backends.iree.rules import (
    conv_taps,
    f32_matmul,
    flash_attention,
    grouped_conv_dispatch,
    im2col,
    pointwise_conv_dispatch,
    tap_conv_dispatch,
)
from fx_rewrites.backends.iree.rules.arange_index import index_by_arange_as_view
from fx_rewrites.backends.iree.rules.attention import SDPA, Attention, attention_as_matmul_softmax, bind
from fx_rewrites.backends.iree.rules.attention_blocks import attention_by_key_blocks
from fx_rewrites.backends.iree.rules.attention_decode import attention_one_query_as_grouped_sums
from fx_rewrites.backends.iree.rules.attention_tiles import attention_padded_to_tiles
from fx_rewrites.backends.iree.rules.mlp_tiles import mlp_rows_padded_to_tiles
from fx_rewrites.backends.iree.rules.pool_indices import max_pool_without_unread_indices
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


# ----------------------------------------------------------------------------- attention by head groups

#: the most bytes of float32 scores one group computes at once: this machine's L2 cache a core (AMD Zen 4,
#: 1 MiB). Whisper's encoder, 4x4 heads x 500 tokens (16 MB of scores), iree-benchmark-module CPU medians:
#: 136 ms whole, 129 in 4 groups of 4 MB, 124 in 16 groups of 1 MB; ViT (2.5 MB): 36.8 whole, 35.4 in 4 groups
SCORES_BUDGET = 1 << 20
#: at most this many groups (the graph grows by one attention a group); 16 is the most measured
MAX_GROUPS = 16


def _group_sizes(batch: int, heads: int) -> list[tuple[int, int]]:
    """The (batch rows, heads) one group can hold, smallest first: heads of one batch row, then whole rows."""
    heads_of_a_row = [(1, h) for h in range(1, heads + 1) if heads % h == 0]
    return heads_of_a_row + [(b, heads) for b in range(2, batch + 1) if batch % b == 0]


@attrs.frozen
class HeadGroups:
    """How one attention is split: `batches` x `heads` of its batch x heads a group."""

    attention: Attention
    batches: int
    heads: int


def _head_groups(node: Node) -> HeadGroups | Miss:
    a = bind(node)
    q, k, v = (fake_value(x) for x in (a.query, a.key, a.value))
    if a.mask is not None:
        return Miss("a mask: not measured (the fully-masked-row guard wraps the whole output)")
    if a.dropout_p != 0.0 or q.dtype != torch.float32:
        return Miss(f"dropout_p={a.dropout_p}, {q.dtype}: only float32 inference attention is measured")
    if not (q.dim() == k.dim() == v.dim() == 4):
        return Miss(f"query rank {q.dim()}: groups are cut along [batch, heads] of 4-D operands")
    shapes = [*q.shape, *k.shape, *v.shape]
    if not all(isinstance(d, int) for d in shapes):
        return Miss("symbolic sizes: the scores' size is not known")
    batch, heads, rows, _ = q.shape
    if (k.shape[0], k.shape[1], v.shape[0], v.shape[1]) != (batch, heads, batch, heads):
        return Miss(f"query {list(q.shape)}, key {list(k.shape)}: broadcast or grouped heads are not cut")
    one_head = rows * k.shape[2] * 4
    if batch * heads * one_head <= SCORES_BUDGET:
        return Miss(f"{batch * heads * one_head} bytes of scores: within {SCORES_BUDGET}, one group")
    sizes = _group_sizes(batch, heads)
    fitting = [i for i, (b, h) in enumerate(sizes) if b * h * one_head <= SCORES_BUDGET]
    i = fitting[-1] if fitting else 0  # the largest group that fits; one head if none does
    while (batch // sizes[i][0]) * (heads // sizes[i][1]) > MAX_GROUPS:  # fewer, larger groups
        i += 1
    per_batch, per_head = sizes[i]
    return HeadGroups(a, per_batch, per_head)


@rule(
    roots=(SDPA,),
    when=_head_groups,
    tags={"iree", "performance", "attention"},
    doc=(
        "float32 attention without a mask whose scores (batch x heads x queries x keys) exceed 1 MiB is "
        "computed in groups of heads (and batches) whose scores fit in it, concatenated: each group is the "
        "same attention on slices, so the numbers do not change. Written out, IREE 3.13 keeps a group's "
        "scores in a core's cache; Whisper's encoder (16 MB of scores) runs 1.1x faster."
    ),
)
def attention_by_head_groups(node: Node, rw: Rewriter, *, found: HeadGroups) -> Any:
    a = found.attention
    batch, heads = fake_value(a.query).shape[:2]
    rows = []
    for b in range(0, batch, found.batches):
        parts = []
        for h in range(0, heads, found.heads):
            q, k, v = (
                rw.call(
                    aten.slice.Tensor, rw.call(aten.slice.Tensor, x, 0, b, b + found.batches), 1, h, h + found.heads
                )
                for x in (a.query, a.key, a.value)
            )
            parts.append(rw.call(SDPA, q, k, v, None, 0.0, a.is_causal, scale=a.scale))
        rows.append(parts[0] if len(parts) == 1 else rw.call(aten.cat.default, parts, 1))
    rw.replace(node, rows[0] if len(rows) == 1 else rw.call(aten.cat.default, rows, 0))


# ----------------------------------------------------------------------------- softmax


def _softmax_in_float32(node: Node) -> bool | Miss:
    named = schema.arguments(node)
    x = fake_value(named["self"])
    if x.dtype != torch.float32:
        return Miss(f"{x.dtype}: torch's kernel keeps a float32 sum that written out in {x.dtype} would lose")
    if named.get("half_to_float") or named.get("dtype") is not None:
        return Miss("half_to_float or a dtype argument: the output is another dtype")
    if named["dim"] not in (-1, x.dim() - 1):
        return Miss(f"softmax over dim {named['dim']}, not the last (measured over the last only)")
    if any(isinstance(size, int) and size == 0 for size in x.shape):
        return Miss("a statically empty input (its amax over an empty dim has no value; the result is empty)")
    return True


@rule(
    roots=(aten._softmax.default, aten.softmax.int),
    when=_softmax_in_float32,
    tags={"iree", "performance"},
    doc=(
        "A float32 softmax over the last dim is written out as torch's CPU kernel computes it: m = amax, "
        "e = exp(x - m), e * reciprocal(sum(e)). IREE 3.13 on llvm-cpu runs its own softmax op 1.5-2x slower "
        "(it computes exp twice and divides each element) and a `/ sum` form 18x slower at some 4-D sizes."
    ),
)
def softmax_as_exp_times_reciprocal(node: Node, rw: Rewriter) -> Any:
    # Not torch._decomp's softmax: that divides by the sum, and IREE raises `e / sum(e)` back to its own softmax
    # op (iree-benchmark-module, [4, 4, 500, 500] scaled: 110.7 ms as that op, 6.1 ms in this form)
    e = _exp_rows(rw, node.args[0])
    total = rw.call(aten.sum.dim_IntList, e, [-1], True)
    rw.replace(node, rw.call(aten.mul.Tensor, e, rw.call(aten.reciprocal.default, total)))


def _exp_rows(rw: Rewriter, x: Node) -> Node:
    """exp(x - max(x)) over the last dim: softmax's rows before they are normalized."""
    return rw.call(aten.exp.default, rw.call(aten.sub.Tensor, x, rw.call(aten.amax.default, x, [-1], True)))


# ----------------------------------------------------------------------------- softmax, then a matmul

_SOFTMAXES = (aten._softmax.default, aten.softmax.int)


@attrs.frozen
class RowsThenMatmul:
    """`(rows normalized to sum 1) @ values`: the rows before normalizing, or the softmax input that makes them."""

    values: Node
    rows: Node | None = None
    softmax_input: Node | None = None


def _sums_its_rows(total: Any, rows: Node) -> bool:
    if not (isinstance(total, Node) and total.target is aten.sum.dim_IntList and total.args[0] is rows):
        return False
    dims, keepdim = total.args[1], total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    return (
        bool(keepdim)
        and dims is not None
        and list(dims) in ([-1], [fake_value(rows).dim() - 1])
        and "dtype" not in total.kwargs
    )


def _rows_then_matmul(node: Node) -> RowsThenMatmul | Miss:
    probs, values = node.args
    if not isinstance(probs, Node) or len(probs.users) != 1:
        return Miss("the weights are read elsewhere too: they are computed anyway")
    p, v = fake_value(probs), fake_value(values)
    if p.dim() < 2 or v.dim() < 2 or v.dtype != torch.float32:
        return Miss(f"weights of rank {p.dim()}, values of rank {v.dim()} and {v.dtype}: not a float32 matrix product")
    if not statically_known_true(v.shape[-2] > 0):
        return Miss("rows that may be empty: softmax's empty rows make 0, their sum's reciprocal inf")
    if probs.target in _SOFTMAXES:
        ok = _softmax_in_float32(probs)
        return RowsThenMatmul(values, softmax_input=probs.args[0]) if ok is True else ok
    if probs.target is aten.mul.Tensor and len(probs.args) == 2:
        for rows, scale in (probs.args, reversed(probs.args)):
            if (
                isinstance(scale, Node)
                and scale.target is aten.reciprocal.default
                and _sums_its_rows(scale.args[0], rows)
                and fake_value(rows).dtype == torch.float32
                and fake_value(rows).shape == p.shape
            ):
                return RowsThenMatmul(values, rows=rows)
    return Miss("the weights are neither a softmax nor rows times the reciprocal of their sum")


@rule(
    roots=(aten.matmul.default,),
    when=_rows_then_matmul,
    tags={"iree", "performance", "attention"},
    doc=(
        "softmax(s) @ v in float32 (a softmax over the last dim, or rows e times the reciprocal of their "
        "sum) becomes (e @ v) * reciprocal(e @ ones), e = exp(s - max): a row's scale commutes with the "
        "product, the row sums come from a matrix-vector product, and the [.., L, d] result is scaled "
        "instead of the [.., L, L] weights. IREE 3.13 on llvm-cpu compiles the sum as a row reduction that "
        "runs several times slower than the product: attention over 500 keys (Whisper) 17.0 -> 14.9 ms."
    ),
)
def softmax_matmul_normalized_after(node: Node, rw: Rewriter, *, found: RowsThenMatmul) -> Any:
    e = found.rows if found.rows is not None else _exp_rows(rw, found.softmax_input)
    ones = rw.call(
        aten.ones.default, [rw.size(found.values, -2), 1], dtype=torch.float32, device=fake_value(found.values).device
    )
    total = rw.call(aten.matmul.default, e, ones)
    out = rw.call(aten.matmul.default, e, found.values)
    rw.replace(node, rw.call(aten.mul.Tensor, out, rw.call(aten.reciprocal.default, total)))


# ----------------------------------------------------------------------------- convolutions

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.convolution.default)


def _conv(node: Node) -> dict[str, Any]:
    """The convolution's arguments by name, spatial lists as long as the kernel's spatial dims."""
    named = schema.arguments(node)
    spatial = fake_value(named["weight"]).dim() - 2
    out = {"input": named["input"], "weight": named["weight"], "bias": named.get("bias")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = named.get(key, [default])
        out[key] = list(value) * spatial if len(value) == 1 else list(value)
    out["groups"] = named.get("groups", 1)
    out["transposed"] = named.get("transposed", False)
    out["output_padding"] = list(named.get("output_padding", [0]))
    return out


def _plain_conv(c: dict[str, Any], spatial: int) -> bool | Miss:
    w = fake_value(c["weight"])
    if w.dim() - 2 != spatial:
        return Miss(f"a {w.dim() - 2}-D convolution")
    if fake_value(c["input"]).dim() != spatial + 2:
        return Miss("an unbatched input")
    if c["transposed"] or any(c["output_padding"]):
        return Miss("a transposed convolution")
    if c["groups"] != 1:
        return Miss(f"groups={c['groups']}")
    if not w.dtype.is_floating_point:
        return Miss(f"a {w.dtype} convolution")
    if not all(isinstance(s, int) for s in (*w.shape, *fake_value(c["input"]).shape[1:])):
        return Miss("symbolic channel or spatial sizes")
    return True


def _patch_conv(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    ok = _plain_conv(c, 2)
    if ok is not True:
        return ok
    kernel = list(fake_value(c["weight"]).shape[2:])
    if kernel == [1, 1]:
        # a pointwise convolution (MobileNet, ResNet's bottlenecks): not measured faster as a matmul, and the
        # matmul's other summation order moves deep BatchNorm nets (MobileNetV2) past 1e-5 of eager
        return Miss("a 1x1 convolution: not a patch embedding")
    if c["stride"] != kernel or any(c["padding"]) or any(d != 1 for d in c["dilation"]):
        return Miss(f"stride {c['stride']} and padding {c['padding']}: not non-overlapping {kernel} patches")
    return c


@rule(
    roots=_CONVS,
    when=_patch_conv,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A 2-D convolution whose stride is its kernel, without padding (ViT's and CLIP's patch embedding, "
        "16x16 stride 16) is a matmul of the image cut into patches: reshape to [N, C, H/kh, kh, W/kw, kw], "
        "permute, matmul by the weight as [O, C*kh*kw], back to [N, O, H/kh, W/kw]. IREE 3.13 on llvm-cpu "
        "runs the convolution 30x slower than that matmul (ViT: 105 ms of 419 ms)."
    ),
)
def patch_conv_as_matmul(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    out_channels, channels, kh, kw = fake_value(w).shape
    height, width = fake_value(x).shape[2:]
    gh, gw = height // kh, width // kw
    if (gh * kh, gw * kw) != (height, width):  # the convolution drops the last partial patch
        x = rw.call(aten.slice.Tensor, x, 2, 0, gh * kh)
        x = rw.call(aten.slice.Tensor, x, 3, 0, gw * kw)
    patches = rw.call(aten.reshape.default, x, [-1, channels, gh, kh, gw, kw])
    patches = rw.call(aten.permute.default, patches, [0, 2, 4, 1, 3, 5])
    patches = rw.call(aten.reshape.default, patches, [-1, channels * kh * kw])
    weight = rw.call(aten.reshape.default, w, [out_channels, channels * kh * kw])
    y = rw.call(aten.linear.default, patches, weight, found["bias"])
    y = rw.call(aten.reshape.default, y, [-1, gh, gw, out_channels])
    rw.replace(node, rw.call(aten.permute.default, y, [0, 3, 1, 2]))


#: largest kernel conv1d_as_matmul expands (the input is copied once per tap)
MAX_TAPS = 16


def _conv1d(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    ok = _plain_conv(c, 1)
    if ok is not True:
        return ok
    taps = fake_value(c["weight"]).shape[2]
    if taps > MAX_TAPS:
        return Miss(f"a {taps}-tap kernel: the stacked input would be {taps} copies")
    if isinstance(c["padding"][0], str):
        return Miss(f"padding={c['padding'][0]!r}")
    return c


@rule(
    roots=_CONVS,
    when=_conv1d,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A 1-D convolution (Whisper's audio stem: kernel 3, stride 1 and 2) becomes the input as [N, L, C], "
        "padded, its k shifted strided row slices concatenated to [N, L_out, k*C] and one matmul by the weight "
        "as [O, k*C]. IREE 3.13 on llvm-cpu runs 1-D convolutions at 1 to 2 GFLOP/s, the matmul at about 90."
    ),
)
def conv1d_as_matmul(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    x, w = found["input"], found["weight"]
    out_channels, channels, taps = fake_value(w).shape
    (stride,), (pad,), (dilation,) = found["stride"], found["padding"], found["dilation"]
    length = fake_value(x).shape[2] + 2 * pad
    out_length = (length - dilation * (taps - 1) - 1) // stride + 1
    span = stride * (out_length - 1) + 1
    # channels last ([N, L, C]: the k shifted slices are rows, concatenated along the channels): between
    # two such convolutions (Whisper's stem, a GELU between them) this permute and the previous one's cancel, and
    # IREE copies whole rows. Channels first (slices along L, stacked, then transposed) cost Whisper's stem 5.4 ms
    # of layout dispatches against 3.5 (in-module profile, one thread)
    x = rw.call(aten.permute.default, x, [0, 2, 1])
    if pad:
        x = rw.call(aten.constant_pad_nd.default, x, [0, 0, pad, pad], 0.0)
    shifted = [rw.call(aten.slice.Tensor, x, 1, i * dilation, i * dilation + span, stride) for i in range(taps)]
    columns = rw.call(aten.cat.default, shifted, 2)  # [N, L_out, taps * C], tap-major
    weight = rw.call(aten.permute.default, w, [0, 2, 1])  # [O, taps, C]
    weight = rw.call(aten.reshape.default, weight, [out_channels, taps * channels])
    y = rw.call(aten.linear.default, columns, weight, found["bias"])
    # permute, not transpose.int: after a guard that cut a Dim-sized input to one window, the convolution's
    # users are typed [b, O, L//k] (the engine keeps the replaced value's sizes) while y is [b, 1, O]; IREE 3.13
    # lowers transpose.int to a linalg.transpose that rejects a static size typed dynamic, permute it casts
    rw.replace(node, rw.call(aten.permute.default, y, [0, 2, 1]))


#: every performance rule, by name (benchmarks/runtime.py measures each)
ALL = RuleSet(
    [
        index_by_arange_as_view,
        attention_one_query_as_grouped_sums,
        attention_by_head_groups,
        attention_by_key_blocks,
        attention_padded_to_tiles,
        attention_as_matmul_softmax,
        softmax_matmul_normalized_after,
        softmax_as_exp_times_reciprocal,
        mlp_rows_padded_to_tiles,
        patch_conv_as_matmul,
        conv1d_as_matmul,
        max_pool_without_unread_indices,
        *conv.RULES,
        *im2col.RULES,
        *conv_taps.RULES,
        *f32_matmul.RULES,
        *grouped_conv_dispatch.RULES,
        *pointwise_conv_dispatch.RULES,
        *tap_conv_dispatch.RULES,
        *flash_attention.RULES,
    ],
    name="iree-performance",
)

#: the performance rules on by default for the GPU targets (`IreeTarget.name`); llvm-cpu's are per ISA
BY_TARGET: dict[str, RuleSet] = {
    "cuda": RuleSet([], name="iree-cuda-performance"),
    "rocm": RuleSet([], name="iree-rocm-performance"),
    "vulkan-spirv": RuleSet([attention_as_matmul_softmax], name="iree-vulkan-attention"),
}


@functools.cache  # one RuleSet per (target, isa): a backend's phase is found again by identity (benchmarks)
def for_target(target: str = "llvm-cpu", isa: str = "") -> RuleSet:
    """The performance rules on by default for compile target `target`: llvm-cpu's for vector ISA `isa`
    (`targets.CPU_ISAS[isa].perf_rules`, chosen by measurement; none for a CPU of no listed ISA), a GPU
    target's from `BY_TARGET`."""
    from fx_rewrites.backends.iree.targets import CPU_ISAS

    if target != "llvm-cpu":
        return BY_TARGET.get(target, RuleSet([], name=f"iree-{target}-performance"))
    names = CPU_ISAS[isa].perf_rules if isa in CPU_ISAS else ()
    return RuleSet([ALL[name] for name in names], name=f"iree-llvm-cpu-{isa or 'generic'}-performance")
