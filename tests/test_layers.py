"""The layers `engine <- rewrites <- backends <- app`: no module imports a layer above its own.

Read from the source (every `import`, at module level or inside a function), not from what happens to be
imported at run time. The root package's `__init__` and `__main__` are the public face above the layers
(`fx_rewrites.compile` comes from the app layer): they reach the app layer only inside a function, so
`import fx_rewrites` loads no backend, and no module of a layer imports a name from the face.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder -> (import name, layer), lowest first
LAYERS = {"engine": ("fx_rewrites.engine", 0), "rewrites": ("fx_rewrites", 1), "backends": ("fx_rewrites.backends", 2)}
LAYERS["app"] = ("fx_rewrites.app", 3)
FACE = {"fx_rewrites", "fx_rewrites.__main__"}
_NAMES = {name: layer for name, layer in LAYERS.values()}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, (package, _) in LAYERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def layer(module: str) -> int:
    """The layer of a module name: the longest layer package it is in."""
    best = max((p for p in _NAMES if module == p or module.startswith(p + ".")), key=len)
    return _NAMES[best]


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module imported, line, inside a function) for each fx_rewrites import in `path`; `from P import m` of a
    submodule m counts as an import of P.m, of any other name as an import of P."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            ]
        else:
            continue
        found += [(name, node.lineno, node.col_offset > 0) for name in names if name.split(".")[0] == "fx_rewrites"]
    return found


def test_the_layers_are_where_the_architecture_says():
    assert len(MODULES) > 100
    assert layer("fx_rewrites.backends.iree.rules.guards") == 2
    assert layer("fx_rewrites.kinds.legalize") == 1
    assert layer("fx_rewrites.engine.driver") == 0


@pytest.mark.parametrize("module", sorted(set(MODULES) - FACE))
def test_no_module_imports_a_layer_above_it_or_the_face(module):
    upward = [
        f"line {line}: {name} (layer {layer(name)}, above {layer(module)})"
        for name, line, _ in imports(MODULES[module])
        if name in FACE or layer(name) > layer(module)
    ]
    assert not upward, f"{module} imports upward (import the module that defines the name instead): {upward}"


def test_the_face_reaches_the_app_layer_only_inside_a_function():
    eager = [(name, line) for name, line, local in imports(MODULES["fx_rewrites"]) if layer(name) > 1 and not local]
    assert not eager, f"`import fx_rewrites` would load the app layer or the backends: {eager}"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_even_through_imports_inside_functions():
    """A function-local import that closes a circle only hides it (the issue this test came from had two)."""
    edges = {m: {name for name, _, _ in imports(path) if name in MODULES and name != m} for m, path in MODULES.items()}
    assert _circles(edges) == [], "modules that import each other (move what both need to a third module)"
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_checks_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import fx_rewrites\nfrom fx_rewrites import schema\ndef f():\n    from fx_rewrites.app import demo\n"
    )
    found = imports(bad)
    assert ("fx_rewrites", 1, False) in found and ("fx_rewrites.schema", 2, False) in found
    assert [(name, local) for name, _, local in found if layer(name) == 3] == [("fx_rewrites.app.demo", True)]


def _generic_rule_module(module: str) -> bool:
    """A module of the backend-neutral packs (`fx_rewrites.rules.<module>`), not their registry."""
    return module.startswith("fx_rewrites.rules.")


def _in_rule_folder(module: str) -> bool:
    """A rule folder's registry or module: `fx_rewrites.rules[.*]`, `fx_rewrites.backends.<name>.rules[.*]`."""
    parts = module.split(".")
    return parts[:2] == ["fx_rewrites", "rules"] or (parts[1:2] == ["backends"] and parts[3:4] == ["rules"])


def test_iree_is_imported_by_name_only_inside_its_folder():
    """A backend is one folder: the app layer reaches IREE through the backend registry and its capabilities
    (`backends.base.ModuleBackend`), never by importing `fx_rewrites.backends.iree`."""
    outside = {
        module: [
            f"line {line}: {name}"
            for name, line, _ in imports(MODULES[module])
            if name.startswith("fx_rewrites.backends.iree")
        ]
        for module in set(MODULES) - FACE
        if not (module == "fx_rewrites.backends.iree" or module.startswith("fx_rewrites.backends.iree."))
    }
    assert {m: found for m, found in outside.items() if found} == {}


def test_no_module_outside_the_rule_folders_imports_a_generic_rule_module():
    """Shared helpers live in modules of their own (`fx_rewrites.subgraphs`, `fx_rewrites.symbolic_sizes`);
    outside the rule folders, the packs are reached through their registry (`fx_rewrites.rules`)."""
    borrowed = {
        module: [f"line {line}: {name}" for name, line, _ in imports(MODULES[module]) if _generic_rule_module(name)]
        for module in set(MODULES) - FACE
        if not _in_rule_folder(module)
    }
    assert {m: found for m, found in borrowed.items() if found} == {}
    assert _in_rule_folder("fx_rewrites.rules") and _in_rule_folder("fx_rewrites.backends.iree.rules.moe")
    assert _generic_rule_module("fx_rewrites.rules.symbolic") and not _generic_rule_module("fx_rewrites.rules")
    assert not _in_rule_folder("fx_rewrites.backends.iree.backend") and not _in_rule_folder("fx_rewrites.subgraphs")


def test_the_backend_neutral_layers_are_not_about_iree():
    """No module of `rewrites/` or `engine/` has IREE as its subject (the first line of its docstring)."""
    about_iree = []
    for module, path in MODULES.items():
        if layer(module) > 1:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "IREE" in doc.split("\n", 1)[0]:
            about_iree.append(module)
    assert about_iree == []
