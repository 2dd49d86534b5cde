"""Performance rules for IREE, per compile target, chosen by measurement.

Each rule rewrites a form IREE 3.13 compiles correctly but slowly into one it
compiles well, with the same numbers. `benchmarks/runtime.py` measures each
rule's gain (the model with the target's rules, and without that one rule);
a rule is in a target's default set only where that benchmark shows a gain
on every model it fires on (docs/performance.md has the table).

- `attention_as_matmul_softmax` (fx_rewrites.rules.attention): llvm-cpu.
  Its scores are scaled after `q @ k^T` and its softmax comes before `@ v`.
- `softmax_rows_as_2d`: llvm-cpu. A softmax over the last dim of a rank-3+
  tensor with 256 or more rows a matrix, not a power of two (Whisper's
  [4, 4, 500, 500] attention weights), runs up to 6x slower than the same
  softmax on its rows flattened to 2-D.
- `patch_conv_as_matmul`: llvm-cpu. A convolution whose stride is its
  kernel (ViT's 16x16 patch embedding) is a reshape and a matmul; IREE
  lowers the convolution 30x slower.
- `conv1d_as_matmul`: llvm-cpu. A 1-D convolution (Whisper's audio stem)
  is stacked shifted slices and one matmul; IREE's 1-D convolution runs at
  1 to 2 GFLOP/s.

GPU targets get no performance rule until one is measured there
(docs/performance.md, the GPU section). Vulkan needs attention written out
to compile at all: IREE 3.13's SPIR-V code generation cannot lower its
online attention ("failed to legalize ... iree_linalg_ext.online_attention").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites import schema
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import rule
from fx_rewrites.rules.attention import attention_as_matmul_softmax
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


# ----------------------------------------------------------------------------- softmax

#: softmax_rows_as_2d fires from this many rows a matrix (benchmarks/runtime.py: 500 rows (Whisper) gain 2.2x;
#: 128 and 197 rows (BERT, Llama, GPT-2, ViT) neither gain nor lose; 496 and 500 rows are slow, 512 is not)
MIN_ROWS = 256


def _softmax_rows(node: Node) -> bool | Miss:
    x = _val(node.args[0])
    if x.dim() < 3:
        return Miss("already 2-D or less")
    if node.args[1] not in (-1, x.dim() - 1):
        return Miss(f"softmax over dim {node.args[1]}, not the last")
    rows = x.shape[-2]
    if isinstance(rows, int) and (rows < MIN_ROWS or rows & (rows - 1) == 0):
        return Miss(f"{rows} rows a matrix: as fast flattened or not (measured below {MIN_ROWS}, at powers of two)")
    if not isinstance(x.shape[-1], int):
        return Miss("a symbolic softmax length")
    return True


@rule(
    roots=(aten._softmax.default, aten.softmax.int),
    name="softmax_rows_as_2d",
    when=_softmax_rows,
    tags={"iree", "performance"},
    doc=(
        "A softmax over the last dim of a rank-3+ tensor with 256 or more rows a matrix, not a power of two, "
        "runs as the softmax of its rows flattened to 2-D (reshape, softmax, reshape back). IREE 3.13 on "
        "llvm-cpu tiles [4, 4, 500, 500] badly: 6x slower than [8000, 500] (Whisper's attention: the model "
        "runs 2.2x faster); at 128 and 197 rows flattening changes nothing."
    ),
)
def softmax_rows_as_2d(node: Node, rw: Rewriter) -> Any:
    x = node.args[0]
    flat = rw.call(aten.reshape.default, x, [-1, _val(x).shape[-1]])
    out = rw.call(node.target, flat, -1, *node.args[2:], **node.kwargs)
    rw.replace(node, rw.call(aten.reshape.default, out, [rw.size(x, d) for d in range(_val(x).dim())]))


# ----------------------------------------------------------------------------- convolutions

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.convolution.default)


def _conv(node: Node) -> dict[str, Any]:
    """The convolution's arguments by name, spatial lists as long as the kernel's spatial dims."""
    named = schema.bind(node.target, node.args, dict(node.kwargs))
    spatial = _val(named["weight"]).dim() - 2
    out = {"input": named["input"], "weight": named["weight"], "bias": named.get("bias")}
    for key, default in (("stride", 1), ("padding", 0), ("dilation", 1)):
        value = named.get(key, [default])
        out[key] = list(value) * spatial if len(value) == 1 else list(value)
    out["groups"] = named.get("groups", 1)
    out["transposed"] = named.get("transposed", False)
    out["output_padding"] = list(named.get("output_padding", [0]))
    return out


def _plain_conv(c: dict[str, Any], spatial: int) -> bool | Miss:
    w = _val(c["weight"])
    if w.dim() - 2 != spatial:
        return Miss(f"a {w.dim() - 2}-D convolution")
    if _val(c["input"]).dim() != spatial + 2:
        return Miss("an unbatched input")
    if c["transposed"] or any(c["output_padding"]):
        return Miss("a transposed convolution")
    if c["groups"] != 1:
        return Miss(f"groups={c['groups']}")
    if not w.dtype.is_floating_point:
        return Miss(f"a {w.dtype} convolution")
    if not all(isinstance(s, int) for s in (*w.shape, *_val(c["input"]).shape[1:])):
        return Miss("symbolic channel or spatial sizes")
    return True


def _patch_conv(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    ok = _plain_conv(c, 2)
    if ok is not True:
        return ok
    kernel = list(_val(c["weight"]).shape[2:])
    if kernel == [1, 1]:
        # a pointwise convolution (MobileNet, ResNet's bottlenecks): not measured faster as a matmul, and the
        # matmul's other summation order moves deep BatchNorm nets (MobileNetV2) past 1e-5 of eager
        return Miss("a 1x1 convolution: not a patch embedding")
    if c["stride"] != kernel or any(c["padding"]) or any(d != 1 for d in c["dilation"]):
        return Miss(f"stride {c['stride']} and padding {c['padding']}: not non-overlapping {kernel} patches")
    return c


@rule(
    roots=_CONVS,
    name="patch_conv_as_matmul",
    when=_patch_conv,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A 2-D convolution whose stride is its kernel, without padding (ViT's and CLIP's patch embedding, "
        "16x16 stride 16) is a matmul of the image cut into patches: reshape to [N, C, H/kh, kh, W/kw, kw], "
        "permute, matmul by the weight as [O, C*kh*kw], back to [N, O, H/kh, W/kw]. IREE 3.13 on llvm-cpu "
        "runs the convolution 30x slower than that matmul (ViT: 105 ms of 419 ms)."
    ),
)
def patch_conv_as_matmul(node: Node, rw: Rewriter, c: dict[str, Any]) -> Any:
    x, w = c["input"], c["weight"]
    out_channels, channels, kh, kw = _val(w).shape
    height, width = _val(x).shape[2:]
    gh, gw = height // kh, width // kw
    if (gh * kh, gw * kw) != (height, width):  # the convolution drops the last partial patch
        x = rw.call(aten.slice.Tensor, x, 2, 0, gh * kh)
        x = rw.call(aten.slice.Tensor, x, 3, 0, gw * kw)
    patches = rw.call(aten.reshape.default, x, [-1, channels, gh, kh, gw, kw])
    patches = rw.call(aten.permute.default, patches, [0, 2, 4, 1, 3, 5])
    patches = rw.call(aten.reshape.default, patches, [-1, channels * kh * kw])
    weight = rw.call(aten.reshape.default, w, [out_channels, channels * kh * kw])
    y = rw.call(aten.linear.default, patches, weight, c["bias"])
    y = rw.call(aten.reshape.default, y, [-1, gh, gw, out_channels])
    rw.replace(node, rw.call(aten.permute.default, y, [0, 3, 1, 2]))


#: largest kernel conv1d_as_matmul expands (the input is copied once per tap)
MAX_TAPS = 16


def _conv1d(node: Node) -> dict[str, Any] | Miss:
    c = _conv(node)
    ok = _plain_conv(c, 1)
    if ok is not True:
        return ok
    taps = _val(c["weight"]).shape[2]
    if taps > MAX_TAPS:
        return Miss(f"a {taps}-tap kernel: the stacked input would be {taps} copies")
    if isinstance(c["padding"][0], str):
        return Miss(f"padding={c['padding'][0]!r}")
    return c


@rule(
    roots=_CONVS,
    name="conv1d_as_matmul",
    when=_conv1d,
    tags={"iree", "performance", "convolution"},
    doc=(
        "A 1-D convolution (Whisper's audio stem: kernel 3, stride 1 and 2) becomes the input padded, its k "
        "shifted strided slices stacked to [N, C*k, L_out] and one matmul by the weight as [O, C*k]. IREE "
        "3.13 on llvm-cpu runs 1-D convolutions at 1 to 2 GFLOP/s, the matmul at about 90."
    ),
)
def conv1d_as_matmul(node: Node, rw: Rewriter, c: dict[str, Any]) -> Any:
    x, w = c["input"], c["weight"]
    out_channels, channels, taps = _val(w).shape
    (stride,), (pad,), (dilation,) = c["stride"], c["padding"], c["dilation"]
    length = _val(x).shape[2] + 2 * pad
    out_length = (length - dilation * (taps - 1) - 1) // stride + 1
    if pad:
        x = rw.call(aten.constant_pad_nd.default, x, [pad, pad], 0.0)
    span = stride * (out_length - 1) + 1
    shifted = [rw.call(aten.slice.Tensor, x, 2, i * dilation, i * dilation + span, stride) for i in range(taps)]
    columns = rw.call(aten.stack.default, shifted, 2)  # [N, C, taps, L_out]
    columns = rw.call(aten.reshape.default, columns, [-1, channels * taps, out_length])
    columns = rw.call(aten.transpose.int, columns, 1, 2)  # [N, L_out, C*taps]
    weight = rw.call(aten.reshape.default, w, [out_channels, channels * taps])
    y = rw.call(aten.linear.default, columns, weight, c["bias"])
    # permute, not transpose.int: after a guard that cut a Dim-sized input to one window, the convolution's
    # users are typed [b, O, L//k] (the engine keeps the replaced value's sizes) while y is [b, 1, O]; IREE 3.13
    # lowers transpose.int to a linalg.transpose that rejects a static size typed dynamic, permute it casts
    rw.replace(node, rw.call(aten.permute.default, y, [0, 2, 1]))


#: every performance rule, by name (benchmarks/runtime.py measures each)
ALL = RuleSet(
    [attention_as_matmul_softmax, softmax_rows_as_2d, patch_conv_as_matmul, conv1d_as_matmul], name="iree-performance"
)

#: the performance rules on by default, per IREE compile target (`IreeTarget.name`)
BY_TARGET: dict[str, RuleSet] = {
    "llvm-cpu": RuleSet(ALL, name="iree-llvm-cpu-performance"),
    "cuda": RuleSet([], name="iree-cuda-performance"),
    "rocm": RuleSet([], name="iree-rocm-performance"),
    "vulkan-spirv": RuleSet([attention_as_matmul_softmax], name="iree-vulkan-attention"),
}
