"""Every shipped rule body has the one signature (issue 36): `def name(node, rw, *, args, found)`, each keyword
declared only when the body reads it; the ttnn lowerings' builds too. Walks the packs (`fx_rewrites.rules.DEFAULT`,
every registered backend's rules, the ttnn phases) and every rule object at the top of the rule modules, so a rule
not yet in a pack is checked as well."""

from __future__ import annotations

import dis
import importlib
import inspect
import pkgutil

import pytest

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.ttnn.rules import PHASES as TTNN_PHASES
from fx_rewrites.kinds import FunctionRule
from fx_rewrites.ruleset import Phases, RuleSet

RULE_PACKAGES = ("fx_rewrites.rules", "fx_rewrites.backends.iree.rules", "fx_rewrites.backends.ttnn.rules")


def _module_rules() -> dict[str, object]:
    found: dict[str, object] = {}
    for package_name in RULE_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__, package_name + "."):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                values = list(value) if isinstance(value, (RuleSet, Phases)) else [value]
                for rule in values:
                    if isinstance(rule, FunctionRule):
                        found.setdefault(rule.name, rule)
    return found


def _shipped() -> dict[str, object]:
    rules: dict[str, object] = {r.name: r for r in fx_rewrites.rules.DEFAULT}
    for name in backends.names():
        target = backends.get(name)
        rules.update({r.name: r for r in getattr(target, "rules", ())})
    rules.update({r.name: r for r in TTNN_PHASES})
    rules.update(_module_rules())
    return {name: r for name, r in rules.items() if isinstance(r, FunctionRule)}


SHIPPED = _shipped()


def _reads(fn, name: str) -> bool:
    code = fn.__code__
    loads = {i.argval for i in dis.get_instructions(code) if i.opname.startswith(("LOAD_FAST", "LOAD_DEREF"))}
    return name in loads or name in code.co_cellvars  # a closure inside the body reads it


def test_the_walk_finds_every_pack():
    packs = {r.fn.__module__.rsplit(".", 1)[0] for r in SHIPPED.values()}
    assert set(RULE_PACKAGES) <= packs, packs
    assert len(SHIPPED) >= 140, len(SHIPPED)  # 150 function rules after issue 36


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_rule_body_has_the_one_signature(name):
    rule = SHIPPED[name]
    params = list(inspect.signature(rule.fn).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    where = f"{rule.fn.__module__}.{rule.fn.__qualname__}"
    assert positional == ["node", "rw"], f"{where}: positional parameters {positional}, not (node, rw)"
    assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)], where
    assert set(keywords) <= {"args", "found"} and keywords == sorted(keywords), f"{where}: *, {keywords}"
    for keyword in keywords:
        assert _reads(rule.fn, keyword), f"{where} declares {keyword} but never reads it"
    if "found" in keywords:
        assert rule.when is not None, f"{where} takes found but has no when to find it"
