"""Compiled modules (vmfb bytes) by the hash of their MLIR, in memory and on disk.

The disk cache is on by default, under the user's cache directory
(`$XDG_CACHE_HOME/fx-rewrites/iree`, else `~/.cache/fx-rewrites/iree`), and
holds at most `$FX_REWRITES_IREE_CACHE_SIZE` MB (default 2048): past it the
least recently used modules are removed. `FX_REWRITES_IREE_CACHE=0` (or
`off`) turns it off; a directory there, or `CompileCache(directory=...)`,
puts it elsewhere. Weights of at least `parameters.inline_limit()` bytes are
parameters, outside the module (their names and shapes are in the text, not
their values), so the key is the hash of a text that holds no large weight
and models that differ only in those weights share one compile.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import attrs

from fx_rewrites.backends.iree import kernels
from fx_rewrites.backends.iree.cpus import _read_host

#: environment variable: the on-disk compile cache's directory, or "0" / "off" for none
CACHE_ENV = "FX_REWRITES_IREE_CACHE"
#: environment variable: the on-disk cache's bound in MB (least recently used modules go past it)
CACHE_SIZE_ENV = "FX_REWRITES_IREE_CACHE_SIZE"
DEFAULT_CACHE_MB = 2048
_OFF = ("0", "off", "no", "false", "none")


def default_directory() -> Path:
    """`$XDG_CACHE_HOME/fx-rewrites/iree`, else `~/.cache/fx-rewrites/iree`."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "fx-rewrites" / "iree"


def size_limit() -> int:
    """The disk cache's bound in bytes (`$FX_REWRITES_IREE_CACHE_SIZE` MB, default 2048)."""
    text = os.environ.get(CACHE_SIZE_ENV, "").strip()
    try:
        mb = float(text) if text else DEFAULT_CACHE_MB
    except ValueError:
        raise ValueError(f"{CACHE_SIZE_ENV}={text!r}: expected a size in MB (e.g. 2048)") from None
    return int(mb * (1 << 20))


@attrs.define(eq=False)
class CompileCache:
    """vmfb bytes by key, in memory (the last `max_entries`) and on disk.

    `directory=None` uses `$FX_REWRITES_IREE_CACHE` (read at each lookup):
    unset, the user's cache directory (`default_directory`); "0" or "off", no
    disk cache; else that directory. `max_bytes` bounds the disk cache (None:
    `$FX_REWRITES_IREE_CACHE_SIZE` MB, default 2048). `hits` counts lookups
    served from memory or disk (`disk_hits` of them from disk), `misses` the
    ones that compiled.
    """

    directory: str | os.PathLike[str] | None = None
    max_entries: int = 64
    max_bytes: int | None = None
    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    _memory: OrderedDict[str, bytes] = attrs.field(factory=OrderedDict, repr=False)

    def _dir(self) -> Path | None:
        if self.directory is not None:
            return Path(self.directory)
        text = os.environ.get(CACHE_ENV)
        if text is None or not text.strip():
            return default_directory()
        return None if text.strip().lower() in _OFF else Path(text)

    def get_or_compile(self, key: str, compile_fn: Callable[[], bytes]) -> tuple[bytes, bool]:
        """The cached vmfb for `key`, else `compile_fn()` stored; and whether it was cached."""
        if key in self._memory:
            self._memory.move_to_end(key)
            self.hits += 1
            return self._memory[key], True
        directory = self._dir()
        path = directory / f"{key}.vmfb" if directory is not None else None
        vmfb = self._read(path) if path is not None else None
        if vmfb is None and path is not None:
            with compiling(path):  # another process compiling this key: wait for it, then read its module
                vmfb = self._read(path)
                if vmfb is None:
                    vmfb = self._compile(key, compile_fn)
                    self._write(path, vmfb)
                    self._evict(path.parent, keep=path)
                    return vmfb, False
        elif vmfb is None:
            return self._compile(key, compile_fn), False
        self.hits += 1
        self.disk_hits += 1
        self._remember(key, vmfb)
        return vmfb, True

    def _compile(self, key: str, compile_fn: Callable[[], bytes]) -> bytes:
        vmfb = compile_fn()
        self.misses += 1
        self._remember(key, vmfb)
        return vmfb

    def put(self, key: str, vmfb: bytes) -> None:
        """Store `vmfb` under `key` (a module compiled along with another: the encoder of `encoding.compile_split`),
        so that a process waiting for the other finds it too."""
        directory = self._dir()
        if directory is not None:
            self._write(directory / f"{key}.vmfb", vmfb)
        self._remember(key, vmfb)

    def _remember(self, key: str, vmfb: bytes) -> None:
        self._memory[key] = vmfb
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            vmfb = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to go
        return vmfb

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

    def _evict(self, directory: Path, keep: Path) -> None:
        """Remove the least recently used modules until the directory holds at most `max_bytes`."""
        limit = size_limit() if self.max_bytes is None else self.max_bytes
        entries = []
        with contextlib.suppress(OSError):
            for p in directory.glob("*.vmfb"):
                with contextlib.suppress(OSError):
                    st = p.stat()
                    entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= limit:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size

    def clear(self) -> None:
        """Forget the in-memory entries and reset the counters (the disk is left alone)."""
        self._memory.clear()
        self.hits = self.disk_hits = self.misses = 0


@contextlib.contextmanager
def compiling(path: Path) -> Iterator[None]:
    """Held while this process looks for, or compiles, the module cached at `path`: a process compiling the same
    key (the ranks of a tensor-parallel model compile one program) waits here and then reads the module the
    first one wrote, instead of compiling it too. An exclusive `flock` on `<key>.lock` beside it, removed by the
    process that made it; best effort (no lock where the directory cannot be written or there is no `fcntl`):
    at worst two processes compile the same module, each writing it whole."""
    lock = path.with_suffix(".lock")
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes, or the process dies
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:  # still the file this process locked
                os.unlink(lock)
        os.close(fd)


def _host() -> str:
    """This CPU's model and features (`--iree-llvmcpu-target-cpu=host` code differs between CPUs: a cache
    directory shared between machines must not hand one's module to another)."""
    cpu = _read_host()  # the machine iree-compile runs on, not a test's stand-in (`cpus.host`)
    return "\n".join((cpu.model, " ".join(sorted(cpu.features))))


def cache_key(mlir: str, flags: Sequence[str]) -> str:
    """The key of `mlir` compiled with `flags` by this iree-compile on this machine (its CPU)."""
    try:
        compiler = version("iree-base-compiler")
    except PackageNotFoundError:
        compiler = "unknown"
    h = hashlib.sha256()
    # the text the backend compiles: our kernels spliced in, so a changed kernel (or a constant of one) is a new key
    for part in (compiler, platform.machine(), _host(), "\0".join(flags), kernels.spliced(mlir)):
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()
