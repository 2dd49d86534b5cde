"""fx-rewrites: declarative rules that make PyTorch 2 graphs compile.

import torch, rewrites
ep = torch.export.export(model, args)
result = fx_rewrites.apply(ep)        # or a torch.fx.GraphModule
result.program.module()(*args)     # the rewritten program
print(result.report.summary())
"""

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

__all__ = [
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
    "from_arg",
    "rule",
    "rules",
]
