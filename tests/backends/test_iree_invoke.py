"""iree-compile under a time limit: the limit's sources, and a compile stopped with nothing left running."""

from __future__ import annotations

import logging
import subprocess

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


class ZeroDimSoftmax(torch.nn.Module):
    """IREE 3.13's compiler never returns on this as exported (findings section 11): a compile that hangs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, 0)


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

    monkeypatch.setattr(invoke.subprocess, "Popen", Recording)
    monkeypatch.setattr(invoke, "HEARTBEAT_S", 2.0)
    x = torch.tensor(0.3)
    backend = IreeBackend(cache=CompileCache(), compile_timeout_s=5)
    with caplog.at_level(logging.INFO, logger=invoke.__name__), pytest.raises(IreeCompileTimeout) as info:
        backend.artifact(torch.export.export(ZeroDimSoftmax(), (x,)))
    assert info.value.seconds == 5 and "compile_timeout_s" in str(info.value) and TIMEOUT_ENV in str(info.value)
    assert isinstance(info.value, IreeCompileError) and "softmax" in info.value.mlir
    assert len(started) == 1, "no retry without performance flags after a timeout"
    assert started[0].poll() is not None, "iree-compile is still running"
    assert any("iree-compile has run" in r.getMessage() for r in caplog.records)


def test_a_compile_within_its_limit_runs_as_before():
    x = torch.randn(3)
    fn = IreeBackend(cache=CompileCache(), compile_timeout_s=120).compile(torch.export.export(Tanh(), (x,)), (x,))
    torch.testing.assert_close(fn(x), torch.tanh(x))


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_a_limit_that_is_not_positive_is_refused(seconds):
    with pytest.raises(ValueError, match=r"compile_timeout_s=.*expected seconds > 0, or None"):
        IreeBackend(compile_timeout_s=seconds)
