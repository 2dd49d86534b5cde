"""The IREE backend: ExportedProgram -> torch-dialect MLIR -> llvm-cpu vmfb -> local-task.

    fn = backends.get("iree").compile(rewrites.apply(ep).program, args)
    fn(*args)  # same inputs and output structure as program.module()

Parameters, buffers and lifted constants are frozen into the module
(`FxImporter.import_frozen_program`), so the callable takes the user inputs
only. Mutated buffers (BUFFER_MUTATION outputs) stay arguments, read from
and written back to the program's state at each call as `program.module()`
does; mutated inputs are written back too. `iree-compile` runs as a
subprocess (a compiler crash does not take Python down); compiled modules
are cached by the hash of the MLIR text, in memory and, when
`FX_REWRITES_IREE_CACHE` names a directory, on disk.
iree is imported on first compile: `pip install -e '.[iree]'`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from engine import RewriteError
from rewrites.program import copy_graph_module, rebuild_program
from rewrites.rules import DEFAULT
from rewrites.rules import iree as iree_rules
from rewrites.ruleset import RuleSet
from rewrites.schema import op_name

#: IREE-specific rules (rewrites/rules/iree.py), unioned into `IreeBackend.rules` after DEFAULT.
IREE_RULES = iree_rules.RULES

#: environment variable naming a directory for the on-disk compile cache.
CACHE_ENV = "FX_REWRITES_IREE_CACHE"

INSTALL_HINT = "pip install -e '.[iree]'  (iree-base-compiler and iree-base-runtime)"

_TORCH_DIR = os.path.dirname(torch.__file__)

_SAVE_TEMPS = "set IREE_SAVE_TEMPS=/some/dir to keep iree-compile's inputs and a reproducer"


class IreeImportError(RewriteError):
    """The FX importer (graph -> torch-dialect MLIR) raised.

    `node` and `op` name the node it failed on ("" when unknown), `cause` is
    the importer's exception.
    """

    def __init__(self, message: str, *, node: str = "", op: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.op = op
        self.cause = cause


class IreeCompileError(RewriteError):
    """`iree-compile` rejected the module.

    The message is the first error with its op, location and a hint;
    `diagnostics` holds iree-compile's full output, `mlir` the module text,
    `op` the failing op ("aten.diff", or an IREE-internal one such as
    "arith.cmpi"; "" after a crash) and `node` the graph node it came from.
    """

    def __init__(self, message: str, *, diagnostics: str, mlir: str, op: str = "", node: str = "") -> None:
        super().__init__(message)
        self.diagnostics = diagnostics
        self.mlir = mlir
        self.op = op
        self.node = node


class IreeUnsupportedError(RewriteError, NotImplementedError):
    """The program uses something this backend does not handle yet."""


# ----------------------------------------------------------------------------- cache


@attrs.define(eq=False)
class CompileCache:
    """vmfb bytes by key, in memory (the last `max_entries`) and optionally on disk.

    `directory=None` uses `$FX_REWRITES_IREE_CACHE` when set (read at each
    lookup). `hits` counts lookups served from memory or disk (`disk_hits`
    of them from disk), `misses` the ones that compiled.
    """

    directory: str | os.PathLike[str] | None = None
    max_entries: int = 64
    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    _memory: OrderedDict[str, bytes] = attrs.field(factory=OrderedDict, repr=False)

    def _dir(self) -> Path | None:
        d = self.directory if self.directory is not None else os.environ.get(CACHE_ENV)
        return Path(d) if d else None

    def get_or_compile(self, key: str, compile_fn: Callable[[], bytes]) -> tuple[bytes, bool]:
        """The cached vmfb for `key`, else `compile_fn()` stored; and whether it was cached."""
        if key in self._memory:
            self._memory.move_to_end(key)
            self.hits += 1
            return self._memory[key], True
        directory = self._dir()
        path = directory / f"{key}.vmfb" if directory is not None else None
        cached = path is not None and path.is_file()
        if cached:
            vmfb = path.read_bytes()
            self.hits += 1
            self.disk_hits += 1
        else:
            vmfb = compile_fn()
            self.misses += 1
            if path is not None:
                self._write(path, vmfb)
        self._memory[key] = vmfb
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)
        return vmfb, cached

    @staticmethod
    def _write(path: Path, vmfb: bytes) -> None:
        """Best effort, atomic (a reader never sees half a file); a cache that cannot write is not an error."""
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(vmfb)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget the in-memory entries and reset the counters (the disk is left alone)."""
        self._memory.clear()
        self.hits = self.disk_hits = self.misses = 0


# ----------------------------------------------------------------------------- errors


_ERROR_LINE = re.compile(r"^(?P<loc>.*?):\s*error:\s*(?P<msg>.*)$")
#: locations the importer writes (see `_import`): loc("fx.<node>@<file>":<line>:<col>)
_NODE_LOC = re.compile(r"^fx\.(?P<node>[^@]+)@(?P<where>.*)$")
_FRAME = re.compile(r'File "([^"]+)", line ([0-9]+),')
#: where the failing op's name is in an error line, most specific first
_OP_PATTERNS = (
    re.compile(r'name = "(?P<op>torch\.[\w.]+)"'),  # torch.operator: an op torch-mlir does not know
    re.compile(r"legalize operation '(?P<op>torch\.[\w.]+)'"),  # a torch op with no conversion
    re.compile(r"'(?P<op>[a-z_]+\.[\w.]+)' op\b"),  # any dialect's op that failed to verify or lower
)
_VTENSOR_INPLACE = "must be Multi-dimensional array modeling Torch's Tensor type, but got '!torch.vtensor"


def _strip_op_print(msg: str) -> str:
    """Drop the inline op dump iree appends (`...: %3 = "torch.operator"(...) loc(...)`)."""
    return re.sub(r":\s*%[\w:#]+ = .*$", "", msg).strip()


def _hint(op: str, msg: str, lowered: bool) -> str:
    if _VTENSOR_INPLACE in msg:
        return (
            f"`{op}` is in-place, and IREE takes functional graphs only; run `rewrites.apply(program, "
            "backend.rules)` first so the in-place rules make it functional"
        )
    if "failed to legalize operation 'torch." in msg:
        return (
            f"`{op}` has no IREE lowering; run `rewrites.apply` first, and if it stays, add a rule "
            "(e.g. `Decompose`) that rewrites it into ops IREE knows"
        )
    if lowered:
        return (
            "IREE accepted the torch op but failed while lowering it further; try `rewrites.apply` first, "
            f"else this is an IREE limitation or bug: a rule can rewrite the node into other ops ({_SAVE_TEMPS})"
        )
    return f"run `rewrites.apply` first; if the error stays, `{op}` needs a rule that rewrites it for IREE"


def _compile_error(diagnostics: str, mlir: str, gm: GraphModule) -> IreeCompileError:
    errors = [m for m in map(_ERROR_LINE.match, diagnostics.splitlines()) if m]
    if not errors:
        lines = [ln.strip() for ln in diagnostics.splitlines() if ln.strip()]
        crash = next((ln for ln in lines if ln.startswith(("LLVM ERROR", "Assertion", "error:"))), None)
        what = crash or (lines[-1] if lines else "no diagnostics")
        message = (
            f"iree-compile failed without an error diagnostic (a crash or resource limit): {what[:300]}. "
            f"Hint: this is an IREE limitation or bug; {_SAVE_TEMPS}. Full output in .diagnostics, MLIR in .mlir."
        )
        return IreeCompileError(message, diagnostics=diagnostics, mlir=mlir)
    msg, loc = errors[0]["msg"], errors[0]["loc"]
    op = next((m["op"] for m in (p.search(msg) for p in _OP_PATTERNS) if m), "")
    op = op.removeprefix("torch.")  # 'torch.aten.add_.Tensor' op -> aten.add_.Tensor
    by_loc = _NODE_LOC.match(loc)
    node, where = (by_loc["node"], by_loc["where"]) if by_loc else ("", loc)
    targets = {n.name: op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    lowered = bool(op) and not op.startswith(("aten.", "prims."))  # an IREE-internal op (arith.cmpi, ...)
    if lowered and node in targets:
        what = f"node {node!r} (`{targets[node]}`; it failed as `{op}`)"
    else:
        what = f"`{op}`" if op else "the module"
        what += f" (node {node!r})" if node else ""
    more = f" ({len(errors) - 1} more error(s) in .diagnostics)" if len(errors) > 1 else ""
    message = (
        f"IREE could not compile {what} at {where}: {_strip_op_print(msg)[:400]}{more}. "
        f"Hint: {_hint(op or 'this op', msg, lowered)}. Full diagnostics in .diagnostics, MLIR in .mlir."
    )
    return IreeCompileError(message, diagnostics=diagnostics, mlir=mlir, op=op, node=node)


def _import_error(e: BaseException, node: Node | None) -> IreeImportError:
    op = op_name(node.target) if node is not None and node.op == "call_function" else ""
    at = f" on node {node.name!r}" + (f" ({op})" if op else "") if node is not None else ""
    text = " ".join(str(e).split())[:400]
    if isinstance(e, NotImplementedError) and "Higher-order" in str(e):
        hint = (
            "the importer has no lowering for this higher-order op; run `rewrites.apply(program, backend.rules)` "
            "first so the rules inline or remove it"
        )
    else:
        hint = "run `rewrites.apply(program, backend.rules)` first; if it stays, the node needs a rule for IREE"
    message = f"IREE's FX importer failed{at}: {type(e).__name__}: {text}. Hint: {hint}."
    return IreeImportError(message, node=node.name if node is not None else "", op=op, cause=e)


# ----------------------------------------------------------------------------- import


def _iree() -> Any:
    """The iree modules this backend uses, imported on first use."""
    try:
        import iree.compiler
        import iree.compiler.extras.fx_importer
        import iree.compiler.ir
        import iree.runtime
    except ImportError as e:
        raise ImportError(f"the IREE backend needs the iree packages ({e}); install them: {INSTALL_HINT}") from e
    return iree


def _copy_tree(gm: GraphModule) -> GraphModule:
    """`copy_graph_module` of `gm` and of every GraphModule under it (the importer edits graphs)."""
    new = copy_graph_module(gm)
    for name, child in gm.named_children():
        if isinstance(child, GraphModule):
            setattr(new, name, _copy_tree(child))
    return new


@attrs.frozen(eq=False)
class _Output:
    """One output spec: where its value comes from and where it goes."""

    #: index among the compiled function's results; None for a constant output
    result: int | None
    constant: Any = None
    dtype: torch.dtype | None = None
    #: a mutation's destination: a flat user-input index or a state tensor; None for a user output
    write: int | torch.Tensor | None = None


@attrs.frozen(eq=False)
class _Plan:
    """How a call maps onto the compiled function and back."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    #: per argument of the compiled function: a flat user-input index, or a (mutated) state tensor
    args: tuple[int | torch.Tensor, ...]
    outputs: tuple[_Output, ...]


_STATE_IN = (InputKind.PARAMETER, InputKind.BUFFER)
_STATE_OUT = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def _check_signature(program: ExportedProgram) -> None:
    sig = program.graph_signature
    supported_in = {InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR, *_STATE_IN}
    bad_in = [f"{s.arg.name} ({s.kind.name})" for s in sig.input_specs if s.kind not in supported_in]
    supported_out = {OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION, *_STATE_OUT}
    bad_out = [f"{getattr(s.arg, 'name', '')} ({s.kind.name})" for s in sig.output_specs if s.kind not in supported_out]
    if bad_in or bad_out:
        raise IreeUnsupportedError(
            f"the IREE backend does not support {'inputs ' + str(bad_in) if bad_in else ''}"
            f"{' and ' if bad_in and bad_out else ''}{'outputs ' + str(bad_out) if bad_out else ''} yet; "
            "run this program on the eager backend"
        )


def _state(program: ExportedProgram, target: str) -> torch.Tensor:
    return program.state_dict[target] if target in program.state_dict else program.constants[target]


def _is_constant(node: Node) -> bool:
    """A user input export specialised (an int, None, ...): the graph does not read it."""
    symbolic = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    return not node.users and not isinstance(node.meta.get("val"), symbolic)


def _prepare(program: ExportedProgram) -> tuple[ExportedProgram, _Plan]:
    """A private copy of `program` ready for the importer, and the call plan.

    Parameters, buffers and constants are frozen into the module, except
    mutated ones: those stay arguments, read from and written back to
    `program`'s state at each call (as `program.module()` does). Specialised
    non-tensor inputs and constant outputs (None, ints) have no IREE type:
    they are dropped from the copy and restored around the call.
    """
    _check_signature(program)
    sig = program.graph_signature
    copy = rebuild_program(program, _copy_tree(program.graph_module))
    mutated = {s.target for s in sig.output_specs if s.kind in _STATE_OUT}
    # the importer freezes what the signature calls state; mutated state must stay an argument
    copy_specs = copy.graph_signature.input_specs
    for i, spec in enumerate(copy_specs):
        if spec.kind in _STATE_IN and spec.target in mutated:
            copy_specs[i] = dataclasses.replace(spec, kind=InputKind.USER_INPUT, target=None, persistent=None)
        elif spec.kind == InputKind.BUFFER and spec.persistent is False:
            # non-persistent buffers (BERT's position_ids) live in `constants`; the importer
            # freezes buffers from the state dict only ("Could not find state mapping for buffer")
            copy_specs[i] = dataclasses.replace(spec, persistent=True)
            copy._state_dict = {**copy.state_dict, spec.target: program.constants[spec.target]}

    user_names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    sources: dict[str, int | torch.Tensor] = {name: i for i, name in enumerate(user_names)}
    for spec in sig.input_specs:
        if spec.kind in _STATE_IN and spec.target in mutated:
            sources[spec.arg.name] = _state(program, spec.target)
    graph = copy.graph_module.graph
    args: list[int | torch.Tensor] = []
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in sources]:
        if node.name in user_names and _is_constant(node):
            graph.erase_node(node)
        else:
            args.append(sources[node.name])

    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = pytree.tree_leaves(output.args[0])
    outputs, results = [], 0
    for spec, leaf in zip(sig.output_specs, leaves, strict=True):
        write = None
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            write = user_names.index(spec.target)
        elif spec.kind in _STATE_OUT:
            write = _state(program, spec.target)
        if isinstance(leaf, Node):
            val = leaf.meta.get("val")
            dtype = val.dtype if isinstance(val, torch.Tensor) else None
            outputs.append(_Output(results, dtype=dtype, write=write))
            results += 1
        else:
            outputs.append(_Output(None, constant=leaf, write=write))
    output.args = (tuple(leaf for leaf in leaves if isinstance(leaf, Node)),)
    graph.lint()
    copy.graph_module.recompile()
    plan = _Plan(program.call_spec.in_spec, program.call_spec.out_spec, tuple(args), tuple(outputs))
    return copy, plan


def _import(iree: Any, program: ExportedProgram) -> str:
    """torch-dialect MLIR text of `program` (a private copy: the importer edits it)."""
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

    class _NodeLocations(fx_importer.ContextCache):
        # loc("fx.<node>@<file>":<line>:0): every diagnostic names its node, and the innermost frame
        # outside torch (the stock importer gives file:line call sites only)
        def get_node_location(self, node: Node) -> Any:
            frames = _FRAME.findall(node.stack_trace or "")
            user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
            file, line = user[-1] if user else ("?", "0")
            return iree.compiler.ir.Location.file(f"fx.{node.name}@{file}", int(line), 0, context=self._c)

    importer = fx_importer.FxImporter(context=iree.compiler.ir.Context(), graph_node_importer_cls=_TrackingImporter)
    importer._cc = _NodeLocations(importer._c, py_attr_tracker=importer._py_attr_tracker)  # pinned iree 3.13
    try:
        importer.import_frozen_program(program, func_name="main")
    except Exception as e:
        raise _import_error(e, current[0]) from e
    return importer.module.operation.get_asm(enable_debug_info=True)


# ----------------------------------------------------------------------------- run


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return value


def _from_device(value: Any, dtype: torch.dtype | None) -> Any:
    import numpy as np

    array = value.to_host() if hasattr(value, "to_host") else value
    if not isinstance(array, np.ndarray):
        return array  # a scalar result (SymInt output)
    array = np.array(array, copy=True)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    t = torch.from_numpy(array)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)  # the dtype export promised


@attrs.define(eq=False)
class IreeCompiled:
    """A compiled program: call it like `program.module()`.

    `mlir` is the imported module text, `key` its cache key, `vmfb` the
    compiled bytes and `from_cache` whether they came from the cache.
    """

    plan: _Plan = attrs.field(repr=False)
    function: Any = attrs.field(repr=False)
    mlir: str = attrs.field(repr=False)
    vmfb: bytes = attrs.field(repr=False)
    key: str = ""
    from_cache: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan
        if kwargs and plan.in_spec.num_children == 2:  # in the order export saw them
            wanted = plan.in_spec.child(1).context or []
            if set(kwargs) == set(wanted):
                kwargs = {k: kwargs[k] for k in wanted}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != plan.in_spec:
            raise TypeError(
                f"the compiled program takes (args, kwargs) shaped {pytree.treespec_pprint(plan.in_spec)}, "
                f"got {pytree.treespec_pprint(spec)}"
            )
        results = self.function(*(_to_host(flat[a] if isinstance(a, int) else a) for a in plan.args))
        if not isinstance(results, (tuple, list)):
            results = (results,)
        user_outputs = []
        for out in plan.outputs:
            value = out.constant if out.result is None else _from_device(results[out.result], out.dtype)
            if out.write is None:
                user_outputs.append(value)
                continue
            with torch.no_grad():  # mutations land where program.module() puts them
                (flat[out.write] if isinstance(out.write, int) else out.write).copy_(value)
        return pytree.tree_unflatten(user_outputs, plan.out_spec)


# ----------------------------------------------------------------------------- backend


def _cache_key(mlir: str, flags: Sequence[str]) -> str:
    try:
        compiler = version("iree-base-compiler")
    except PackageNotFoundError:
        compiler = "unknown"
    h = hashlib.sha256()
    for part in (compiler, platform.machine(), "\0".join(flags), mlir):
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()


@attrs.frozen
class IreeBackend:
    """IREE on the CPU: llvm-cpu code for this host, run by the local-task driver.

    `flags` are extra `iree-compile` arguments; `cache` is shared by every
    compile of this backend instance.
    """

    name: str = "iree"
    rules: RuleSet = DEFAULT | IREE_RULES
    # f64 demotion (iree's default) breaks f64 inputs and outputs at run time ("buffer view byte length
    # 24 exceeds backing buffer byte length 12"); llvm-cpu runs f64 natively.
    flags: tuple[str, ...] = ("--iree-llvmcpu-target-cpu=host", "--iree-input-demote-f64-to-f32=false")
    driver: str = "local-task"
    cache: CompileCache = attrs.field(factory=CompileCache, eq=False, repr=False)

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> IreeCompiled:
        """Import, compile (or take from the cache) and load `program`.

        `example_args` are not needed: an ExportedProgram carries its shapes.
        """
        if isinstance(program, GraphModule):
            raise IreeUnsupportedError(
                "the IREE backend takes a torch.export.ExportedProgram, not a GraphModule (dynamo graphs are "
                "not supported yet): export first, `ep = torch.export.export(model, args)`, then "
                "`backend.compile(rewrites.apply(ep, backend.rules).program, args)`"
            )
        if not isinstance(program, ExportedProgram):
            raise TypeError(f"the IREE backend compiles a torch.export.ExportedProgram, got {type(program).__name__}")
        iree = _iree()
        copy, plan = _prepare(program)
        mlir = _import(iree, copy)
        key = _cache_key(mlir, self.flags)
        vmfb, cached = self.cache.get_or_compile(key, lambda: self._compile_mlir(iree, mlir, program.graph_module))
        module = iree.runtime.load_vm_flatbuffer(vmfb, driver=self.driver)
        return IreeCompiled(plan, module["main"], mlir, vmfb, key, cached)

    def _compile_mlir(self, iree: Any, mlir: str, gm: GraphModule) -> bytes:
        try:
            return iree.compiler.compile_str(
                mlir, input_type="torch", target_backends=["llvm-cpu"], extra_args=list(self.flags)
            )
        except iree.compiler.CompilerToolError as e:
            # str(e): "Error invoking ...\nDiagnostics:\n<stderr>\n\nInvoked with: ..."
            text = str(e)
            diagnostics = text.split("Diagnostics:\n", 1)[-1].split("\n\nInvoked with:", 1)[0].strip()
            raise _compile_error(diagnostics, mlir, gm) from None
