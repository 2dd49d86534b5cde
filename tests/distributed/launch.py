"""Run a function on N ranks of a gloo process group on this machine (torch.multiprocessing spawn, CPU).

    results = run_ranks(ranks.isend_in_forward, world=2)   # one result per rank, in rank order

Each rank is a fresh process (spawn): it joins the group at a free local port, uses one thread, registers the
torchvision stand-in ops before transformers is imported (tests/zoo/torchvision_cpu.py), calls
`fn(rank, world, tmp, *args)` and returns what it returns (tensors and plain values, through `torch.save`
in a temporary directory the ranks share). A rank that raises fails the test with its traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, tmp: str, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, tmp, *args)
        torch.save(result, Path(tmp) / f"result.{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, tmp: str | os.PathLike[str] | None = None) -> list[Any]:
    """`fn(rank, world, tmp, *args)` on `world` ranks; their results in rank order. `tmp`: the directory the
    ranks share (default: a temporary one, removed after)."""
    if tmp is not None:
        return _run(fn, world, str(tmp), args)
    with tempfile.TemporaryDirectory() as tmp:
        return _run(fn, world, tmp, args)


def _run(fn: Callable[..., Any], world: int, tmp: str, args: tuple[Any, ...]) -> list[Any]:
    env = os.environ.copy()
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(_entry, args=(fn, world, free_port(), tmp, args), nprocs=world, join=True)
    finally:
        os.environ.clear()
        os.environ.update(env)
    return [torch.load(Path(tmp) / f"result.{r}.pt", weights_only=False) for r in range(world)]
