"""Shared by the commands: exit codes, the input error, backend lookup."""

from __future__ import annotations

import os
import traceback

import torch

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

#: how long a note (an as-is or after-rules failure) may be before --verbose is needed for all of it
MAX_NOTE = 2000

_TORCH_DIR = os.path.dirname(torch.__file__)


class InputError(Exception):
    """What the user gave cannot be used (exit status 2).

    `message` is one paragraph ending in the fix; `detail` is the library's
    own error text (torch's), printed under it as is; `cause` and `side`
    (what torch logged or printed meanwhile) are shown with --verbose.
    """

    def __init__(self, message: str, *, detail: str = "", cause: BaseException | None = None, side: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.cause = cause
        self.side = side


def _backend(name: str):
    from fx_rewrites import backends

    try:
        return backends.get(name)
    except backends.UnknownBackend as e:
        raise InputError(f"{e}. Fix: pass one of them to --backend.") from None


def _one_line(e: BaseException) -> str:
    """The first line of an error's message, whitespace collapsed."""
    lines = [" ".join(ln.split()) for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0].rstrip(".") if lines else ""


def _traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
