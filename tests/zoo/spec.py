"""What a zoo row is: the model it builds, its inputs, how it is compared, and what is known to fail.

A row names its source and class and gives the keyword arguments; `build`
turns that into a module (transformers: `Class(Class.config_class(**config))`;
torchvision: `torchvision.models.get_model(cls, weights=None, **config)`; timm:
`timm.create_model(cls, pretrained=False, **config)`), under a fixed seed, in
eval mode, with nothing downloaded.

`Known` records a failure that is understood: torch's own limit (`owner`
"torch") or a form another engineer's area is fixing ("inplace",
"legalize", "perf"). The tests make it a strict expected failure whose
reason names the form, the op and the owner, so it turns into a failing
XPASS the day the fix lands (then the row's `Known` is deleted).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from tests.zoo import float64, torchvision_cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing may be fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: (rtol, atol) of IREE against eager, per output dtype; integer and bool outputs must be equal.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-9),
    torch.bfloat16: (1.6e-2, 1e-2),  # 8 mantissa bits: a few ulps
}
#: seeds of the input sets each model is compared on (the first is the one it was exported with)
SEEDS = (0, 1)

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
Route = Literal["export", "compile"]
#: the stages of a route, in order; a failure at one stage fails the stages after it
STAGES: dict[str, tuple[str, ...]] = {"export": ("export", "rules", "iree"), "compile": ("compile",)}
#: who a known failure waits on: torch's own limit, an area of issue 12, or IREE's own bug with no fix in flight
OWNERS = ("torch", "inplace", "legalize", "perf", "iree")


class KnownFailure(Exception):
    """A zoo model failed the way its row's `Known` says (the test is a strict expected failure)."""


@dataclasses.dataclass(frozen=True)
class Known:
    """A failure understood and owned: at `stage` of its route, an error matching `error` (a regex)."""

    stage: str
    error: str
    owner: str
    form: str

    def __post_init__(self) -> None:
        assert self.owner in OWNERS, f"owner {self.owner!r} is not one of {OWNERS}"
        assert any(self.stage in stages for stages in STAGES.values()), f"unknown stage {self.stage!r}"

    @property
    def reason(self) -> str:
        who = {"torch": "torch's own limit", "iree": "IREE's own bug, no fix in flight"}.get(
            self.owner, f"owned by {self.owner!r}"
        )
        return f"{self.form} ({who}): /{self.error}/"

    def matches(self, error: BaseException) -> bool:
        return re.search(self.error, f"{type(error).__name__}: {error}") is not None


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One row of the zoo."""

    name: str
    source: Literal["transformers", "torchvision", "timm"]
    #: transformers: a class (or dotted path under `transformers`); torchvision: a builder; timm: a model name
    cls: str
    config: Mapping[str, Any] = dataclasses.field(repr=False)
    inputs: Callable[[int], Inputs] = dataclasses.field(repr=False)
    #: what is known to fail, per route ("export", "compile")
    known: Mapping[str, Known] = dataclasses.field(default_factory=dict)
    #: graphs dynamo hands the backend (more than 1: graph breaks; fewer would mean a graph fell back to eager)
    graphs: int = 1
    dtype: torch.dtype | None = None
    #: (rtol, atol) for float32 outputs, where the default is too tight for a deep random network
    tolerance: tuple[float, float] | None = None
    #: BatchNorm running statistics measured on random batches (a fresh model's mean 0 / variance 1 leaves a
    #: deep network's outputs ~1e-9: nothing to compare)
    calibrate: bool = False
    #: which routes run in CI and by default: True both, "export" the export route only (its torch.compile route
    #: a local run), False neither; to keep CI's time, the note says why. A route kept out is marked `slow`
    #: (`-m slow`, or FX_REWRITES_ZOO=full, runs it)
    ci: bool | Literal["export"] = True
    note: str = ""

    def __post_init__(self) -> None:
        assert self.ci in (True, False, "export"), f"{self.name}: ci={self.ci!r}, expected True, False or 'export'"

    def in_ci(self, route: str) -> bool:
        """Whether CI (the default test run) runs this row's `route` ("export" or "compile")."""
        return self.ci is True or self.ci == route

    @property
    def family(self) -> str:
        return f"{self.source}: {self.cls.rsplit('.', 1)[-1]}"

    @property
    def export_error(self) -> str:
        """torch.export's own error, where torch cannot export the model ("" otherwise)."""
        known = self.known.get("export")
        return known.error if known and known.owner == "torch" and known.stage == "export" else ""

    def model(self) -> torch.nn.Module:
        """The model with seeded random weights, in eval mode."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = build(self.source, self.cls, dict(self.config)).eval()
            if self.calibrate:
                self._calibrate(module)
        return module.to(self.dtype) if self.dtype is not None else module

    def _calibrate(self, module: torch.nn.Module) -> None:
        norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the batches
        module.train()
        with torch.no_grad():
            for seed in (100, 101, 102, 103):
                args, kwargs = self.inputs(seed)
                module(*args, **kwargs)
        module.eval()

    def known_at(self, route: str, stage: str) -> Known | None:
        """The row's known failure if it stops `stage` of `route` (it is at that stage or an earlier one)."""
        known = self.known.get(route)
        stages = STAGES[route]
        return known if known and stages.index(known.stage) <= stages.index(stage) else None


def build(source: str, cls: str, config: dict[str, Any]) -> torch.nn.Module:
    torchvision_cpu.install()  # transformers and timm import torchvision when it is installed
    try:
        if source == "transformers":
            import transformers

            target: Any = transformers
            for part in cls.split("."):
                target = getattr(target, part) if hasattr(target, part) else _submodule(target, part)
            return target(target.config_class(**config))
        if source == "torchvision":
            import torchvision

            return torchvision.models.get_model(cls, weights=None, **config)
        if source == "timm":
            import timm

            return timm.create_model(cls, pretrained=False, **config)
    except ImportError as e:  # pragma: no cover - the test extra installs them
        raise ImportError(f"the zoo needs {source} ({e}): pip install -e '.[test]'") from None
    raise ValueError(f"unknown zoo source {source!r}: transformers, torchvision or timm")


def _submodule(package: Any, name: str) -> Any:
    import importlib

    return importlib.import_module(f"{package.__name__}.{name}")


# ----------------------------------------------------------------------------- inputs


def text(vocab: int = 128, batch: int = 2, length: int = 16, mask: bool = True, decoder: int = 0) -> Any:
    """input_ids (and an attention_mask whose second row ends in padding, longer for each seed);
    `decoder`: that many decoder_input_ids too (encoder-decoder models)."""

    def make(seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (batch, length), generator=g)
        kwargs: dict[str, Any] = {}
        if mask:
            attention = torch.ones(batch, length, dtype=torch.long)
            attention[-1, length - 3 - seed :] = 0
            kwargs["attention_mask"] = attention
        if decoder:
            kwargs["decoder_input_ids"] = torch.randint(3, vocab, (batch, decoder), generator=g)
        return (ids,), kwargs

    return make


def image(size: int = 32, batch: int = 2, channels: int = 3) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, channels, size, size, generator=g),), {}

    return make


def audio(samples: int = 800, batch: int = 2) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, samples, generator=g),), {}

    return make


def features(bins: int, frames: int, batch: int = 2) -> Callable[[int], Inputs]:
    """log-mel features (Whisper)."""

    def make(seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, bins, frames, generator=g),), {}

    return make


# ----------------------------------------------------------------------------- comparison


def _plain(outputs: Any) -> Any:
    """transformers caches (no pytree registration: leaves that compare by identity) as their (key, value) tensors."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        return outputs

    def plain(leaf: Any) -> Any:
        if isinstance(leaf, Cache):
            return [(layer.keys, layer.values) for layer in leaf.layers]
        return leaf

    return pytree.tree_map(plain, outputs)


def leaves(outputs: Any) -> list[Any]:
    """The outputs' leaves as `assert_matches` compares them (a transformers cache as its tensors)."""
    return pytree.tree_leaves(_plain(outputs))


def assert_matches(
    got: Any,
    expected: Any,
    tolerance: tuple[float, float] | None = None,
    exact: Callable[[], float64.Reference] | None = None,
) -> None:
    """Same output structure, dtypes and shapes; floats within TOLERANCE (or `tolerance` for float32), the rest equal.

    `exact` (`float64.reference` of the model on these inputs, called only when needed) tells float noise from
    a fault where a float32 output is not close to eager: `float64.judge`."""
    reference: float64.Reference | None = None
    got_leaves, got_spec = pytree.tree_flatten(_plain(got))
    exp_leaves, exp_spec = pytree.tree_flatten(_plain(expected))
    assert got_spec == exp_spec, f"output structure {got_spec} != eager {exp_spec}"
    for i, (g, e) in enumerate(zip(got_leaves, exp_leaves, strict=True)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"output {i}: {g!r} != eager {e!r}"
            continue
        assert isinstance(g, torch.Tensor), f"output {i}: got {type(g).__name__}, eager gives a tensor"
        assert (g.dtype, g.shape) == (e.dtype, e.shape), (
            f"output {i}: {g.dtype}{list(g.shape)} != {e.dtype}{list(e.shape)}"
        )
        if e.is_floating_point():
            assert e.dtype in TOLERANCE, f"output {i}: no tolerance for {e.dtype}; add one to TOLERANCE"
            rtol, atol = tolerance if tolerance and e.dtype == torch.float32 else TOLERANCE[e.dtype]
            try:
                torch.testing.assert_close(g, e, rtol=rtol, atol=atol, msg=lambda m, i=i: f"output {i}: {m}")
            except AssertionError as mismatch:
                if exact is None or e.dtype != torch.float32:
                    raise
                if reference is None:
                    try:
                        reference = exact()
                    except Exception as why:  # the model does not run in float64: the mismatch stands
                        raise AssertionError(f"{mismatch}\n(no float64 reference to judge it by: {why})") from why
                float64.judge(i, g, reference, str(mismatch))
        else:
            assert torch.equal(g, e), f"output {i} ({e.dtype}) differs from eager"
