"""Shared by the commands: exit codes, the input error, backend lookup."""

from __future__ import annotations

import traceback

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

#: how long a note (an as-is or after-rules failure) may be before --verbose is needed for all of it
MAX_NOTE = 2000
#: the same for the demo's notes under its table (a dozen of them)
DEMO_NOTE = 600


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


def describe_error(e: BaseException, limit: int | None = MAX_NOTE) -> str:
    """An error as one paragraph for a terminal: its type and message, whitespace collapsed, cut at a word
    boundary after `limit` characters (None: never). For an error that carries the compiler's output
    (`.diagnostics`, which a shell user cannot reach), it says that --verbose prints it."""
    text = " ".join((getattr(e, "summary", "") or str(e)).split())
    if getattr(e, "diagnostics", ""):
        text += " (--verbose prints iree-compile's whole output)"
    if limit is not None and len(text) > limit:
        cut = text.rfind(" ", 0, limit)
        text = text[: cut if cut > limit // 2 else limit].rstrip(" ,;:") + " … (--verbose shows all of it)"
    return f"{type(e).__name__}: {text}"


def _traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


#: the MODEL and --inputs arguments' help, shared by the commands that take a model
_MODEL_HELP = (
    "PATH.py:FACTORY, where FACTORY() returns (module, example_args) or (module, example_args, example_kwargs); "
    "or PATH.pt2, an ExportedProgram saved "
    "with torch.export.save. A .pt2 is read with torch.export.load only, after checking it holds no pickled "
    "objects (tensor subclasses, custom objects), so loading it runs no code from the file; it runs on random "
    "inputs shaped by its input specs (symbolic sizes at their hints) unless --inputs is given. A .py file is "
    "imported, which runs it."
)
_INPUTS_HELP = (
    "inputs instead of the factory's example_args or a .pt2's random ones: a tuple saved with "
    "torch.save((x, ...), path), read with torch.load(weights_only=True)"
)
