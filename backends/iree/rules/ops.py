"""IREE's first-phase pack: ops its importer or compiler cannot take (IREE 3.13).

Not part of DEFAULT: other backends may lower these ops themselves. With
this module's rules, `RULES` holds the hand-written lowerings of ops torch
cannot decompose (`lowerings`), the scatters that undo a view (`scatters`),
the MoE grouped matmul (`moe`) and the sorts of its expert ids
(`counting_sort`, `topk`). The legality-driven decomposition and
the guards against IREE's silent wrong results are the backend's second
phase (`legalize.LEGALIZE`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from fx_rewrites.backends.iree.rules import (
    arguments,
    attention,
    complex_fills,
    conv_tbc,
    counting_sort,
    empty,
    float_scalars,
    int_matmul,
    lowerings,
    mask_put,
    moe,
    scaled_mm,
    scatters,
    topk,
)
from fx_rewrites.backends.iree.rules.conv import conv_single_window_for_iree
from fx_rewrites.backends.iree.rules.pooling import known
from fx_rewrites.backends.iree.rules.unbatched import unbatched_window_op_for_iree
from fx_rewrites.engine import Miss, Rewriter
from fx_rewrites.kinds import Decompose, rule
from fx_rewrites.program import input_spec
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten

decompose_for_iree = Decompose(
    name="decompose_for_iree",
    ops=(aten.diff.default, aten._weight_norm.default, aten._weight_norm_interface.default),
    tags={"iree"},
    doc=(
        "aten.diff (GPT-2 / Llama mask code) and aten._weight_norm (wav2vec2, weight_norm "
        'parametrizations) decomposed into ops IREE lowers. IREE: "failed to legalize operation '
        '\'torch.operator\' that was explicitly marked illegal: ... torch.aten.diff" / "torch.aten._weight_norm".'
    ),
)

decompose_upsample_for_iree = Decompose(
    name="decompose_upsample_for_iree",
    ops=(
        aten.upsample_bilinear2d.vec,
        aten.upsample_bilinear2d.default,
        aten.upsample_bicubic2d.vec,
        aten.upsample_bicubic2d.default,
        aten._unsafe_index.Tensor,
    ),
    tags={"iree"},
    doc=(
        "Bilinear and bicubic F.interpolate (MobileViT, BEiT's and ViT's position-table resizing) "
        "decomposed into index arithmetic, and the decomposition's aten._unsafe_index into aten.index. "
        'IREE 3.13 lowers neither upsample op in any form: "failed to legalize operation '
        "'torch.constant.int'\" (or 'torch.constant.float' with scale_factor) at <unknown>:0; "
        "\"failed to legalize operation 'torch.operator' ... torch.aten._unsafe_index\". "
        "Nearest upsampling compiles and is left alone."
    ),
)

decompose_meshgrid_for_iree = Decompose(
    name="decompose_meshgrid_for_iree",
    ops=(aten.meshgrid.default, aten.meshgrid.indexing),
    # the ops' own composite kernels (views and expands); torch._decomp's entry leaves prims.broadcast_in_dim
    table={op: op.decompose for op in (aten.meshgrid.default, aten.meshgrid.indexing)},
    tags={"iree"},
    doc=(
        "torch.meshgrid (BEiT's relative position index, built in forward) decomposed into views and "
        "expands. IREE 3.13 imports it as a list it cannot type: \"'torch.aten.stack' ... operand types "
        'should have the same type as the list contained type" on the stack that reads its outputs.'
    ),
)

#: operator dunders and the bitwise ops IREE 3.13 cannot lower -> the Tensor overload IREE lowers
_BITWISE = {
    aten.__and__.Tensor: aten.bitwise_and.Tensor,
    aten.__and__.Scalar: aten.bitwise_and.Tensor,
    aten.__or__.Tensor: aten.bitwise_or.Tensor,
    aten.__or__.Scalar: aten.bitwise_or.Tensor,
    aten.bitwise_or.Scalar: aten.bitwise_or.Tensor,
    aten.__xor__.Tensor: aten.bitwise_xor.Tensor,
    aten.__xor__.Scalar: aten.bitwise_xor.Tensor,
    aten.bitwise_xor.Scalar: aten.bitwise_xor.Tensor,
}


@rule(
    roots=tuple(_BITWISE),
    tags={"iree"},
    doc=(
        "`a & b`, `a | b`, `a ^ b` on tensors export as aten.__and__/__or__/__xor__ (DeBERTa-v2's "
        "attention mask, GPT-2's and Llama's mask code); IREE 3.13 lowers aten.bitwise_and/or/xor.Tensor "
        "but not the dunders (except __or__.Tensor and __and__.Scalar) nor bitwise_or/xor.Scalar. They "
        "become the Tensor overload, a Scalar operand a 0-d tensor of the result's dtype. IREE: "
        "\"failed to legalize operation 'torch.aten.__and__.Tensor'\" / 'torch.aten.bitwise_or.Scalar'."
    ),
)
def bitwise_ops_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    x, other = args["self"], args["other"]
    if not isinstance(other, Node):  # a Scalar: promotion as the Scalar overload does it
        other = rw.call(aten.scalar_tensor.default, other, dtype=node.meta["val"].dtype)
    rw.replace(node, rw.call(_BITWISE[node.target], x, other))


#: op packets with a Tensor[] or Tensor?[] argument
_LIST_PACKETS = (
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
    "index", "_unsafe_index", "index_put", "_unsafe_index_put", "einsum", "broadcast_tensors",
    "meshgrid", "block_diag", "chain_matmul", "cartesian_prod",
)  # fmt: skip


def _tensor_list_args(op: Any) -> list[int]:
    """Positions of the schema's Tensor[] / Tensor?[] arguments."""
    positions = []
    for i, arg in enumerate(op._schema.arguments):
        t = arg.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if isinstance(t, torch.ListType):
            element = t.getElementType()
            if isinstance(element, torch.OptionalType):
                element = element.getElementType()
            if isinstance(element, torch.TensorType):
                positions.append(i)
    return positions


def _list_ops() -> dict[Any, list[int]]:
    ops: dict[Any, list[int]] = {}
    for name in _LIST_PACKETS:
        packet = getattr(aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            positions = _tensor_list_args(op)
            if positions and not op._schema.is_mutable:
                ops[op] = positions
    return ops


_LIST_OPS = _list_ops()
#: placeholders IREE's import_frozen_program replaces by the tensor itself
_FROZEN = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _frozen(value: Any) -> bool:
    if not isinstance(value, Node) or value.op != "placeholder":
        return False
    spec = input_spec(value)
    return spec is not None and spec.kind in _FROZEN


def _frozen_in_list(node: Node) -> bool | Miss:
    for i in _LIST_OPS[node.target]:
        items = node.args[i] if i < len(node.args) else node.kwargs.get(node.target._schema.arguments[i].name)
        if isinstance(items, (list, tuple)) and any(_frozen(v) for v in items):
            return True
    return Miss("no parameter, buffer or constant inside a tensor list")


@rule(
    roots=tuple(_LIST_OPS),
    when=_frozen_in_list,
    tags={"iree"},
    doc=(
        "A parameter, buffer or lifted constant inside a tensor-list argument (torch.einsum(eq, x, "
        "self.weight): XLNet, Funnel; table[:, self.index_buffer]: LeViT) is read through aten.clone. "
        "IREE's import_frozen_program puts the tensor itself in the list, which the importer rejects: "
        '"AssertionError: Heterogeneous lists are not supported: expected vtensor, got <class '
        "'torch.nn.parameter.Parameter'>\"."
    ),
)
def copy_frozen_tensor_in_list(node: Node, rw: Rewriter) -> Any:
    args, kwargs = list(node.args), dict(node.kwargs)
    clones: dict[Node, Node] = {}

    def read(value: Any) -> Any:
        if not _frozen(value):
            return value
        if value not in clones:
            clones[value] = rw.call(aten.clone.default, value)
        return clones[value]

    for i in _LIST_OPS[node.target]:
        if i < len(args):
            if isinstance(args[i], (list, tuple)):
                args[i] = [read(v) for v in args[i]]
        else:
            name = node.target._schema.arguments[i].name
            if isinstance(kwargs.get(name), (list, tuple)):
                kwargs[name] = [read(v) for v in kwargs[name]]
    rw.replace(node, rw.call(node.target, *args, **kwargs))


def _squeezed_dims(node: Node, args: Mapping[str, Any]) -> list[int] | Miss:
    """The dims squeeze `node` removes, when one of them is a Dim-sized size its range makes 1."""
    x = node.args[0].meta["val"]
    listed = args.get("dim", range(x.dim()))
    listed = [listed] if isinstance(listed, int) else list(listed)
    removed = sorted({d % x.dim() for d in listed if known(x.shape[d] == 1)} if x.dim() else set())
    if not any(not isinstance(x.shape[d], int) for d in removed):
        return Miss("no Dim-sized dim squeezed (IREE squeezes static 1s)")
    if x.dim() - len(removed) != node.meta["val"].dim():
        return Miss("a squeezed dim not provably 1 for every size the Dim range allows")
    return removed


@rule(
    roots=(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default),
    when=_squeezed_dims,
    tags={"iree"},
    doc=(
        "A squeeze of a dim whose size is a Dim expression the range makes 1 (`F.max_pool2d(x, 6).squeeze(-1)"
        ".squeeze(-1)` with h, w in [6, 11]: the pool is [b, c, h//6, w//6]) becomes a reshape to the kept sizes. "
        "IREE 3.13 lowers the squeeze to a collapse of the `?` dim into a static neighbour: \"'tensor."
        "collapse_shape' op expected dimension 1 of collapsed type to be dynamic\"."
    ),
)
def squeeze_dim_sized_one_for_iree(node: Node, rw: Rewriter, *, found: list[int]) -> Any:
    x = node.args[0]
    kept = [rw.size(x, d) for d in range(x.meta["val"].dim()) if d not in found]
    if not _known_contiguous(x.meta["val"]):  # reshape's fake kernel may guard on symbolic strides (conv.py)
        x = rw.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    rw.replace(node, rw.call(aten.reshape.default, x, kept))


def _known_contiguous(val: torch.Tensor) -> bool:
    """True when `val`'s strides are row-major for every size the Dim ranges allow."""
    expected: Any = 1
    for size, stride in zip(reversed(val.shape), reversed(val.stride())):
        if not known(size == 1) and not known(stride == expected):
            return False
        expected = expected * size
    return True


def _negative_index(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    index = args["index"]
    if not isinstance(index, int) or index >= 0:
        return Miss(f"index {index} is not a negative int")
    return True


@rule(
    roots=(aten.select_scatter.default,),
    when=_negative_index,
    tags={"iree"},
    doc=(
        "aten.select_scatter with a negative index (`y[:, -1] = s` after the in-place rule or aot_autograd's "
        "functionalization: Longformer's sliding-chunk attention) gets index + size (a sym_size node when the "
        "size is symbolic). IREE 3.13 compiles the negative index without complaint and writes the wrong "
        "slice: results differ from eager, no error."
    ),
)
def select_scatter_index_for_iree(node: Node, rw: Rewriter, *, args: Mapping[str, Any]) -> Any:
    dim = args["dim"]
    size = node.meta["val"].shape[dim]
    if isinstance(size, int):
        index = args["index"] + size
    else:
        index = rw.call(operator.add, rw.call(aten.sym_size.int, args["self"], dim), args["index"])
    rw.replace(node, rw.call(aten.select_scatter.default, args["self"], args["src"], dim, index))


RULES = RuleSet(
    [
        decompose_for_iree,
        decompose_upsample_for_iree,
        decompose_meshgrid_for_iree,
        bitwise_ops_for_iree,
        copy_frozen_tensor_in_list,
        conv_single_window_for_iree,
        unbatched_window_op_for_iree,
        squeeze_dim_sized_one_for_iree,
        select_scatter_index_for_iree,
        *arguments.RULES,
        *empty.RULES,
        *complex_fills.RULES,
        *float_scalars.RULES,
        *int_matmul.RULES,
        *conv_tbc.RULES,
        *mask_put.RULES,
        *scaled_mm.RULES,
        *lowerings.RULES,
        *scatters.RULES,
        *moe.RULES,
        *counting_sort.RULES,
        *topk.RULES,
        *attention.GUARDS,
    ],
    name="iree",
)
