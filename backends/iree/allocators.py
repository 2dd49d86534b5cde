"""Which allocator a CPU device's buffers come from: IREE's caching allocator, or glibc's heap.

`FX_REWRITES_IREE_ALLOCATOR` (read when a process makes its first CPU device, `runtime.get_device`):

- `caching` (the default): IREE's caching allocator keeps every freed buffer and hands it out again for a
  request of exactly its size (docs/iree-3.13-findings.md, section 35). No call's transients fault in fresh
  pages after the first, but a function whose transients have many sizes, or sizes read from the data (a MoE
  prefill: each expert's rows), keeps the sum of them, not their live peak.
- `heap`: IREE's default allocator (its buffers are `malloc`ed) with glibc's heap told to keep what is freed
  (`keep_freed_blocks`: `mallopt` of the mmap threshold and the trim threshold): blocks of any size come from
  the heap, which splits and merges them, so a process keeps about the live peak of its transients and a call
  reuses the last call's pages instead of faulting in new ones. **Process-wide**: torch's own large tensors
  then come from the heap too, and memory freed in the process stays with it until exit (the heap's top is not
  given back). glibc only; elsewhere `caching` is used.

The choice is measured in docs/performance.md ("MoE prefill: the device allocator", issue 34).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

#: environment variable: `caching` (default) or `heap`
ALLOCATOR_ENV = "FX_REWRITES_IREE_ALLOCATOR"
CHOICES = ("caching", "heap")

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest value mallopt takes (an int): blocks up to 2 GiB from the heap, a free top up to 2 GiB kept
KEEP_LIMIT = 2**31 - 1


def choice() -> str:
    """`$FX_REWRITES_IREE_ALLOCATOR`, else `caching`; ValueError for another name."""
    name = os.environ.get(ALLOCATOR_ENV, "").strip().lower() or "caching"
    if name not in CHOICES:
        raise ValueError(f"${ALLOCATOR_ENV}={name!r}: one of {', '.join(CHOICES)}")
    return name


@functools.cache
def keep_freed_blocks(limit: int = KEEP_LIMIT) -> bool:
    """Tell glibc's malloc to serve blocks up to `limit` bytes from its heap (not from a new mapping each) and to
    keep a free top of up to `limit` bytes (not give it back): freed blocks are reused, split and merged, by the
    next requests. Process-wide, once. False where the C library has no glibc `mallopt` (or refused a value)."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # glibc's own: a musl or BSD libc has no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(mallopt(_M_TRIM_THRESHOLD, limit))


def cpu_allocators() -> list[str]:
    """The allocator specs a CPU device is made with (`create_device_by_uri(uri, allocators=...)`): `["caching"]`,
    or `[]` (IREE's default allocator) with `heap`, after glibc's heap was set to keep freed blocks."""
    if choice() == "heap" and keep_freed_blocks():
        return []
    return ["caching"]
