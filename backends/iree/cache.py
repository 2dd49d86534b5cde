"""Compiled modules (vmfb bytes) by the hash of their MLIR, in memory and optionally on disk."""

from __future__ import annotations

import hashlib
import os
import platform
from collections import OrderedDict
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import attrs

#: environment variable naming a directory for the on-disk compile cache.
CACHE_ENV = "FX_REWRITES_IREE_CACHE"


@attrs.define(eq=False)
class CompileCache:
    """vmfb bytes by key, in memory (the last `max_entries`) and optionally on disk.

    `directory=None` uses `$FX_REWRITES_IREE_CACHE` when set (read at each
    lookup). `hits` counts lookups served from memory or disk (`disk_hits`
    of them from disk), `misses` the ones that compiled.
    """

    directory: str | os.PathLike[str] | None = None
    max_entries: int = 64
    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    _memory: OrderedDict[str, bytes] = attrs.field(factory=OrderedDict, repr=False)

    def _dir(self) -> Path | None:
        d = self.directory if self.directory is not None else os.environ.get(CACHE_ENV)
        return Path(d) if d else None

    def get_or_compile(self, key: str, compile_fn: Callable[[], bytes]) -> tuple[bytes, bool]:
        """The cached vmfb for `key`, else `compile_fn()` stored; and whether it was cached."""
        if key in self._memory:
            self._memory.move_to_end(key)
            self.hits += 1
            return self._memory[key], True
        directory = self._dir()
        path = directory / f"{key}.vmfb" if directory is not None else None
        cached = path is not None and path.is_file()
        if cached:
            vmfb = path.read_bytes()
            self.hits += 1
            self.disk_hits += 1
        else:
            vmfb = compile_fn()
            self.misses += 1
            if path is not None:
                self._write(path, vmfb)
        self._memory[key] = vmfb
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)
        return vmfb, cached

    @staticmethod
    def _write(path: Path, vmfb: bytes) -> None:
        """Best effort, atomic (a reader never sees half a file); a cache that cannot write is not an error."""
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(vmfb)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget the in-memory entries and reset the counters (the disk is left alone)."""
        self._memory.clear()
        self.hits = self.disk_hits = self.misses = 0


def cache_key(mlir: str, flags: Sequence[str]) -> str:
    """The key of `mlir` compiled with `flags` by this iree-compile on this machine."""
    try:
        compiler = version("iree-base-compiler")
    except PackageNotFoundError:
        compiler = "unknown"
    h = hashlib.sha256()
    for part in (compiler, platform.machine(), "\0".join(flags), mlir):
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()
