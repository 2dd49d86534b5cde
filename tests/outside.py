"""Tests that need a program from outside the package (Chromium, the real-ttnn venv, qemu).

Where it is missing, such a test skips with how to install it, and fails when `CI` is set: CI installs
everything (.ci/run), so a missing program there is a broken CI, not a test to leave out.

    chromium = require_program("chromium", "chromium-browser", hint="apt-get install -y chromium")
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

#: values of `CI` that do not mean CI (an unset or empty `CI` does not either)
_NOT_CI = ("", "0", "false", "no", "off")


def in_ci() -> bool:
    """Whether `CI` is set (to anything but empty, 0, false, no or off)."""
    return os.environ.get("CI", "").strip().lower() not in _NOT_CI


def missing(what: str, hint: str) -> NoReturn:
    """Skip the calling test (outside CI) or fail it (`CI` set): `what` is missing, `hint` says how to get it."""
    if in_ci():
        pytest.fail(f"{what}, and CI must run this test (CI is set). Install it: {hint}", pytrace=False)
    pytest.skip(f"NOT RUN: {what}. Install it: {hint} (with CI set, this test fails instead)")


def require_program(*names: str, hint: str) -> str:
    """The path of the first of `names` on PATH; else `missing` (skip, or fail in CI) with `hint`."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    missing(f"no {' or '.join(f'`{n}`' for n in names)} on PATH", hint)
