"""The zoo's shuffled order (FX_REWRITES_ZOO_SHUFFLE, tests/zoo/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.zoo.conftest import shuffled

ZOO = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Item:
    path: Path
    name: str


def _items() -> list[Item]:
    outside = [Item(ZOO.parent / "test_api.py", f"api{i}") for i in range(3)]
    export = [Item(ZOO / "test_zoo.py", f"export{i}") for i in range(8)]
    compiled = [Item(ZOO / "test_zoo_compile.py", f"compile{i}") for i in range(8)]
    return outside + export + compiled


def test_shuffle_is_a_seeded_permutation_that_keeps_modules_together():
    items = _items()
    first, again, other = shuffled(items, 1), shuffled(items, 1), shuffled(items, 2)
    assert first == again and first != other and sorted(first, key=id) == sorted(items, key=id)
    assert first[:3] == items[:3]  # tests outside the zoo keep their places
    modules = [item.path for item in first[3:]]
    assert modules == sorted(modules, key=modules.index)  # each module's tests together
    assert any(shuffle != items for shuffle in (first, other))
    assert [i.name for i in first[3:]] != [i.name for i in items[3:]]
