"""Shared fixtures: small real exports used across the engine tests."""

from __future__ import annotations

import os
import shutil
import tempfile

# OpenMP's threads wait for work asleep, not spinning (read once, when torch loads its OpenMP runtime: so before
# the import below; the tests' child processes inherit it). A spinning thread holds its core between torch's
# parallel regions, and these tests run torch beside IREE's own threads, child processes and, under `-n`,
# another pytest worker: two processes of two torch threads each on this 2-core machine ran a small matmul loop
# 18x slower spinning (330 s against 18). The thread count, and so every eager reference, is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
# Under pytest-xdist (`-n`), the workers share the controller's directory (its entries are written whole, by
# rename) and only the controller removes it.
CACHE_ENV = "FX_REWRITES_IREE_CACHE"  # backends/iree/cache.py (not imported here: conftest loads no backend)
_SHARED_CACHE_ENV = "FX_REWRITES_TESTS_SESSION_CACHE"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_SESSION_CACHE = (_WORKER and os.environ.get(_SHARED_CACHE_ENV)) or tempfile.mkdtemp(prefix="fx-rewrites-tests-iree-")
os.environ[CACHE_ENV] = os.environ[_SHARED_CACHE_ENV] = _SESSION_CACHE
# A torch.compile graph the backend cannot compile raises in the tests (strict mode), where a user's runs on eager
# with a warning: a test of the torch.compile route then fails instead of passing on eager. The tests of the
# fallback turn it off themselves (tests/backends/test_dynamo.py).
os.environ["FX_REWRITES_STRICT"] = "1"
# An input a CPU call hands over uncopied (backends/iree/calling.py, Plan.unwritten) is checked unchanged after each
# call, bit for bit: the whole suite tests the proof that no op of the graph writes it (backends/iree/sharing.py).
os.environ["FX_REWRITES_CHECK_INPUTS"] = "1"

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


@pytest.fixture(autouse=True)
def _session_compile_cache_kept():
    """A test that changes `FX_REWRITES_IREE_CACHE` for good takes the session's compile cache from every test
    after it in its process, and from the processes they start: once benchmarks/runtime.py, imported by a test,
    turned it off at import, and every later test of that pytest worker compiled from scratch (the
    tensor-parallel ranks each compiled their common module, with no cache to wait on). Put back, and the test
    fails naming it."""
    yield
    left = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = _SESSION_CACHE
    assert left == _SESSION_CACHE, (
        f"the test left {CACHE_ENV}={left!r}, not the session's compile cache {_SESSION_CACHE!r}: set it with "
        "monkeypatch.setenv (or the no_compile_cache fixture), which puts it back"
    )


#: the memory one worker may take at its peak (a tiny LM's compile, a zoo model and its eager reference)
_WORKER_MEMORY = 6 << 30


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per CPU this process may run on, as many as the memory holds (6 GiB each), 1 at least."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = _WORKER_MEMORY * cpus
    return max(1, min(cpus, memory // _WORKER_MEMORY))


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _WORKER:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def no_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No on-disk compile cache in this test: what it compiles, it compiles (a fresh backend's memory aside)."""
    monkeypatch.setenv(CACHE_ENV, "off")


#: where each test's CPU seconds go, when set: one JSON line per test phase, appended to `<path>.<worker>`
_CPU_LOG = os.environ.get("FX_REWRITES_TESTS_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With `FX_REWRITES_TESTS_CPU_LOG` set, record each test's CPU time (this process and the children it
    waited for: iree-compile, ranks, benchmark children) beside its wall time. On a loaded machine wall time
    says little about what a test costs; CPU seconds add up to what CI's cores spend. Each row also names the
    phases that failed, so a long run's failures can be read while it goes on."""
    if not _CPU_LOG:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start_cpu, start_wall = cpu(), time.perf_counter()
    yield
    row = {
        "test": item.nodeid,
        "cpu_s": round(cpu() - start_cpu, 2),
        "wall_s": round(time.perf_counter() - start_wall, 2),
        "failed": item.stash.get(_FAILED_PHASES, []),
    }
    with open(f"{_CPU_LOG}.{_WORKER or 'main'}", "a") as log:
        log.write(json.dumps(row) + "\n")


_FAILED_PHASES = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """The phases (setup, call, teardown) of `item` that failed, for the CPU log's row."""
    report = (yield).get_result()
    if _CPU_LOG and report.failed:
        item.stash.setdefault(_FAILED_PHASES, []).append(report.when)
