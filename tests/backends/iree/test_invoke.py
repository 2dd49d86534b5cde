"""iree-compile under a time limit: the limit's sources, and a compile stopped with nothing left running."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest
import torch

from fx_rewrites.backends.iree import (
    TIMEOUT_ENV,
    CompileCache,
    IreeBackend,
    IreeCompileError,
    IreeCompileTimeout,
    invoke,
)
from fx_rewrites.backends.iree.importing import iree_modules


def _running_in_group(pgid: int) -> list[int]:
    """Processes of group `pgid` that are running (not zombies waiting to be reaped), from /proc."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while listed
        if int(fields[2]) == pgid and fields[0] != "Z":
            running.append(int(stat.parent.name))
    return running


class Tanh(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


@pytest.mark.parametrize(
    ("text", "expected"), [(None, invoke.DEFAULT_TIMEOUT_S), ("90", 90.0), ("2.5", 2.5), ("0", None), ("none", None)]
)
def test_the_limit_comes_from_the_environment(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(TIMEOUT_ENV, text)
    assert invoke.default_timeout() == expected
    assert IreeBackend().compile_timeout_s == expected


@pytest.mark.parametrize("text", ["ten", "-5"])
def test_a_bad_limit_in_the_environment_says_what_it_expects(monkeypatch, text):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    with pytest.raises(ValueError, match=rf"{TIMEOUT_ENV}=.*expected seconds"):
        IreeBackend()


def test_a_compile_past_its_limit_is_stopped_with_its_process_group(monkeypatch, caplog):
    started: list[subprocess.Popen] = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    # A compiler that never returns and starts a child of its own (the real hang, softmax of a 0-d tensor, is
    # pinned in tests/backends/iree/rules/test_lowerings.py; this test does not depend on IREE keeping that bug)
    core = iree_modules().compiler.tools.core
    monkeypatch.setattr(
        core,
        "build_compile_command_line",
        lambda *a, **k: ["sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & wait"],
    )
    monkeypatch.setattr(invoke.subprocess, "Popen", Recording)
    monkeypatch.setattr(invoke, "HEARTBEAT_S", 0.5)
    x = torch.randn(3)
    backend = IreeBackend(cache=CompileCache(), compile_timeout_s=2)
    with caplog.at_level(logging.INFO, logger=invoke.__name__), pytest.raises(IreeCompileTimeout) as info:
        backend.artifact(torch.export.export(Tanh(), (x,)))
    assert info.value.seconds == 2 and "compile_timeout_s" in str(info.value) and TIMEOUT_ENV in str(info.value)
    assert isinstance(info.value, IreeCompileError) and "tanh" in info.value.mlir
    assert len(started) == 1, "no retry without performance flags after a timeout"
    assert started[0].poll() is not None, "the compiler is still running"
    deadline = time.monotonic() + 5  # SIGKILL reaches the child asynchronously
    while _running_in_group(started[0].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running_in_group(started[0].pid), "its child is still running: the group was not killed"
    assert any("iree-compile has run" in r.getMessage() for r in caplog.records)


def test_a_compile_within_its_limit_runs_as_before():
    x = torch.randn(3)
    fn = IreeBackend(cache=CompileCache(), compile_timeout_s=120).compile(torch.export.export(Tanh(), (x,)), (x,))
    torch.testing.assert_close(fn(x), torch.tanh(x))


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_a_limit_that_is_not_positive_is_refused(seconds):
    with pytest.raises(ValueError, match=r"compile_timeout_s=.*expected seconds > 0, or None"):
        IreeBackend(compile_timeout_s=seconds)
