"""Forms IREE 3.13 compiles and computes WRONG, refused before compiling.

A wrong number is worse than an error. The IREE rules rewrite these forms
into ones IREE computes right (the legalize phase's decompositions and the
guards in `fx_rewrites.backends.iree.rules.guards`); what is still in the graph when
`IreeBackend.compile` sees it (a program compiled without the rules, or a
form the rules could not rewrite) is refused with an `IreeUnsupportedError`
that names the node, the op, what IREE gets wrong and the fix. Each entry
was measured on the OpInfo corpus (docs/opinfo.md); each has a test showing
IREE wrong on it (tests/backends/iree/rules/test_wrong_forms.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fx_rewrites import schema
from fx_rewrites.backends.iree.errors import IreeUnsupportedError
from fx_rewrites.backends.iree.legality import WRONG_IN_SOME_FORMS
from fx_rewrites.backends.iree.rules import live_scatters
from fx_rewrites.backends.iree.rules.conv import conv_one_window_dims, conv_single_window_for_iree
from fx_rewrites.backends.iree.rules.counting_sort import counting_sort_for_iree
from fx_rewrites.backends.iree.rules.guards import (
    empty_variance,
    empty_variance_for_iree,
    instance_norm_input_stats_for_iree,
    negative_pad_to_slice_for_iree,
)
from fx_rewrites.backends.iree.rules.lowerings import logcumsumexp_to_masked_logsumexp_for_iree
from fx_rewrites.backends.iree.rules.pooling import POOLS_BY_RANK, one_window_dims, pool_single_window_for_iree
from fx_rewrites.backends.iree.rules.topk import (
    shares_an_iota,
    sort_as_ranks_for_iree,
    topk_as_ranks_for_iree,
)
from fx_rewrites.backends.iree.rules.views import (
    diagonal_as_gather_for_iree,
    index_put_of_itself_for_iree,
    read_elsewhere,
    reads_destination,
    slice_scatter_of_itself_for_iree,
    writes_whole_tensor,
)
from fx_rewrites.engine import Miss

aten = torch.ops.aten

APPLY = "apply the backend's rules first: `fx_rewrites.apply(program, fx_rewrites.backends.get('iree').rules)`"


def _decomposed_by_rules(node: Node) -> str:
    return f"{WRONG_IN_SOME_FORMS[schema.op_name(node.target)]}; fix: {APPLY}, which decompose it"


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not all(isinstance(s, int) for s in value.shape)


def _bag_weights(node: Node) -> str:
    named = schema.arguments(node)
    if named.get("per_sample_weights") is None:
        return ""
    return (
        "wrong numbers with per_sample_weights (nn.functional.embedding_bag, mode='sum': max abs diff 65.6); "
        "torch has no decomposition of it; fix: weight the rows yourself, "
        "`(F.embedding(indices, weight) * per_sample_weights.unsqueeze(-1))` summed per bag"
    )


def _instance_norm(node: Node) -> str:
    if not _symbolic(node.args[0].meta.get("val")):
        return ""
    return f"wrong numbers with dynamic sizes (max abs diff 11); fix: {APPLY}, which decompose it"


def _empty_variance(node: Node) -> str:
    if isinstance(empty_variance(node), Miss):
        return ""
    return f"a number instead of torch's NaN on an empty input; fix: {APPLY}, which give NaN"


def _logcumsumexp(node: Node) -> str:
    return (
        "wrong numbers (inf where torch is finite); fix: "
        f"{APPLY}: with static sizes they lower it to a masked logsumexp; with a dynamic size along the "
        "scanned dim nothing does, so export that dim static"
    )


def _negative_pad(node: Node) -> str:
    named = schema.arguments(node)
    pads = named.get("pad", named.get("padding", ()))
    if not any(isinstance(p, int) and p < 0 for p in pads):
        return ""
    return (
        "a negative pad (a crop) comes back uncropped or of the wrong shape; fix: crop with slicing "
        f"(x[..., a:-b]) before padding; {APPLY}: they do so where torch accepts the pad of the cropped tensor"
    )


#: readers that pad what they read (the convolutions with a nonzero `padding`)
_PADS = {aten.pad.default, aten.constant_pad_nd.default}
_CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}


def _padded(node: Node) -> bool:
    for user in node.users:
        if user.target in _PADS:
            return True
        if user.target in _CONVOLUTIONS:
            padding = schema.arguments(user).get("padding", 0)
            if padding not in (0, "valid") and any(
                p != 0 for p in ([padding] if isinstance(padding, int) else padding)
            ):
                return True
    return False


def _into_itself(node: Node) -> str:
    named = schema.arguments(node)
    dest = named["self"]
    source = named.get("src", named.get("values", named.get("value")))
    if reads_destination(dest, source):
        if node.target == aten.slice_scatter.default and writes_whole_tensor(node):
            return ""  # the write-back through a view (`y[:, -1] = s` on a slice of y): no shifted range measured wrong
        return (
            "its source reads the tensor it writes into (MBart's `y[:, 1:] = y[:, :-1].clone()`): IREE copies in "
            "place, so shifted positions get the first element, or it fails at run time ('source and target "
            f"ranges must not overlap'); fix: {APPLY}, which write into a fresh tensor"
        )
    if read_elsewhere(node, dest) and _padded(node):
        what = (
            f"the tensor it writes into ({dest.name}) is read elsewhere too and the result is padded: IREE "
            f"writes it in place, so {dest.name} is read back with the scattered values in it; fix: "
        )
        dtype = dest.meta["val"].dtype
        if node.target == aten.scatter_reduce.two and not dtype.is_floating_point:
            return what + (
                f"the rules guard a floating-point scatter_reduce only, not {dtype}: scatter_reduce into a tensor "
                "nothing else reads, or in float"
            )
        return what + f"{APPLY}, which write into a fresh tensor"
    return ""


def _diagonal_of_a_read_tensor(node: Node) -> str:
    source = node.args[0]
    if isinstance(diagonal_as_gather_for_iree.evaluate_when(node), Miss) or not read_elsewhere(node, source):
        return ""
    return (
        f"a diagonal of a tensor that is read elsewhere too ({source.name}): IREE returns that tensor wrong when "
        "the diagonal is read by a broadcast `where` (docs/iree-3.13-findings.md, section 13; other readers "
        f"not characterised); fix: {APPLY}, which take the diagonal by a gather"
    )


def _one_window(node: Node) -> str:
    dims = one_window_dims(node)
    x = node.args[0].meta["val"] if dims else None
    if x is None or all(isinstance(x.shape[d - POOLS_BY_RANK[node.target]], int) for d in dims):
        return ""  # static sizes: IREE fails to compile it, no wrong number
    what = (
        "one window over a longer map along a Dim-sized dim (the output is 1 for every size the range allows, "
        "`F.max_pool2d(x, 6)` on h in [6, 11]): with a user typed 1 IREE gives wrong values or indices, or a "
        "run-time shape error, for every size but the window's"
    )
    missed = pool_single_window_for_iree.evaluate_when(node)
    if not isinstance(missed, Miss):
        return f"{what}; fix: {APPLY}, which cut the input to the window"
    return (
        f"{what}; no rule rewrites this form ({missed.reason}); fix: cut the input to what the window reads "
        "before pooling (`x[..., :k]`), or export those dims static"
    )


def _conv_one_window(node: Node) -> str:
    dims = conv_one_window_dims(node)
    if not dims:
        return ""
    x, n = node.args[0].meta["val"], node.args[1].meta["val"].dim() - 2
    if all(isinstance(x.shape[x.dim() - n + d], int) for d in dims):
        return ""  # static sizes: IREE fails to compile it, no wrong number
    what = (
        "one window over a longer map along a Dim-sized dim (the output is 1 for every size the range allows, "
        "`F.conv2d(x, w, stride=4, padding=1)` with a 5x5 kernel on h in [3, 6]): with a user typed 1 IREE gives "
        "wrong values, or a run-time shape error, for every size but the window's"
    )
    missed = conv_single_window_for_iree.evaluate_when(node)
    if not isinstance(missed, Miss):
        return f"{what}; fix: {APPLY}, which cut the input to the window"
    return f"{what}; no rule rewrites this form ({missed.reason}); fix: export those dims static"


def _shared_iota(node: Node) -> str:
    other = shares_an_iota(node)
    if other is None:
        return ""
    what = (
        f"it sorts an iota of indices in place, and {other.name!r} ({schema.op_name(other.target)}) of the same "
        "shape shares that iota: the second's indices come back wrong (an MoE router per layer; "
        "docs/iree-3.13-findings.md, section 22)"
    )
    if node.target is not aten.topk.default and not isinstance(counting_sort_for_iree.evaluate_when(node), Miss):
        return f"{what}; fix: {APPLY}, which write it as a counting sort"
    guard = topk_as_ranks_for_iree if node.target is aten.topk.default else sort_as_ranks_for_iree
    missed = guard.evaluate_when(node)
    if not isinstance(missed, Miss):
        return f"{what}; fix: {APPLY}, which write it as ranks"
    return (
        f"{what}; no rule rewrites this form ({missed.reason}); fix: sort tensors of different shapes, or "
        "compile the sorts as separate programs"
    )


#: (a guard, what is wrong with a node of its roots in the form it rewrites): the refusal's ops are the guard's own
#: roots, so the two cannot drift apart
_GUARDED: tuple[tuple[Any, Callable[[Node], str]], ...] = (
    (empty_variance_for_iree, _empty_variance),
    (instance_norm_input_stats_for_iree, _instance_norm),
    (negative_pad_to_slice_for_iree, _negative_pad),
    (logcumsumexp_to_masked_logsumexp_for_iree, _logcumsumexp),
    (pool_single_window_for_iree, _one_window),
    (conv_single_window_for_iree, _conv_one_window),
    (diagonal_as_gather_for_iree, _diagonal_of_a_read_tensor),
    (slice_scatter_of_itself_for_iree, _into_itself),
    (index_put_of_itself_for_iree, _into_itself),
    (topk_as_ranks_for_iree, _shared_iota),
    (sort_as_ranks_for_iree, _shared_iota),
    *((guard, _into_itself) for guard in live_scatters.RULES),
)

#: forms no guard rewrites, refused with the fix a user can make
_UNGUARDED: dict[Any, Callable[[Node], str]] = {
    **{op: _decomposed_by_rules for name in WRONG_IN_SOME_FORMS for op in schema.resolve_op(name)},
    **dict.fromkeys(
        (
            aten.embedding_bag.default,
            aten.embedding_bag.padding_idx,
            aten._embedding_bag.default,
            aten._embedding_bag_forward_only.default,
        ),
        _bag_weights,
    ),
    **dict.fromkeys(
        (aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default), _negative_pad
    ),
}

#: op -> why IREE computes this node wrong ("" when the node's form is computed right)
_CHECKS: dict[Any, Callable[[Node], str]] = {
    **_UNGUARDED,
    **{op: check for guard, check in _GUARDED for op in guard.roots},
}


def nodes_failing(gm: GraphModule, checks: Mapping[Any, Callable[[Node], str]]) -> list[tuple[Node, str]]:
    """(node, why) for every call of `gm` whose op's check in `checks` says why ("" when the node is fine)."""
    found = []
    for node in gm.graph.nodes:
        check = checks.get(node.target) if node.op == "call_function" else None
        why = check(node) if check is not None else ""
        if why:
            found.append((node, why))
    return found


def raise_first(found: list[tuple[Node, str]], what: str, after: str = "") -> None:
    """Raise `IreeUnsupportedError` for the first of `found`: "IREE 3.13 {what} <op> (node ...): why{after}"."""
    if found:
        node, why = found[0]
        more = f" ({len(found) - 1} more such node(s))" if len(found) > 1 else ""
        op = schema.op_name(node.target)
        raise IreeUnsupportedError(f"IREE 3.13 {what.format(op=op, node=node.name)}: {why}{more}.{after}")


def wrong_forms(gm: GraphModule) -> list[tuple[Node, str]]:
    """(node, why) for every node of `gm` in a form IREE 3.13 computes wrong."""
    return nodes_failing(gm, _CHECKS)


def refuse(gm: GraphModule) -> None:
    """Raise `IreeUnsupportedError` naming the first node IREE 3.13 would compute wrong."""
    raise_first(
        wrong_forms(gm),
        "computes {op} (node {node!r}) wrong in this form",
        " Refused rather than giving wrong numbers.",
    )
