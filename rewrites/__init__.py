"""fx-rewrites: declarative rules that make PyTorch 2 graphs compile.

import torch, fx_rewrites
ep = torch.export.export(model, args)
result = fx_rewrites.apply(ep)        # or a torch.fx.GraphModule
result.program.module()(*args)        # the rewritten program
print(result.report.summary())

compiled = fx_rewrites.compile(model, args)   # export, the backend's rules, compile (IREE by default)
compiled.save("model.vmfb")                   # fx_rewrites.load("model.vmfb") reads it back
"""

from typing import Any

from fx_rewrites import rules
from fx_rewrites.api import Result, apply
from fx_rewrites.engine import Miss, NonConvergence, NumericMismatch, Report, RewriteError, Rewriter, RuleError
from fx_rewrites.engine.errors import GraphInputError
from fx_rewrites.kinds import (
    Decompose,
    FillDefaults,
    Forward,
    FromArg,
    FunctionRule,
    Pattern,
    RuleDefinitionError,
    Substitute,
    from_arg,
    rule,
)
from fx_rewrites.ruleset import Phases, RuleSet

#: names the application layer (fx_rewrites.app.compile) provides, imported on first use: it loads the backends
_LAZY = ("Compiled", "compile", "load")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from fx_rewrites.app import compile as one_call

        return getattr(one_call, name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("fx-rewrites")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'fx_rewrites' has no attribute {name!r}")


__all__ = [
    "Compiled",
    "Decompose",
    "FillDefaults",
    "Forward",
    "FromArg",
    "FunctionRule",
    "GraphInputError",
    "Miss",
    "NonConvergence",
    "NumericMismatch",
    "Pattern",
    "Phases",
    "Report",
    "Result",
    "RewriteError",
    "Rewriter",
    "RuleDefinitionError",
    "RuleError",
    "RuleSet",
    "Substitute",
    "apply",
    "compile",
    "from_arg",
    "load",
    "rule",
    "rules",
]
