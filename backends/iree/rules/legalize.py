"""IREE's legalize phase: what IREE cannot lower (measured, `legality`) decomposed, then the guards.

The last phase of the IREE backend's rules (after DEFAULT and `ops`): legality-driven
decomposition (`fx_rewrites.kinds.legalize`) of every op IREE 3.13 fails on, the
forms of partly lowered ops it fails on, and the guards against its silent wrong
results, on forms from export and from decompositions alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from fx_rewrites.backends.iree import legality_data
from fx_rewrites.backends.iree.legality import illegal_ops
from fx_rewrites.backends.iree.rules import (
    adaptive_max_indices,
    byte_casts,
    float32_trig,
    float64_atan,
    float64_math,
    guards,
    libm_forms,
    live_scatters,
    nan_guards,
    one_value_where,
    pooling,
    steps,
    views,
)
from fx_rewrites.engine import Miss
from fx_rewrites.kinds.legalize import legalize, legalize_form
from fx_rewrites.rules.symbolic import sym_arithmetic_constant
from fx_rewrites.ruleset import RuleSet

#: the rule decomposing every illegal op torch can decompose
LEGALIZE_FOR_IREE = legalize(
    illegal_ops(),
    name="legalize_for_iree",
    backend=f"IREE {legality_data.IREE_VERSION}",
    lowered=legality_data.LOWERED,
    tags={"iree"},
)


def _reflect_pad(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    if node.target is not torch.ops.aten.pad.default:
        return True  # aten.reflection_pad1d/2d/3d
    mode = args.get("mode", "constant")
    return True if mode == "reflect" else Miss(f"mode={mode!r} (IREE lowers it)")


def _eval_batch_norm(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    if args["training"] is not False:
        return Miss("training=True (IREE lowers it)")
    if args["input"].meta["val"].dim() == 4:
        return Miss("a 4-d input (IREE lowers it)")
    return True


def _global_pool_of_symbolic_map(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    if all(isinstance(size, int) for size in args["self"].meta["val"].shape[-2:]):
        return Miss("static map sizes (IREE lowers it)")
    if list(args["output_size"]) != [1, 1]:
        # torch's decomposition picks its other branches by `h % out == 0` on the example sizes (a guard that
        # would specialise the Dims); IREE fails to compile these (an error, not a wrong number)
        return Miss(f"output size {list(args['output_size'])}: only (1, 1) decomposes without specialising")
    return True


def _float64_result(node: Node, args: Mapping[str, Any]) -> bool | Miss:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float64:
        return Miss("not float64 (IREE's float32 linspace was not measured wrong)")
    return True


#: forms of ops IREE 3.13 lowers in other forms (legality_data.PARTIAL), decomposed in just those forms
PARTIAL_FORMS = (
    legalize_form(
        (torch.ops.aten.pad.default, *(getattr(torch.ops.aten, f"reflection_pad{n}d").default for n in (1, 2, 3))),
        when=_reflect_pad,
        name="decompose_reflect_pad_for_iree",
        doc=(
            "F.pad(mode='reflect') (exported as aten.pad) replaced by torch's decomposition, down to index "
            'arithmetic. IREE 3.13 fails on it: 5-d (reflection_pad3d) "failed to legalize operation '
            "'torch.constant.int'\", 4-d with an asymmetric pad \"LLVM Translation failed for operation: "
            'builtin.unrealized_conversion_cast".'
        ),
        illegal=illegal_ops(),
        lowered=legality_data.LOWERED,
        tags={"iree"},
    ),
    legalize_form(
        (torch.ops.aten.linspace.default,),
        when=_float64_result,
        name="decompose_float64_linspace_for_iree",
        doc=(
            "aten.linspace of float64 (also what torch.logspace exports to) replaced by torch's decomposition "
            "(an arange scaled in float64). IREE 3.13 computes float64 linspace to float32's precision: "
            "linspace(0, -4, 4) 7.9e-8 off, logspace(0, -4, 4) 4.2e-9 (a silent wrong number)."
        ),
        illegal=illegal_ops(),
        lowered=legality_data.LOWERED,
        tags={"iree"},
    ),
    legalize_form(
        (torch.ops.aten.native_batch_norm.default,),
        when=_eval_batch_norm,
        name="decompose_eval_batch_norm_for_iree",
        doc=(
            "aten.native_batch_norm with training=False on an input other than 4-d (the aot / torch.compile "
            "route's eval batch norm) replaced by torch's decomposition. IREE 3.13 fails on a 3-d input: "
            "\"'tensor.cast' op operand type 'tensor<3xf32>' and result type ... are cast incompatible\"."
        ),
        illegal=illegal_ops(),
        lowered=legality_data.LOWERED,
        tags={"iree"},
    ),
    legalize_form(
        (torch.ops.aten.adaptive_max_pool2d.default,),
        when=_global_pool_of_symbolic_map,
        name="decompose_adaptive_max_pool2d_for_iree",
        doc=(
            "aten.adaptive_max_pool2d to (1, 1) of a map with a Dim-sized height or width replaced by torch's "
            "decomposition (amax, and argmax of the flattened map). IREE 3.13 fails to compile it, with "
            'indices or without, for any output size: "failed to legalize operation '
            "'torch.aten.max_pool2d'\" (torch-mlir writes it as a max_pool2d whose window it cannot type)."
        ),
        illegal=illegal_ops(),
        lowered=legality_data.LOWERED,
        tags={"iree"},
    ),
)

#: the last phase of the IREE backend's rules: legality-driven decomposition, and the guards against IREE's
#: silent wrong results (on forms from export and from decompositions alike)
LEGALIZE = RuleSet(
    [
        LEGALIZE_FOR_IREE,
        *PARTIAL_FORMS,
        *guards.RULES,
        *views.RULES,
        *live_scatters.RULES,
        *steps.RULES,
        *pooling.RULES,
        *adaptive_max_indices.RULES,
        *float64_math.RULES,
        *float64_atan.RULES,
        *float32_trig.RULES,
        *libm_forms.RULES,
        *nan_guards.RULES,
        *byte_casts.RULES,
        *one_value_where.RULES,
        # size arithmetic this phase's rewrites leave constant (adaptive pooling's `0 * size // 2`): folded here
        # too, as the first phase folds the export's (IREE has no lowering for `aten.fmod.int`)
        sym_arithmetic_constant,
    ],
    name="iree-legalize",
)
