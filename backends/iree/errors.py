"""What the IREE backend raises, and how iree-compile's and the importer's output become readable errors."""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

from fx_rewrites.backends.base import BackendUnavailable
from fx_rewrites.backends.iree import legality, legality_data
from fx_rewrites.engine import RewriteError
from fx_rewrites.schema import op_name
from fx_rewrites.torchao_ops import unsupported_hint

SAVE_TEMPS = "set IREE_SAVE_TEMPS=/some/dir to keep iree-compile's inputs and a reproducer"


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

    The message is the first error with its op, location and a hint, then
    where the rest is; `summary` is the message without that last sentence
    (a command line says where the rest is its own way);
    `diagnostics` holds iree-compile's full output, `mlir` the module text,
    `op` the failing op ("aten.diff", or an IREE-internal one such as
    "arith.cmpi"; "" after a crash) and `node` the graph node it came from.
    """

    def __init__(
        self, message: str, *, diagnostics: str, mlir: str, op: str = "", node: str = "", summary: str = ""
    ) -> None:
        super().__init__(message)
        self.summary = summary or message
        self.diagnostics = diagnostics
        self.mlir = mlir
        self.op = op
        self.node = node


class IreeDeviceError(RewriteError, BackendUnavailable):
    """The device a backend runs on is absent (no GPU, no driver library) or the URI names none: the program
    compiles (`IreeBackend.artifact`) but cannot run here (a `BackendUnavailable`, "not run" in `check`).

    `driver` is the HAL driver asked for, `device` the URI (or the driver
    name for its first device), `cause` the runtime's own text.
    """

    def __init__(self, message: str, *, driver: str, device: str, cause: str = "") -> None:
        super().__init__(message)
        self.driver = driver
        self.device = device
        self.cause = cause


class IreeMemoryError(RewriteError, MemoryError):
    """A step of the IREE backend needs more memory than the machine has (checked before it starts), or
    iree-compile was killed (SIGKILL: the kernel's OOM killer, most likely) while it ran.

    `step` is what was being built ("import", "iree-compile", "load", "embed"), `needed` and `available`
    are bytes (`needed` 0 when unknown: a compiler that was killed).
    """

    def __init__(self, message: str, *, step: str, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.step = step
        self.needed = needed
        self.available = available


class IreeUnsupportedError(RewriteError, NotImplementedError):
    """The program uses something this backend does not handle yet."""


#: where a Python caller finds the rest (a command line replaces this with its --verbose)
_WHERE = "Full diagnostics in the error's .diagnostics, the MLIR in .mlir."

_ERROR_LINE = re.compile(r"^(?P<loc>.*?):\s*error:\s*(?P<msg>.*)$")
#: locations the importer writes (see `importing.import_mlir`): loc("fx.<node>@<file>":<line>:<col>)
_NODE_LOC = re.compile(r"^fx\.(?P<node>[^@]+)@(?P<where>.*)$")
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
            f"`{op}` is in-place, and IREE takes functional graphs only; run `fx_rewrites.apply(program, "
            "backend.rules)` first so the in-place rules make it functional"
        )
    quantized = unsupported_hint(op)
    if quantized is not None:
        return quantized
    if "failed to legalize operation 'torch." in msg:
        return (
            f"`{op}` has no IREE lowering; run `fx_rewrites.apply` first, and if it stays, add a rule "
            "(e.g. `Decompose`) that rewrites it into ops IREE knows"
        )
    if lowered:
        return (
            "IREE accepted the torch op but failed while lowering it further; try `fx_rewrites.apply` first, "
            f"else this is an IREE limitation or bug: a rule can rewrite the node into other ops ({SAVE_TEMPS})"
        )
    return f"run `fx_rewrites.apply` first; if the error stays, `{op}` needs a rule that rewrites it for IREE"


def _measured(target: str) -> str:
    """What was measured for the failing node's ATen op ("" when nothing was): how often IREE compiled it on
    torch's OpInfo samples, so a user can tell a known IREE gap from a new one."""
    if not target:
        return ""
    record = legality.why(target).split("; ", 1)[0]  # the counts, without one sample's raw error text
    if not record:
        return ""
    return f" IREE {legality_data.IREE_VERSION}'s measured record for `{target}` (iree.legality): {record}."


def compile_error(diagnostics: str, mlir: str, gm: GraphModule) -> IreeCompileError:
    """An IreeCompileError for iree-compile's `diagnostics`, naming the node of `gm` it failed on."""
    errors = [m for m in map(_ERROR_LINE.match, diagnostics.splitlines()) if m]
    if not errors:
        lines = [ln.strip() for ln in diagnostics.splitlines() if ln.strip()]
        crash = next((ln for ln in lines if ln.startswith(("LLVM ERROR", "Assertion", "error:"))), None)
        what = crash or (lines[-1] if lines else "no diagnostics")
        summary = (
            f"iree-compile failed without an error diagnostic (a crash or resource limit): {what[:300]}. "
            f"Hint: this is an IREE limitation or bug; {SAVE_TEMPS}."
        )
        message = f"{summary} {_WHERE}"
        return IreeCompileError(message, diagnostics=diagnostics, mlir=mlir, summary=summary)
    msg, loc = errors[0]["msg"], errors[0]["loc"]
    op = next((m["op"] for m in (p.search(msg) for p in _OP_PATTERNS) if m), "")
    op = op.removeprefix("torch.")  # 'torch.aten.add_.Tensor' op -> aten.add_.Tensor
    by_loc = _NODE_LOC.match(loc)
    node, where = (by_loc["node"], by_loc["where"]) if by_loc else ("", loc)
    targets = {n.name: op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    lowered = bool(op) and not op.startswith(("aten.", "prims."))  # an IREE-internal op (arith.cmpi, ...)
    if lowered and node in targets:
        what = f"node {node!r} (`{targets[node]}`; it failed as `{op}`)"
    elif op and node in targets and targets[node] != op and not targets[node].startswith(f"{op}."):
        # torch-mlir rewrote the node's op before failing (adaptive_max_pool2d -> max_pool2d)
        what = f"node {node!r} (`{targets[node]}`, which the importer turned into `{op}`)"
    else:
        what = f"`{op}`" if op else "the module"
        what += f" (node {node!r})" if node else ""
    more = f" ({len(errors) - 1} more error(s) in the full output)" if len(errors) > 1 else ""
    summary = (
        f"IREE could not compile {what} at {where}: {_strip_op_print(msg)[:400]}{more}. "
        f"Hint: {_hint(op or 'this op', msg, lowered)}.{_measured(targets.get(node, ''))}"
    )
    message = f"{summary} {_WHERE}"
    return IreeCompileError(message, diagnostics=diagnostics, mlir=mlir, op=op, node=node, summary=summary)


def import_error(e: BaseException, node: Node | None) -> IreeImportError:
    """An IreeImportError for the importer's exception `e`, raised while importing `node`."""
    op = op_name(node.target) if node is not None and node.op == "call_function" else ""
    at = f" on node {node.name!r}" + (f" ({op})" if op else "") if node is not None else ""
    text = " ".join(str(e).split())[:400]
    if isinstance(e, NotImplementedError) and "Higher-order" in str(e):
        hint = (
            "the importer has no lowering for this higher-order op; run `fx_rewrites.apply(program, backend.rules)` "
            "first so the rules inline or remove it"
        )
    else:
        hint = "run `fx_rewrites.apply(program, backend.rules)` first; if it stays, the node needs a rule for IREE"
    message = f"IREE's FX importer failed{at}: {type(e).__name__}: {text}. Hint: {hint}."
    return IreeImportError(message, node=node.name if node is not None else "", op=op, cause=e)
