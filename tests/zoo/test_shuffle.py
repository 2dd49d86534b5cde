"""The zoo's shuffled order (FX_REWRITES_ZOO_SHUFFLE, tests/zoo/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.zoo.conftest import by_model, shuffled

ZOO = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Item:
    path: Path
    name: str
    callspec: Any = None


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


def test_by_model_puts_a_models_tests_side_by_side_in_their_module():
    def test(path: Path, function: str, model: str | None) -> Item:
        callspec = SimpleNamespace(params={"name": model}) if model else None
        return Item(path, f"{function}[{model}]" if model else function, callspec)

    outside = [Item(ZOO.parent / "test_api.py", f"api{i}") for i in range(2)]
    export = [test(ZOO / "test_zoo.py", f, m) for f in ("rules", "iree") for m in ("bert", "llama", "vit")]
    compiled = [test(ZOO / "test_zoo_compile.py", "compiled", m) for m in ("bert", "llama")]
    plain = [test(ZOO / "test_float64.py", f, None) for f in ("b", "a")]
    items = outside[:1] + export + compiled + plain + outside[1:]
    got = by_model(items)
    assert sorted(got, key=id) == sorted(items, key=id)
    assert got[0] == items[0] and got[-1] == items[-1]  # tests outside the zoo keep their places
    assert [i.name for i in got[1:7]] == [f"{f}[{m}]" for m in ("bert", "llama", "vit") for f in ("rules", "iree")]
    assert got[7:] == items[7:]  # one test per model, or no model: as collected
