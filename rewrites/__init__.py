"""fx-rewrites: declarative rules that make PyTorch 2 graphs compile.

import torch, fx_rewrites
ep = torch.export.export(model, args)
result = fx_rewrites.apply(ep)        # or a torch.fx.GraphModule
result.program.module()(*args)        # the rewritten program
print(result.report.summary())

compiled = fx_rewrites.compile(model, args)   # export, the backend's rules, compile (IREE by default)
compiled.save("model.vmfb")                   # fx_rewrites.load("model.vmfb") reads it back

Every name is imported on first use (`import fx_rewrites` loads neither torch nor a rule pack), so that
`fx-rewrites --version` and `--help` answer at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from fx_rewrites import rules
    from fx_rewrites.api import Result, apply
    from fx_rewrites.app.compile import Compiled, compile, load
    from fx_rewrites.app.lm import CompiledLM, compile_lm
    from fx_rewrites.app.localize import Localization, localize
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

#: public name -> the module it comes from (the app layer's for compile/load: it loads the backends)
_FROM = {
    **dict.fromkeys(("Result", "apply"), "fx_rewrites.api"),
    **dict.fromkeys(
        ("Miss", "NonConvergence", "NumericMismatch", "Report", "RewriteError", "Rewriter", "RuleError"),
        "fx_rewrites.engine",
    ),
    "GraphInputError": "fx_rewrites.engine.errors",
    **dict.fromkeys(
        (
            "Decompose",
            "FillDefaults",
            "Forward",
            "FromArg",
            "FunctionRule",
            "Pattern",
            "RuleDefinitionError",
            "Substitute",
            "from_arg",
            "rule",
        ),
        "fx_rewrites.kinds",
    ),
    **dict.fromkeys(("Phases", "RuleSet"), "fx_rewrites.ruleset"),
    **dict.fromkeys(("Compiled", "compile", "load"), "fx_rewrites.app.compile"),
    **dict.fromkeys(("CompiledLM", "compile_lm"), "fx_rewrites.app.lm"),
    **dict.fromkeys(("Localization", "localize"), "fx_rewrites.app.localize"),
}


def __getattr__(name: str) -> Any:
    if name in _FROM:
        value = getattr(importlib.import_module(_FROM[name]), name)
        globals()[name] = value  # looked up once
        return value
    if name == "rules":
        return importlib.import_module("fx_rewrites.rules")
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("fx-rewrites")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'fx_rewrites' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Compiled",
    "CompiledLM",
    "Decompose",
    "FillDefaults",
    "Forward",
    "FromArg",
    "FunctionRule",
    "GraphInputError",
    "Localization",
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
    "compile_lm",
    "from_arg",
    "load",
    "localize",
    "rule",
    "rules",
]
