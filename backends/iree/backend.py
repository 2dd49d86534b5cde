"""`IreeBackend`: import, compile (or take from the cache) and load."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.backends.iree.artifact import UNSUPPORTED_KEY, reflection
from fx_rewrites.backends.iree.cache import CompileCache, cache_key
from fx_rewrites.backends.iree.errors import compile_error
from fx_rewrites.backends.iree.importing import import_mlir, iree_modules, prepare_graph_module, prepare_program
from fx_rewrites.backends.iree.legality import LEGALIZE
from fx_rewrites.backends.iree.parameters import parameter_hooks
from fx_rewrites.backends.iree.runtime import IreeCompiled
from fx_rewrites.rules import DEFAULT
from fx_rewrites.rules import iree as iree_rules
from fx_rewrites.ruleset import Phases, RuleSet

#: IREE-specific rules (rewrites/rules/iree.py), unioned with DEFAULT in the first phase of `IreeBackend.rules`;
#: the second phase (`legality.LEGALIZE`) decomposes what IREE cannot lower and guards its wrong results.
IREE_RULES = iree_rules.RULES
#: what `IreeBackend.rules` is by default
RULES = Phases(DEFAULT | IREE_RULES, LEGALIZE, name="iree")


@attrs.frozen
class IreeBackend:
    """IREE on the CPU: llvm-cpu code for this host, run by the local-task driver.

    `flags` are extra `iree-compile` arguments; `cache` is shared by every
    compile of this backend instance.
    """

    name: str = "iree"
    rules: RuleSet | Phases = RULES
    # f64 demotion (iree's default) breaks f64 inputs and outputs at run time ("buffer view byte length
    # 24 exceeds backing buffer byte length 12"); llvm-cpu runs f64 natively.
    flags: tuple[str, ...] = ("--iree-llvmcpu-target-cpu=host", "--iree-input-demote-f64-to-f32=false")
    driver: str = "local-task"
    cache: CompileCache = attrs.field(factory=CompileCache, eq=False, repr=False)

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> IreeCompiled:
        """Import, compile (or take from the cache) and load `program`.

        `program` is an ExportedProgram (the callable takes its user inputs,
        as `program.module()` does) or a functional ATen GraphModule whose
        placeholders carry `meta["val"]`, such as the forward graph an
        aot_autograd backend of torch.compile receives (the callable takes
        every placeholder, as the GraphModule does; see `importing`).
        `example_args` are not needed: both carry their shapes.
        """
        if isinstance(program, ExportedProgram):
            prepared, plan = prepare_program(program)
            graph_module = program.graph_module
        elif isinstance(program, GraphModule):
            prepared, plan = prepare_graph_module(program)
            graph_module = program
        else:
            raise TypeError(
                "the IREE backend compiles a torch.export.ExportedProgram or a torch.fx.GraphModule, "
                f"got {type(program).__name__}"
            )
        iree = iree_modules()
        entries = reflection(plan, self.driver)
        mlir = import_mlir(iree, prepared, reflection=entries)
        key = cache_key(mlir, self.flags)
        vmfb, cached = self.cache.get_or_compile(key, lambda: self._compile_mlir(iree, mlir, graph_module))
        module = iree.runtime.load_vm_flatbuffer(vmfb, driver=self.driver)
        externalize = None
        if isinstance(program, ExportedProgram):
            externalize = functools.partial(self._with_parameters, program)
        unsupported = entries.get(UNSUPPORTED_KEY, "")
        return IreeCompiled(plan, module["main"], mlir, vmfb, key, cached, externalize, unsupported)

    def _with_parameters(self, program: ExportedProgram) -> tuple[bytes, dict[str, torch.Tensor]]:
        """`program` compiled with its weights as named parameters (see `parameters`), and those weights."""
        iree = iree_modules()
        prepared, plan = prepare_program(program)  # a fresh copy: an import consumes the one it is given
        hooks = parameter_hooks(iree, prepared)
        mlir = import_mlir(iree, prepared, reflection=reflection(plan, self.driver, parameters=True), hooks=hooks)
        key = cache_key(mlir, self.flags)
        vmfb, _ = self.cache.get_or_compile(key, lambda: self._compile_mlir(iree, mlir, program.graph_module))
        return vmfb, hooks.tensors

    def _compile_mlir(self, iree: Any, mlir: str, gm: GraphModule) -> bytes:
        try:
            return iree.compiler.compile_str(
                mlir, input_type="torch", target_backends=["llvm-cpu"], extra_args=list(self.flags)
            )
        except iree.compiler.CompilerToolError as e:
            # str(e): "Error invoking ...\nDiagnostics:\n<stderr>\n\nInvoked with: ..."
            text = str(e)
            diagnostics = text.split("Diagnostics:\n", 1)[-1].split("\n\nInvoked with:", 1)[0].strip()
            raise compile_error(diagnostics, mlir, gm) from None
