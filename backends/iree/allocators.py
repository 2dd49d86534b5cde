"""Which allocator a CPU device's buffers come from: IREE's caching allocator, bounded, over glibc's heap (default).

`FX_REWRITES_IREE_ALLOCATOR` (read when a process makes its first CPU device, `runtime.get_device`):

- `bounded` (the default): IREE's caching allocator with a capacity (`CAPACITY`, `caching:*=*;<bytes>;*`: what
  its pool holds, in use and free, before it gives free buffers back, the most recently freed first), over glibc's
  heap told to keep what is freed (`keep_freed_blocks`). A module whose calls' transients fit in the capacity (one
  size after another, call after call) reuses them as with `caching`; a function whose transients have sizes read
  from the data (a MoE prefill: each expert's rows) or from the prompt's length hands the buffers past the
  capacity back to the heap, which serves the next request of any size from them (split and merged, zeroed again
  as `heap`'s): a process keeps about the heap's peak of its transients, not every size it has seen (a MoE
  prefill of 2048 tokens: 1.54x eager's peak against `caching`'s 2.85x on one prompt and 5.97x after four; ~10%
  more prefill time than `caching` on a prompt repeated call after call). Process-wide (as `heap`). Where there is
  no glibc `mallopt` the pool is bounded alone (buffers past it go back to the system).
- `caching`: IREE's caching allocator unbounded: it keeps every freed buffer and hands it out again for a request
  of exactly its size (docs/iree-3.13-findings.md, sections 35 and 69). No call's transients fault in fresh pages
  after the first, but a function whose transients have sizes read from the data keeps the sum of them, and
  every prompt of other sizes adds its own (up to 64 free buffers: a MoE prefill of 2048 tokens added 1.0-1.6 GB
  a prompt, section 69).
- `heap`: IREE's default allocator (its buffers are `malloc`ed, `calloc` in fact: a reused block is zeroed again,
  ~0.12 ms a MB) with glibc's heap told to keep what is freed (`keep_freed_blocks`: `mallopt` of the mmap
  threshold and the trim threshold): a process keeps about the live peak of its transients and a call reuses
  the last call's pages instead of faulting in new ones.

`bounded` and `heap` are **process-wide** in what they tell glibc: torch's own large tensors then come from the
heap too, and memory freed in the process stays with it until exit (the heap's top is not given back). The
choice is measured in docs/performance.md ("MoE memory: the caching allocator bounded", issue 34; "MoE prefill:
the device allocator").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

#: environment variable: `bounded` (default), `caching` or `heap`
ALLOCATOR_ENV = "FX_REWRITES_IREE_ALLOCATOR"
CHOICES = ("bounded", "caching", "heap")
#: `bounded`'s pool capacity in bytes: buffers in use and free together, past which free ones go back to the heap
CAPACITY = 256 << 20

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest value mallopt takes (an int): blocks up to 2 GiB from the heap, a free top up to 2 GiB kept
KEEP_LIMIT = 2**31 - 1


def choice() -> str:
    """`$FX_REWRITES_IREE_ALLOCATOR`, else `bounded`; ValueError for another name."""
    name = os.environ.get(ALLOCATOR_ENV, "").strip().lower() or "bounded"
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


def give_back_freed() -> bool:
    """Return the free memory glibc's heap keeps (`keep_freed_blocks`) to the system: `malloc_trim(0)`, its free
    pages released wherever they lie in the heap (a later request faults them in again). For the moments a process
    frees much for good (`runtime.trim_devices`: a module's packed copy after `save(params=)`). False where there is
    no glibc."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def bounded_spec(capacity: int | None = None) -> str:
    """IREE's allocator spec of a caching pool over the device's one heap holding at most `capacity` bytes (in use
    and free; default `CAPACITY`), its free-list count IREE's default (64)."""
    capacity = CAPACITY if capacity is None else capacity
    if capacity <= 0:
        raise ValueError(f"a pool capacity of {capacity} bytes: expected > 0")
    return f"caching:*=*;{capacity};*"


def cpu_allocators() -> list[str]:
    """The allocator specs a CPU device is made with (`create_device_by_uri(uri, allocators=...)`): `bounded`: a
    caching pool of `CAPACITY` bytes (glibc's heap set to keep freed blocks first); `caching`: `["caching"]`;
    `heap`: `[]` (IREE's default allocator) after glibc's heap was set to keep freed blocks (`["caching"]` where
    that setting is refused)."""
    name = choice()
    if name == "bounded":
        keep_freed_blocks()
        return [bounded_spec()]
    if name == "heap" and keep_freed_blocks():
        return []
    return ["caching"]
