"""The declarative rule kinds (attrs classes, validated when built)."""

from rewrites.kinds.base import RuleBase, RuleDefinitionError
from rewrites.kinds.decompose import Decompose
from rewrites.kinds.function import FunctionRule, rule
from rewrites.kinds.pattern import Pattern
from rewrites.kinds.schema_rules import FillDefaults, Forward, FromArg, Substitute, from_arg

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
