"""The declarative rule kinds (attrs classes, validated when built)."""

from fx_rewrites.kinds.base import RuleBase, RuleDefinitionError
from fx_rewrites.kinds.decompose import Decompose
from fx_rewrites.kinds.function import FunctionRule, rule
from fx_rewrites.kinds.pattern import Pattern
from fx_rewrites.kinds.schema_rules import FillDefaults, Forward, FromArg, Substitute, from_arg

__all__ = [
    "Decompose",
    "FillDefaults",
    "Forward",
    "FromArg",
    "FunctionRule",
    "Pattern",
    "RuleBase",
    "RuleDefinitionError",
    "Substitute",
    "from_arg",
    "rule",
]
