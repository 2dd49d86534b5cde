"""fx-rewrites: declarative rules that make PyTorch 2 graphs compile.

import torch, rewrites
ep = torch.export.export(model, args)
result = rewrites.apply(ep)        # or a torch.fx.GraphModule
result.program.module()(*args)     # the rewritten program
print(result.report.summary())
"""

from engine import Miss, NonConvergence, NumericMismatch, Report, RewriteError, Rewriter, RuleError
from engine.errors import GraphInputError
from rewrites import rules
from rewrites.api import Result, apply
from rewrites.kinds import (
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
from rewrites.ruleset import RuleSet

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
