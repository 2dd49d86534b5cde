"""tests/outside.py: a test whose outside program is missing skips with the install hint, and fails in CI."""

from __future__ import annotations

import pytest

from tests.outside import in_ci, require_program

ABSENT = "fx-rewrites-no-such-program"


@pytest.mark.parametrize("value", [None, "", "0", "false", "No"])
def test_missing_program_skips_outside_ci(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match=rf"NOT RUN: no `{ABSENT}` on PATH\. Install it: apt-get x"):
        require_program(ABSENT, hint="apt-get x")


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_missing_program_fails_in_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match=rf"no `{ABSENT}` or `{ABSENT}2` on PATH.*CI is set.*apt-get x"):
        require_program(ABSENT, f"{ABSENT}2", hint="apt-get x")


def test_a_present_program_is_found_in_either_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    for ci in ("", "1"):
        monkeypatch.setenv("CI", ci)
        assert require_program(ABSENT, "tool", hint="-") == str(tool)
