"""A float32 linear through the hand-written matmul dispatch of its ISA's register block (issue 32; llvm-cpu).

    linear(x, W, b)   # x [..., K] over M rows (static), W [N, K] the program's own, N % S == 0
    -> f32_linear(x.reshape(M, K), pack(W, S), b, N, S / 8, PER), viewed [..., N]   (f32_matmul without a bias)

`linear_as_f32_dispatch` writes AVX2's 6x16 block (S = 16), `linear_as_f32_dispatch_avx512` AVX-512's 12x32 (S = 32;
`f32_dispatch.BLOCKS`). IREE 3.13 compiles every AVX2 float32 product to one 8x8x1 inner loop (one load and 8
broadcasts per 8 FMAs, whatever its flags or tuning specs: docs/iree-3.13-findings.md section 50); the kernel keeps a
6x16 block in 12 accumulators (2 loads and 6 broadcasts per 12 FMAs) with the weight laid out [N/16, K, 16], the bias
added in its first store of y. Alone on real Zen 3 it ran the linear 1024 -> 1024 over 128 rows and ViT's MLP products
in 0.57-0.62 of IREE's time (benchmarks/f32_dispatch.py); in the models, locked, the route without / with the rule
read ViT 1.41, BERT 1.32, Llama 1.25, the Whisper encoder 1.32 (docs/performance.md, "A float32 matmul kernel of our
own on AVX2"). The weight's layout is a view and permute of the weight in the graph: for the program's own weight IREE
evaluates it once (at compile time or in the module's initializer), so the rules take only such a weight
(`conv_taps.constant_weight`), also in conv1d_as_matmul's and patch_conv_as_matmul's layouts of it (Whisper's stem
and ViT's patches: 0.92-0.97x of the route without them; ConvNeXt-T level, docs/performance.md). The kernel is static
in its rows; on AVX-512 a linear over a `Dim` of rows (compile_lm's prefill) can take
`linear_over_rows_as_grouped_dispatch_avx512`: grouped_experts_dispatch.py's run-time-rows kernel (the same 12x32
block) with one group, the weight laid out [1, N/16, K, 16]. Off by default (not in `targets.CPU_ISAS`): 0.83-0.95x
the prefill of the 30B MoE layer and the 0.1B Llama, but the decode reads the weight as it is, so a module holds each
projection twice (docs/performance.md, "MoE prefill's experts as one dispatch over all experts").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree.f32_dispatch import BLOCKS, F32_LINEAR, F32_MATMUL, KU, PER
from fx_rewrites.backends.iree.grouped_experts_dispatch import GROUPED_PACKED_MATMUL
from fx_rewrites.backends.iree.packed_experts import STRIP
from fx_rewrites.backends.iree.rules.conv_taps import constant_weight
from fx_rewrites.backends.iree.rules.mlp_tiles import linear_args
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.engine.values import fake_value
from fx_rewrites.kinds import rule

aten = torch.ops.aten

#: the fewest rows taken: the kernel was measured from 128 rows (a decode's few rows read the whole weight per row:
#: IREE's matvec forms)
MIN_ROWS = 64


#: the layout ops a weight the program holds may pass through and stay one IREE evaluates once (conv1d_as_matmul's
#: weight: the convolution's [O, C, k] permuted to [O, k, C] and reshaped to [O, k C]; patch_conv_as_matmul's: [O, C,
#: kh, kw] reshaped); measured on the models they come from (the Whisper encoder, ViT), so only those two forms
_LAYOUT = (aten.permute.default, aten.reshape.default, aten.view.default)


def _held(w: Any) -> bool:
    """`w` is the program's own weight, or one of conv1d_as_matmul's or patch_conv_as_matmul's layouts of it: a 3-D
    weight permuted and reshaped, a 4-D one reshaped (not conv_as_im2col_matmul's permuted 4-D one: not measured)."""
    if constant_weight(w):
        return True
    ops = []
    while isinstance(w, Node) and w.op == "call_function" and w.target in _LAYOUT:
        ops.append(w.target)
        w = w.args[0]
    if not constant_weight(w):
        return False
    rank = fake_value(w).dim()
    permute, reshape = aten.permute.default, aten.reshape.default
    return (rank == 3 and ops == [reshape, permute]) or (rank == 4 and ops == [reshape])


def _f32_product(x: Node, w: Node, b: Node | None, strip: int, *, k_major: bool = False) -> dict[str, Any] | Miss:
    """The kernel's conditions on x [..., K] @ W (+ b): W [N, K], or [K, N] where `k_major`."""
    xv, wv = fake_value(x), fake_value(w)
    if xv.dtype != torch.float32 or wv.dtype != torch.float32:
        return Miss(f"{xv.dtype} x {wv.dtype}: the kernel is float32")
    if xv.dim() < 2 or wv.dim() != 2:
        return Miss(f"x of rank {xv.dim()}, a weight of rank {wv.dim()}")
    k, n = wv.shape if k_major else reversed(wv.shape)
    if b is not None and (
        not isinstance(b, Node) or fake_value(b).dtype != torch.float32 or tuple(fake_value(b).shape) != (n,)
    ):
        return Miss(f"a bias that is not a float32 tensor of the {n} channels")
    if not all(isinstance(s, int) for s in xv.shape):
        return Miss("a Dim in x's sizes: the kernel is static in its rows")
    rows = xv.shape[:-1].numel()
    if n % strip or k % KU:
        return Miss(f"{k} -> {n}: N a multiple of {strip}, K of {KU}")
    if rows < MIN_ROWS:
        return Miss(f"{rows} rows (from {MIN_ROWS})")
    return {"x": x, "w": w, "b": b, "rows": rows, "n": n, "k": k, "lead": list(xv.shape[:-1]), "k_major": k_major}


def _f32_linear(node: Node, strip: int) -> dict[str, Any] | Miss:
    x, w, b = linear_args(node)
    if not _held(w):
        return Miss("the weight is not the program's own: its layout would be rewritten at every call")
    return _f32_product(x, w, b, strip)


def _transposed(w: Any) -> Node | None:
    """The held weight W [N, K] where `w` is its transpose (`aten.t` or a [1, 0] permute: what aot_autograd makes of
    a linear for the torch.compile route, `addmm(b, x, t(W))` and `mm(x, t(W))`), else None."""
    if not isinstance(w, Node) or w.op != "call_function":
        return None
    if w.target is aten.t.default or (w.target is aten.permute.default and list(w.args[1]) == [1, 0]):
        return w.args[0] if constant_weight(w.args[0]) else None
    return None


def _f32_addmm(node: Node, strip: int) -> dict[str, Any] | Miss:
    """addmm(b, x, W) with W [K, N] the program's own (transformers' `Conv1D`: GPT-2's linears) as `_f32_linear`'s
    linear(x, W.T, b), mm(x, W) likewise without b; addmm(b, x, t(W)) and mm(x, t(W)) (aot_autograd's linear) as
    linear(x, W, b)."""
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return Miss("beta or alpha other than 1")
    b, (x, w) = (None, node.args[:2]) if node.target is aten.mm.default else (node.args[0], node.args[1:3])
    if constant_weight(w):
        return _f32_product(x, w, b, strip, k_major=True)
    held = _transposed(w)
    if held is None:
        return Miss("the weight is not the program's own: its layout would be rewritten at every call")
    return _f32_product(x, held, b, strip)


def _as_dispatch(node: Node, rw: Rewriter, found: dict[str, Any], strip: int) -> None:
    n, k, rows, b = found["n"], found["k"], found["rows"], found["b"]
    flat = rw.call(aten.reshape.default, found["x"], [rows, k])
    if found["k_major"]:  # W [K, N]: [K, N/S, S] -> [N/S, K, S]
        strips = rw.call(aten.reshape.default, found["w"], [k, n // strip, strip])
        packed = rw.call(aten.permute.default, strips, [1, 0, 2])
    else:  # W [N, K]: [N/S, S, K] -> [N/S, K, S]
        strips = rw.call(aten.reshape.default, found["w"], [n // strip, strip, k])
        packed = rw.call(aten.permute.default, strips, [0, 2, 1])
    packed = rw.call(aten.reshape.default, packed, [n * k])  # a copy: the strips contiguous
    tile = strip // 8
    if b is None:
        y = rw.call(F32_MATMUL, flat, packed, n, tile, PER)
    else:
        y = rw.call(F32_LINEAR, flat, packed, b, n, tile, PER)
    rw.replace(node, rw.call(aten.reshape.default, y, [*found["lead"], n]))


_AVX2, _AVX512 = BLOCKS["avx2"].strip, BLOCKS["avx512"].strip


@rule(
    roots=(aten.linear.default,),
    when=lambda node: _f32_linear(node, _AVX2),
    priority=2,  # before mlp_rows_padded_to_tiles: the kernel takes ViT's 788 rows as they are
    tags={"iree", "performance"},
    doc=(
        "A float32 linear over a static number of rows (at least 64) with a weight the program holds, N a multiple "
        "of 16, becomes the hand-written 6x16 AVX2 matmul dispatch (`fx_rewrites::f32_linear`, `f32_matmul` without "
        "a bias) over the weight laid out [N/16, K, 16], the bias added in its store: on AVX2 IREE 3.13's own "
        "product is an 8x8x1 kernel."
    ),
)
def linear_as_f32_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _as_dispatch(node, rw, found, _AVX2)


@rule(
    roots=(aten.linear.default,),
    when=lambda node: _f32_linear(node, _AVX512),
    priority=2,
    tags={"iree", "performance"},
    doc=(
        "AVX-512's form of `linear_as_f32_dispatch`: the 12x32 block in 24 zmm accumulators (`f32_dispatch.BLOCKS`), "
        "the weight laid out [N/32, K, 32], N a multiple of 32."
    ),
)
def linear_as_f32_dispatch_avx512(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _as_dispatch(node, rw, found, _AVX512)


@rule(
    roots=(aten.addmm.default, aten.mm.default),
    when=lambda node: _f32_addmm(node, _AVX2),
    priority=2,
    tags={"iree", "performance"},
    doc=(
        "`linear_as_f32_dispatch` for addmm(b, x, W) with W [K, N] the program's own (transformers' `Conv1D`, "
        "GPT-2's linears): the weight laid out [N/16, K, 16] from its [K, N] rows, the bias in the kernel's store; "
        "and mm(x, W) without one; and addmm(b, x, t(W)) and mm(x, t(W)) with W [N, K] the program's own (a "
        "linear as aot_autograd gives it to the torch.compile route, its weights frozen)."
    ),
)
def addmm_as_f32_dispatch(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _as_dispatch(node, rw, found, _AVX2)


@rule(
    roots=(aten.addmm.default, aten.mm.default),
    when=lambda node: _f32_addmm(node, _AVX512),
    priority=2,
    tags={"iree", "performance"},
    doc="AVX-512's form of `addmm_as_f32_dispatch`: the 12x32 block, the weight laid out [N/32, K, 32].",
)
def addmm_as_f32_dispatch_avx512(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    _as_dispatch(node, rw, found, _AVX512)


#: the ends of the one group: past any row count (the kernel clamps them to the rows)
_ALL_ROWS = 2**31 - 1


def _over_run_time_rows(node: Node) -> dict[str, Any] | Miss:
    x, w, b = linear_args(node)
    if not constant_weight(w):
        return Miss("the weight is not the program's own: its layout would be rewritten at every call")
    xv, wv = fake_value(x), fake_value(w)
    if xv.dtype != torch.float32 or wv.dtype != torch.float32 or xv.dim() < 2 or wv.dim() != 2:
        return Miss(f"{xv.dtype} x {wv.dtype}, ranks {xv.dim()} and {wv.dim()}: float32 x [..., K] @ [N, K].T")
    if all(isinstance(size, int) for size in xv.shape[:-1]) or not isinstance(xv.shape[-1], int):
        return Miss("no Dim in x's rows (static rows: linear_as_f32_dispatch_avx512)")
    n, k = wv.shape
    if n % _AVX512 or k % KU:
        return Miss(f"{k} -> {n}: N a multiple of {_AVX512}, K of {KU}")
    if b is not None and not (isinstance(b, Node) and fake_value(b).dtype == torch.float32):
        return Miss("a bias that is not a float32 tensor")
    return {"x": x, "w": w, "b": b, "n": n, "k": k, "lead": xv.dim() - 1}


@rule(
    roots=(aten.linear.default,),
    when=_over_run_time_rows,
    priority=2,
    tags={"iree", "performance"},
    doc=(
        "AVX-512: a float32 linear over a run-time row count (a Dim in x's leading sizes: compile_lm's prefill) with "
        "a weight the program holds, N a multiple of 32, becomes grouped_experts_dispatch.py's kernel with one "
        "group (`grouped_packed_matmul`: the 12x32 register block over the rows read at run time) over the weight "
        "laid out [1, N/16, K, 16]; a bias added after."
    ),
)
def linear_over_rows_as_grouped_dispatch_avx512(node: Node, rw: Rewriter, *, found: dict[str, Any]) -> Any:
    n, k, x = found["n"], found["k"], found["x"]
    lead = [rw.size(x, d) for d in range(found["lead"])]
    flat = rw.call(aten.reshape.default, x, [-1, k])
    strips = rw.call(aten.view.default, found["w"], [1, n // STRIP, STRIP, k])
    packed = rw.call(aten.transpose.int, strips, 2, 3)  # [1, N/16, K, 16]
    ends = rw.call(aten.full.default, [1], _ALL_ROWS, dtype=torch.int32, device=fake_value(x).device)
    y = rw.call(GROUPED_PACKED_MATMUL, flat, packed, ends, BLOCKS["avx512"].tile)
    if found["b"] is not None:
        y = rw.call(aten.add.Tensor, y, found["b"])
    rw.replace(node, rw.call(aten.reshape.default, y, [*lead, n]))


RULES = (
    linear_as_f32_dispatch,
    linear_as_f32_dispatch_avx512,
    addmm_as_f32_dispatch,
    addmm_as_f32_dispatch_avx512,
    linear_over_rows_as_grouped_dispatch_avx512,
)
