"""Shared fixtures: small real exports used across the engine tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from fx_rewrites import testing as rt
from tests.zoo import torchvision_cpu

# Identical compiles in different tests compile once per session: IREE's on-disk compile cache (keyed by the
# MLIR text, the flags, iree-compile's version and this CPU) in a directory of this session's own, empty when it
# starts and removed when it ends, never the user's cache directory. A module from it is what the compile would
# give, so no result depends on which test compiled it first, or on an earlier session. A test that asserts a
# compile happens (or not from the cache) uses the `no_compile_cache` fixture; the tests of the cache give it a
# tmp directory of their own.
CACHE_ENV = "FX_REWRITES_IREE_CACHE"  # backends/iree/cache.py (not imported here: conftest loads no backend)
_SESSION_CACHE = tempfile.mkdtemp(prefix="fx-rewrites-tests-iree-")
os.environ[CACHE_ENV] = _SESSION_CACHE
# A torch.compile graph the backend cannot compile raises in the tests (strict mode), where a user's runs on eager
# with a warning: a test of the torch.compile route then fails instead of passing on eager. The tests of the
# fallback turn it off themselves (tests/backends/test_dynamo.py).
os.environ["FX_REWRITES_STRICT"] = "1"

# transformers 5 imports torchvision where it is installed, and PyPI's torchvision wheel cannot load its
# compiled ops on CPU torch: register the two its import needs before any test imports transformers
torchvision_cpu.install()

# Hypothesis budgets (tests/fuzz): "ci", the default, keeps the fuzz suite to a minute or two;
# HYPOTHESIS_PROFILE=local generates 10,000 modules per fuzz test (FUZZ_EXAMPLES to change; hours on 2 cores).
_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "print_blob": True}
settings.register_profile("ci", max_examples=40, **_FUZZ)
settings.register_profile("local", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "10000")), **_FUZZ)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class ReluChain(torch.nn.Module):
    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.relu(x)
        return x


class AddRelu(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + w) * 2


@pytest.fixture
def relu_chain_ep() -> torch.export.ExportedProgram:
    return rt.export(ReluChain(16), torch.randn(4, 5))


@pytest.fixture
def add_relu_ep() -> torch.export.ExportedProgram:
    return rt.export(AddRelu(), torch.randn(3, 4), torch.randn(3, 4))


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that changes torch's thread count changes every later test's eager reference (float32 sums in
    another order): the runtime benchmark's one-thread mode once made two zoo rows miss 1e-5 in CI only."""
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, (
        f"the test left torch at {torch.get_num_threads()} threads, not {threads}"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def no_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No on-disk compile cache in this test: what it compiles, it compiles (a fresh backend's memory aside)."""
    monkeypatch.setenv(CACHE_ENV, "off")
