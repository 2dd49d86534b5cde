"""A torch.cond on the input sizes: the dispatched call against its branch compiled alone and cond_to_where.

    python benchmarks/size_dispatch.py [--rounds 15]

One thread each (torch.set_num_threads(1), IREE local-sync), CPU time (time.process_time), interleaved rounds;
prints the median per call of each function on the short side (n = 8) and the long side (n = 48), and the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.cache import CompileCache


class Dispatched(torch.nn.Module):
    def __init__(self, threshold: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(256, 256, generator=g) / 16)
        self.threshold = threshold

    def short(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)

    def long(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(8):
            y = torch.tanh(y @ self.w) + y
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[1] <= self.threshold, self.short, self.long, (x,))


class Branch(torch.nn.Module):
    def __init__(self, model: Dispatched, side: str) -> None:
        super().__init__()
        self.model, self.side = model, side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.side)(x)


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    iree = IreeBackend(driver="local-sync", cache=CompileCache())
    model = Dispatched().eval()
    seq = ({1: Dim("n", min=2, max=64)},)
    x = torch.randn(4, 8, 256)
    funcs = {
        "dispatched": fx_rewrites.compile(model, (x,), dynamic_shapes=seq, backend=iree),
        "short alone": fx_rewrites.compile(Branch(model, "short"), (x,), dynamic_shapes=seq, backend=iree),
        "long alone": fx_rewrites.compile(Branch(model, "long"), (x,), dynamic_shapes=seq, backend=iree),
    }
    program = torch.export.export(model, (x,), dynamic_shapes=seq)
    where = fx_rewrites.apply(program, iree.rules).program  # what cond_to_where compiles: both sides, selected
    funcs["cond_to_where"] = iree.compile(where, (x,))
    print(f"CPU: {_cpu()}; one thread each, CPU time, {rounds} interleaved rounds, median ms per call")
    for n in (8, 48):
        xs = torch.randn(4, n, 256)
        times: dict[str, list[float]] = {name: [] for name in funcs}
        for _ in range(rounds):
            for name, fn in funcs.items():
                if name == ("long alone" if n <= 16 else "short alone"):
                    continue
                start = time.process_time()
                for _ in range(20):
                    fn(xs)
                times[name].append((time.process_time() - start) / 20 * 1e3)
        cells = ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items() if t)
        print(f"n = {n} ({'short' if n <= 16 else 'long'} side): {cells}")


if __name__ == "__main__":
    main()
