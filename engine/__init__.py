"""fx-rewrites' fixpoint engine: runs rules over a torch.fx graph.

It knows the Rule protocol only, never a concrete rule (those live in
`rewrites`). Entry point: `engine.run(graph, rules)`.
"""

from fx_rewrites.engine.driver import index_rules, run
from fx_rewrites.engine.errors import GraphInputError, NonConvergence, NumericMismatch, RewriteError, RuleError
from fx_rewrites.engine.protocol import Miss, Rule, is_miss
from fx_rewrites.engine.report import Attempt, Report, Skip
from fx_rewrites.engine.rewriter import Rewriter

__all__ = [
    "Attempt",
    "GraphInputError",
    "Miss",
    "NonConvergence",
    "NumericMismatch",
    "Report",
    "RewriteError",
    "Rewriter",
    "Rule",
    "RuleError",
    "Skip",
    "index_rules",
    "is_miss",
    "run",
]
