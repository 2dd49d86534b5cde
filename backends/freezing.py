"""Freezing for the torch.compile route: parameters and buffers bound once, as constants, not passed per call.

Dynamo lifts every parameter and buffer a graph reads into a graph input
(`inline_inbuilt_nn_modules`), so a backend that compiles the aot_autograd
graph as it comes sees weights as run-time inputs: IREE cannot pack a
convolution's weight it only sees at run time (benchmarks/dynamo_route.py,
one thread, AMD EPYC: a 64->64 3x3 conv on 56x56 takes 123 ms with its
weight an input, 3.1 ms frozen, 2.6 ms in eager; ResNet-50 2,290 ms, 226 ms
frozen, 116 ms in eager, 200 ms through the export route). For inference
graphs this module does what Inductor calls freezing
(`torch/_inductor/freezing.py`): the inputs that are a module's parameters or
buffers become attributes of the graph (`get_attr` nodes, which the IREE
import makes `torch.vtensor.literal`s), and the compiled callable no longer
takes them; the wrapper `Frozen` drops them from each call.

What is frozen (`freezable` at the dynamo level, `plan` at the aot level):

- only graphs aot_autograd hands to its inference compiler (traced under
  `torch.no_grad()`, or nothing in them requires grad); a training forward
  is never frozen;
- only inputs whose dynamo source is an nn.Module's parameter, buffer or
  tensor attribute (never a user input, nor a tensor marked with
  `torch._dynamo.mark_static_address`); a tensor-parallel weight (a DTensor,
  which aot_autograd passes as its local shard) freezes its local shard;
- not inputs the graph mutates (a buffer updated in forward, BatchNorm's
  running stats in train mode), or whose metadata it mutates, or that an
  output aliases: those stay inputs, as in Inductor.

The assumption, as with Inductor's freezing: the weights do not change
after the compile. Unlike Inductor, `Frozen` checks it: each call compares
every frozen tensor's identity and version counter (`Tensor._version`,
bumped by every in-place write: `load_state_dict`, `p.copy_()`, an
optimizer step) with what was compiled; on a change it warns and compiles
the graph again with the current values (a compile costs seconds to
minutes: weights that change between calls want freezing off). Opt out
with `FX_REWRITES_FREEZE=0` in the environment (read at each graph
compile), `dynamo_backend(..., freeze=False)`, or
`torch.compile(..., options={"freeze": False})`.

The frozen tensors are named by their dynamo source (`L['self']._modules
['conv']._parameters['weight']`) and kept on the graph under
`_frozen_<i>` attributes. The IREE import binds those of
`parameters.inline_limit()` bytes or more as IREE parameters served from the
tensors' own memory (`parameters.attribute_hooks`, keys the attribute
names), as the export route does with an ExportedProgram's state, and makes
the smaller ones `torch.vtensor.literal`s: the module text holds no large
weight (a 1B decoder's weights as literals were 7.6 GB of text, issue 25).

Eval batch norm (aot_autograd's `_native_batch_norm_legit_no_training`,
which the rules write as a sub, a mul and an add per channel) is folded
into the frozen convolution before it (`freezing_fold.fold_conv_affine`), as
Inductor's freezing does, and then a ReLU after a convolution dispatch of
the IREE backend into the dispatch's store (`fold_conv_relu`): what the
export route's rules do on its `batch_norm` (`batch_norm_into_pointwise_conv`,
`relu_into_pointwise_conv`). `FX_REWRITES_FOLD_BATCH_NORM=0` turns both off.
Measured off at first (IREE then fused the per-channel ops into its own
convolution's dispatch: ResNet-50 211.0 against 212.7 ms); with the
hand-written dispatches, which IREE fuses nothing into, ResNet-50 0.983 /
0.998x eager on AVX2 and 0.942 / 0.975x on AVX-512 with / without
(docs/performance.md, "A second host, both ISAs; the torch.compile route's
convolutions as the export route's").
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.fx import GraphModule

from fx_rewrites.backends.freezing_fold import fold_conv_affine, fold_conv_relu
from fx_rewrites.program import copy_graph_module

log = logging.getLogger(__name__)

#: the environment variable that turns freezing off ("0") for every fx-rewrites dynamo backend
ENV = "FX_REWRITES_FREEZE"

#: "0": do not fold eval batch norm (and a ReLU) into the frozen convolutions (`freezing_fold`; on by default)
FOLD_ENV = "FX_REWRITES_FOLD_BATCH_NORM"

#: the attribute prefix of a frozen tensor on the frozen graph module
ATTR = "_frozen_"


def enabled(option: bool | None) -> bool:
    """Whether to freeze: `option` when given, else `$FX_REWRITES_FREEZE` ("0" off; on by default)."""
    if option is not None:
        return option
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _is_plain_tensor(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        isinstance(value, torch.Tensor)
        and type(value) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
        and not isinstance(value, FakeTensor)
        and value.layout == torch.strided
        and value.is_contiguous()
    )


def _local_shard(value: Any) -> Any:
    """A DTensor's local shard (a tensor-parallel weight: what the rank's graph reads), else None."""
    from torch.distributed.tensor import DTensor

    return value._local_tensor if isinstance(value, DTensor) else None


def freezable(gm: GraphModule, example_inputs: Sequence[Any]) -> dict[int, tuple[str, torch.Tensor]]:
    """Dynamo graph inputs that are state of an nn.Module: input index -> (source name, the real tensor).

    Read off the placeholders' `_dynamo_source`: a parameter, buffer or tensor attribute of a module
    (specialized or not, FSDP excluded). Empty when the inputs are not what dynamo gives (nested
    lists, fake tensors)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs) or any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return {}
    state = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        source = getattr(node, "_dynamo_source", None)
        if source is None or not (_is_plain_tensor(value) or _is_plain_tensor(_local_shard(value))):
            continue
        guard = source.guard_source
        guard = guard() if callable(guard) else guard
        if guard.is_fsdp_module() or not (guard.is_unspecialized_nn_module() or guard.is_specialized_nn_module()):
            continue
        state[i] = (source.name if isinstance(source.name, str) else source.name(), value)
    return state


def plan(gm: GraphModule, state: dict[int, tuple[str, torch.Tensor]]) -> dict[int, tuple[str, torch.Tensor]]:
    """Which placeholders of the aot_autograd inference graph `gm` to freeze: placeholder position ->
    (name, tensor), from `state` (`freezable` of the dynamo graph).

    aot_autograd's placeholders name the dynamo input they are (`meta["desc"]`, a `PlainAOTInput`);
    its `fw_metadata` (on the tracing context) says which inputs the graph mutates and which an
    output aliases: those are not frozen. Anything unexpected (effect tokens, subclass inputs, no
    tracing context, a shape that differs) freezes nothing."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput, SubclassGetAttrAOTInput
    from torch._functorch._aot_autograd.schemas import MutationType

    if not state:
        return {}
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return {}
    kept = {o.base_idx for o in meta.output_info if o.base_idx is not None}
    for i, info in enumerate(meta.input_info):
        if info.mutation_type != MutationType.NOT_MUTATED or info.mutates_metadata or info.mutates_storage_metadata:
            kept.add(i)
    placeholders = gm.graph.find_nodes(op="placeholder")
    descs = [n.meta.get("desc") for n in placeholders]
    if not all(isinstance(d, (PlainAOTInput, SubclassGetAttrAOTInput)) for d in descs):
        return {}
    frozen = {}
    for position, (node, desc) in enumerate(zip(placeholders, descs, strict=True)):
        # a tensor-parallel weight (DTensor) reaches the graph as its local shard
        shard = isinstance(desc, SubclassGetAttrAOTInput)
        if shard and not (isinstance(desc.base, PlainAOTInput) and desc.attr == "_local_tensor"):
            continue
        idx = desc.base.idx if shard else desc.idx
        if idx not in state or idx in kept or idx >= len(meta.input_info):
            continue
        name, tensor = state[idx]
        tensor = _local_shard(tensor) if shard else tensor
        if tensor is None or not _is_plain_tensor(tensor):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.shape != tensor.shape or val.dtype != tensor.dtype:
            return {}  # not the tensor we think it is: freeze nothing
        frozen[position] = (name, tensor)
    return frozen


def freeze(gm: GraphModule, frozen: dict[int, tuple[str, torch.Tensor]]) -> GraphModule:
    """A copy of `gm` whose placeholders at the positions of `frozen` read tensor attributes
    (`_frozen_<k>`, the current values of the tensors) instead; the other placeholders keep their order."""
    new = copy_graph_module(gm)
    graph = new.graph
    placeholders = graph.find_nodes(op="placeholder")
    body = next(n for n in graph.nodes if n.op != "placeholder")  # the output node at the latest
    for k, position in enumerate(sorted(frozen)):
        node = placeholders[position]
        attr = f"{ATTR}{k}"
        new.register_buffer(attr, frozen[position][1].detach(), persistent=False)
        with graph.inserting_before(body):
            constant = graph.get_attr(attr)
        constant.meta = dict(node.meta)
        constant.meta.pop("desc", None)
        node.replace_all_uses_with(constant)
        graph.erase_node(node)
    graph.lint()
    new.recompile()
    return new


def _stamp(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor._version, tensor.data_ptr()


@attrs.define(eq=False)
class Frozen:
    """The compiled callable of a frozen graph, called with every input of the unfrozen graph.

    `build(frozen_graph)` compiles a graph (the backend's `compile`); `graph` is the unfrozen
    one, `positions` the placeholders frozen, `names` their dynamo sources; `rewrite`, where given,
    rewrites the frozen graph first (the backend's rules, which then see the weights as the graph's
    own). Each call drops the frozen inputs, after checking they are the tensors, at the version,
    that were compiled in."""

    graph: GraphModule
    positions: tuple[int, ...]
    names: tuple[str, ...]
    build: Callable[[GraphModule], Any]
    tensors: list[torch.Tensor] = attrs.field(repr=False)
    compiled: Any = attrs.field(default=None, repr=False)
    frozen_graph: GraphModule | None = attrs.field(default=None, repr=False)
    stamps: list[tuple[int, int]] = attrs.field(factory=list, repr=False)
    keep: tuple[int, ...] = ()
    recompiles: int = 0
    #: the frozen graph rewritten before the folds and `build` (None: as frozen)
    rewrite: Callable[[GraphModule], GraphModule] | None = attrs.field(default=None, repr=False)
    #: fold per-channel affine ops (eval batch norm) into the frozen convolutions (`freezing_fold`)
    fold: bool = attrs.field(factory=lambda: os.environ.get(FOLD_ENV, "1").strip() != "0")

    @classmethod
    def make(
        cls,
        graph: GraphModule,
        frozen: dict[int, tuple[str, torch.Tensor]],
        build: Callable[[GraphModule], Any],
        rewrite: Callable[[GraphModule], GraphModule] | None = None,
    ) -> Frozen:
        positions = tuple(sorted(frozen))
        count = len(graph.graph.find_nodes(op="placeholder"))
        self = cls(
            graph,
            positions,
            tuple(frozen[p][0] for p in positions),
            build,
            [frozen[p][1] for p in positions],
            keep=tuple(i for i in range(count) if i not in frozen),
            rewrite=rewrite,
        )
        self._compile()
        return self

    def _compile(self) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # aot_autograd calls its compilers under its fake mode; the frozen values are real tensors
        with unset_fake_temporarily():
            frozen = dict(zip(self.positions, zip(self.names, self.tensors, strict=True), strict=True))
            self.frozen_graph = freeze(self.graph, frozen)
            if self.rewrite is not None:
                self.frozen_graph = self.rewrite(self.frozen_graph)
            if self.fold:
                fold_conv_affine(self.frozen_graph)  # eval batch norm into the frozen conv weights
                fold_conv_relu(self.frozen_graph)  # then a ReLU into a convolution dispatch's store
            release = getattr(self.compiled, "release", None)
            self.compiled = self.build(self.frozen_graph)
        if callable(release):
            release()
        self.stamps = [_stamp(t) for t in self.tensors]

    def _changed(self, args: Sequence[Any]) -> list[int]:
        return [
            k
            for k, (p, t, s) in enumerate(zip(self.positions, self.tensors, self.stamps, strict=True))
            if args[p] is not t or _stamp(t) != s
        ]

    def __call__(self, *args: Any) -> Any:
        changed = self._changed(args)
        if changed:
            names = ", ".join(self.names[k] for k in changed[:3]) + (" ..." if len(changed) > 3 else "")
            warnings.warn(
                f"{len(changed)} frozen parameter(s)/buffer(s) changed since this graph was compiled ({names}): "
                f"compiling it again with the current values. Weights that change between calls want freezing "
                f"off: {ENV}=0, or torch.compile(..., options={{'freeze': False}})",
                stacklevel=2,
            )
            for k in changed:
                self.tensors[k] = args[self.positions[k]]
            self.recompiles += 1
            self._compile()
        return self.compiled(*(args[i] for i in self.keep))

    def release(self) -> None:
        release = getattr(self.compiled, "release", None)
        if callable(release):
            release()


__all__ = ["ATTR", "ENV", "FOLD_ENV", "Frozen", "enabled", "freezable", "freeze", "plan"]
