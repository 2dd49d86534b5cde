"""torch-dialect MLIR of a graph `preparing` made ready: IREE's FX importer, its nodes named in every diagnostic.

`import_mlir` imports an `ExportedProgram` from `preparing.prepare_program` (frozen state as constants or the
hooks' parameters; mutated state as module globals, `state.wrap_state`) or a `GraphModule` from
`preparing.prepare_graph_module` (its tensor attributes inlined as literals).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx_rewrites.backends.iree.assumptions import binds, shape_options
from fx_rewrites.backends.iree.errors import import_error
from fx_rewrites.backends.iree.state import BODY, StateGlobals, wrap_state

INSTALL_HINT = "pip install -e '.[iree]'  (iree-base-compiler and iree-base-runtime)"

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line ([0-9]+),')


def iree_modules() -> Any:
    """The iree modules this backend uses, imported on first use."""
    try:
        import iree.compiler
        import iree.compiler.extras.fx_importer
        import iree.compiler.ir
        import iree.compiler.tools.core
        import iree.runtime
    except ImportError as e:
        raise ImportError(f"the IREE backend needs the iree packages ({e}); install them: {INSTALL_HINT}") from e
    return iree


def _in_a_list(user: Node, node: Node) -> bool:
    """Whether `node` is an item of a list or tuple argument of `user` (aten.index's indices, cat's tensors)."""
    return any(
        isinstance(a, (list, tuple)) and any(item is node for item in a) for a in (*user.args, *user.kwargs.values())
    )


def _inline_tensor_attributes(gm: GraphModule) -> None:
    """Replace each `get_attr` of a tensor (a frozen parameter, `backends/freezing.py`) by the tensor
    itself, the form `import_frozen_program` gives the importer: it becomes a `torch.vtensor.literal`,
    or whatever the hooks' `resolve_literal` makes of it (the stateless import binds no get_attr). Where
    it is an item of a list argument (Swin's `table[self.relative_position_index]`), it is read through
    aten.clone: the importer rejects a literal inside a list ("Heterogeneous lists are not supported"),
    as the IREE pack's `copy_frozen_tensor_in_list` does for an ExportedProgram's frozen state."""
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, str(node.target), None)
        if not isinstance(value, torch.Tensor):
            continue
        for user in [u for u in node.users if _in_a_list(u, node)]:
            with gm.graph.inserting_before(user):
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
            copy.meta["val"] = node.meta.get("val")
            user.replace_input_with(node, copy)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)


# ----------------------------------------------------------------------------- import


def pinning_ref_tracker(fx_importer: Any) -> Any:
    """A `RefTracker` for one import that keeps every object it tracks alive until the import is dropped.

    IREE 3.13's tracker maps id(tensor) -> the literal made from it, with a
    weak reference and no finalizer (iree-turbine issue 281), and the importer
    hands it temporaries: each bool constant is imported as `t.to(torch.uint8)`.
    Once one is freed, the next temporary can get its id and is given the
    first one's literal: GPT-Neo's local-attention mask became its global one
    (the output off by 0.86, in CI). Pinned, no two tracked objects share an id.
    """

    class PinningRefTracker(fx_importer.RefTracker):
        def __init__(self) -> None:
            super().__init__()
            self.pinned: list[Any] = []

        def track(self, referrent: Any) -> Any:
            self.pinned.append(referrent)
            return super().track(referrent)

    return PinningRefTracker()


def make_importer(iree: Any, hooks: Any = None) -> tuple[Any, list[Node | None]]:
    """An FxImporter (nodes located by name and user frame, tracked objects pinned) and the cell that holds
    the node being imported, for `import_error`."""
    fx_importer = iree.compiler.extras.fx_importer
    current: list[Node | None] = [None]

    class _TrackingImporter(fx_importer.GraphNodeImporter):
        # Records the node being imported, so an importer error can name it.
        def import_nodes(self, nodes: Any, **kwargs: Any) -> Any:
            def track() -> Iterator[Node]:
                for node in nodes:
                    current[0] = node
                    yield node

            return super().import_nodes(track(), **kwargs)

        def _create_bind_symbolic_shape_ops(self, loc: Any, node: Node) -> None:
            # the arguments' sizes only, as IREE reads them (`assumptions.binds`)
            if binds(node, self._symbol_to_value):
                super()._create_bind_symbolic_shape_ops(loc, node)

    class _NodeLocations(fx_importer.ContextCache):
        # loc("fx.<node>@<file>":<line>:0): every diagnostic names its node, and the innermost frame
        # outside torch (the stock importer gives file:line call sites only)
        def get_node_location(self, node: Node) -> Any:
            frames = _FRAME.findall(node.stack_trace or "")
            user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
            file, line = user[-1] if user else ("?", "0")
            return iree.compiler.ir.Location.file(f"fx.{node.name}@{file}", int(line), 0, context=self._c)

    ir = iree.compiler.ir
    importer = fx_importer.FxImporter(
        context=ir.Context(),
        py_attr_tracker=pinning_ref_tracker(fx_importer),
        graph_node_importer_cls=_TrackingImporter,
        hooks=hooks,
    )
    importer._cc = _NodeLocations(importer._c, py_attr_tracker=importer._py_attr_tracker)  # pinned iree 3.13
    return importer, current


def set_reflection(iree: Any, importer: Any, function: Any, reflection: Mapping[str, str]) -> None:
    """`function`'s `iree.reflection` attribute (read back with `VmFunction.reflection`)."""
    if not reflection:
        return
    ir = iree.compiler.ir
    entries = {k: ir.StringAttr.get(v, context=importer._c) for k, v in reflection.items()}
    function.attributes["iree.reflection"] = ir.DictAttr.get(entries, context=importer._c)


def import_mlir(
    iree: Any,
    program: ExportedProgram | GraphModule,
    *,
    reflection: dict[str, str] | Callable[[], dict[str, str]] | None = None,
    hooks: Any = None,
    state: StateGlobals | None = None,
) -> str:
    """torch-dialect MLIR text of `program`, a private copy (the importer edits it) from `prepare_*`.

    `reflection` goes into `main`'s `iree.reflection` attribute (the runtime reads it back from the
    compiled module: `VmFunction.reflection`); a callable is asked once the graph is imported (what it
    says can depend on the hooks); `hooks` is an `FxImporterHooks` (see `parameters`). With `state`
    (`lift_state`), the program is imported as the private `main$body` and `main` wraps it: it loads each
    mutated buffer from its mutable global (declared by `hooks.state_global`), calls the body and stores
    the new values back, returning the rest.
    """
    ir = iree.compiler.ir
    importer, current = make_importer(iree, hooks)
    try:
        if isinstance(program, ExportedProgram):
            if state is None:
                main = importer.import_frozen_program(program, func_name="main", **shape_options())
            else:
                body = importer.import_frozen_program(
                    program, func_name=BODY, func_visibility="private", **shape_options()
                )
                main = wrap_state(ir, importer, body, state, hooks)
        else:
            _inline_tensor_attributes(program)
            main = importer.import_graph_module(program, func_name="main")
    except Exception as e:
        raise import_error(e, current[0]) from e
    if callable(reflection):
        reflection = reflection()
    set_reflection(iree, importer, main, reflection or {})
    return importer.module.operation.get_asm(enable_debug_info=True)
