"""The eager backend: the rewritten graph run by torch (the reference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx_rewrites.rules import DEFAULT
from fx_rewrites.ruleset import RuleSet


@attrs.frozen
class EagerBackend:
    name: str = "eager"
    rules: RuleSet = DEFAULT

    def compile(self, program: ExportedProgram | GraphModule, example_args: Sequence[Any]) -> Callable[..., Any]:
        return program.module() if isinstance(program, ExportedProgram) else program
