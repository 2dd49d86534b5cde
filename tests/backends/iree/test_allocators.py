"""The CPU device's allocator (`backends/iree/allocators.py`): IREE's caching allocator bounded, over glibc's heap,
by default; unbounded with `FX_REWRITES_IREE_ALLOCATOR=caching`, glibc's heap alone with `heap`. glibc's setting is
process-wide (`mallopt`), so what it changes is checked in a child process; page faults are counted (getrusage),
bytes held read from the device allocator's statistics, nothing timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fx_rewrites.backends.iree import allocators
from fx_rewrites.backends.iree.allocators import ALLOCATOR_ENV

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _child(code: str, allocator: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ALLOCATOR_ENV}
    if allocator is not None:
        env[ALLOCATOR_ENV] = allocator
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert allocators.choice() == "bounded"
    monkeypatch.setenv(ALLOCATOR_ENV, "caching")
    assert allocators.cpu_allocators() == ["caching"]
    monkeypatch.setenv(ALLOCATOR_ENV, " Heap ")
    assert allocators.choice() == "heap"
    monkeypatch.setenv(ALLOCATOR_ENV, "pooled")
    with pytest.raises(ValueError, match="bounded, caching, heap"):
        allocators.choice()


def test_the_bounded_spec_names_its_capacity():
    assert allocators.bounded_spec() == f"caching:*=*;{allocators.CAPACITY};*"
    assert allocators.bounded_spec(1 << 20) == "caching:*=*;1048576;*"
    with pytest.raises(ValueError, match="expected > 0"):
        allocators.bounded_spec(0)


_HELD = """
import gc, json, sys
import iree.runtime as ireert
from fx_rewrites.backends.iree import allocators
from fx_rewrites.backends.iree.runtime import get_device

allocators.CAPACITY = 8 << 20
device = get_device(ireert, "local-sync")
MB = 1 << 20

def held():
    s = device.allocator.statistics
    return (s["device_bytes_allocated"] - s["device_bytes_freed"]) // MB

def use(size):
    buffer = device.allocator.allocate_buffer(
        memory_type=ireert.MemoryType.DEVICE_LOCAL, allowed_usage=ireert.BufferUsage.DEFAULT, allocation_size=size * MB
    )
    del buffer
    gc.collect()

use(3)
allocated = device.allocator.statistics["device_bytes_allocated"]
use(3)  # the same size again: the freed buffer, not a new allocation
reused = device.allocator.statistics["device_bytes_allocated"] == allocated
sizes = []
for size in range(1, 11):  # ten sizes, as a MoE prefill's transients from one prompt to the next
    use(size)
    sizes.append(held())
print(json.dumps({"reused": reused, "held": sizes, "spec": allocators.cpu_allocators()}))
"""


@glibc
@pytest.mark.parametrize("allocator", ["bounded", "caching", "heap"])
def test_a_pool_of_many_sizes_holds_at_most_its_capacity(allocator):
    """Buffers of ten sizes freed one after another (a capacity of 8 MiB): the unbounded caching allocator holds
    every one (55 MiB), the bounded one at most its capacity besides the last buffer, the heap's device none; a
    size seen again is the freed buffer on both caching allocators."""
    out = _child(_HELD, allocator)
    if allocator == "caching":
        assert out["held"][-1] == sum(range(1, 11)), out  # the 3 MiB one served the sweep's 3 MiB
    elif allocator == "bounded":
        assert out["spec"] == ["caching:*=*;8388608;*"], out
        assert max(out["held"]) <= 8 + 10, out
        assert out["held"][-1] >= 10, out  # the last buffer stays for a request of its size
    else:
        assert max(out["held"]) == 0, out
    assert out["reused"] is (allocator != "heap"), out


_FAULTS = """
import ctypes, json, resource
from fx_rewrites.backends.iree.allocators import keep_freed_blocks
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20  # over glibc's largest dynamic mmap threshold (32 MiB): a new mapping each time by default

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults(), faults()]
kept = keep_freed_blocks()
heap = [faults(), faults()]
print(json.dumps({"default": default, "kept": kept, "heap": heap}))
"""


@glibc
def test_the_heap_keeps_a_freed_block_for_the_next_request():
    out = _child(_FAULTS, None)
    pages = (64 << 20) // 4096
    assert out["kept"] is True
    assert min(out["default"]) > pages // 2  # every 64 MiB block faults in fresh pages without the setting
    assert out["heap"][1] < pages // 20  # with it the second block is the first one's pages


_GIVE_BACK = """
import ctypes, json
from fx_rewrites.backends.iree.allocators import give_back_freed, keep_freed_blocks
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) << 10

keep_freed_blocks()
start = anon()
p = libc.malloc(SIZE)
ctypes.memset(p, 1, SIZE)
libc.free(p)
kept = anon() - start
given = give_back_freed()
print(json.dumps({"kept": kept, "after": anon() - start, "given": given}))
"""


@glibc
def test_what_the_heap_keeps_is_given_back_on_request():
    """glibc's heap set to keep freed blocks keeps a freed 64 MiB block resident; `give_back_freed` (called by
    `runtime.trim_devices`, after a save frees a module's packed copy) returns its pages."""
    out = _child(_GIVE_BACK, None)
    assert out["given"] is True
    assert out["kept"] > (48 << 20), out
    assert out["after"] < (8 << 20), out


_MODULE = """
import gc, json, resource
import torch
from torch.export import Dim
import fx_rewrites
import iree.runtime as ireert
from fx_rewrites import backends
from fx_rewrites.backends.iree.runtime import get_device

class Scores(torch.nn.Module):  # [8, n, n] scores: 32 MiB at n = 1024, a transient of the call
    def forward(self, x):
        s = x @ x.transpose(-2, -1)
        return torch.softmax(s, -1).sum(-1) + s.amax(-1)

iree = backends.get("iree")
device = get_device(ireert, iree.driver)
g = torch.Generator().manual_seed(0)
# one float into their blocks: misaligned, so each call copies its input into a device buffer (an aligned one is
# read in place, calling.py) and the device's allocator sees the copies come and go
xs = [(torch.randn(8 * 1024 * 16 + 1, generator=g) * scale)[1:].view(8, 1024, 16) for scale in (1.0, 0.1)]
out = {}
for name, shapes in (("static", None), ("dim", ({1: Dim("n", min=2, max=1024)},))):
    fn = fx_rewrites.compile(Scores(), (xs[0],), backend="iree", dynamic_shapes=shapes)
    calls = [*xs, xs[0], xs[1]]
    expected = [Scores()(x) for x in calls]  # eager's tensors made first: the calls below allocate alone
    faults, got = [], []
    for x in calls:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        got.append(fn(x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    errors = []
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)  # float32's default tolerances: a stale buffer is off by O(1)
        errors.append((a - b).abs().max().item())
    out[name] = {"faults": faults, "errors": errors}
    if name == "dim":
        small = torch.randn(8, 300, 16, generator=g)
        torch.testing.assert_close(fn(small), Scores()(small))
        out[name]["errors"].append((fn(small) - Scores()(small)).abs().max().item())
gc.collect()
out["freed"] = device.allocator.statistics["device_bytes_freed"]
print(json.dumps(out))
"""


@glibc
@pytest.mark.parametrize("allocator", ["bounded", "heap", "caching"])
def test_a_device_on_each_allocator_reuses_the_calls_pages(allocator):
    """End to end: a module with a 32 MiB transient, static and with a Dim, on each allocator: the results match
    eager call after call (a reused buffer holds the last call's values); only the heap's device frees buffers
    (the caching allocators keep them: the bounded one's 256 MiB holds this module's), and with glibc's heap kept
    the calls after the first fault in next to none of the transient's pages. (With the caching allocator this module's calls fault in ~17,000 pages each, though its
    device allocator sees 512 KiB: memory `malloc`ed outside the HAL allocator, which the heap setting reuses too;
    not a MoE prefill's case, whose transients are queue allocations, 0 faults a call in docs/performance.md.)"""
    out = _child(_MODULE, allocator)
    pages = (32 << 20) // 4096
    for name in ("static", "dim"):
        assert len(out[name]["errors"]) >= 4, out[name]
        if allocator != "caching":
            assert max(out[name]["faults"][2:]) < pages // 10, out[name]
    if allocator == "heap":
        assert out["freed"] > 0
    else:
        assert out["freed"] == 0
