"""What a call of a compiled IREE module costs beyond the module's own run, per path (backends/iree/calling.py).

    python benchmarks/call_overhead.py [--rounds 21] [--cases linear,sin,conv1x1] [--single]

Cases: `linear` (torch.nn.Linear 1024->1024 on 128 rows, static sizes; the weight a parameter read from the
tensor's memory), `sin` (torch.sin on 64 x n with a Dim on n, n = 64: the short side of
benchmarks/size_dispatch.py's `elementwise` case) and `conv1x1` (conv_classes.py's 1x1 256->64 on 56x56). Per case,
in interleaved rounds (one thread each: torch.set_num_threads(1), IREE local-sync; CPU time, time.process_time),
the median time a call of:

- `eager`: the module in torch;
- `module function`: the IREE function called through iree.runtime with a numpy array in and the result
  copied to a numpy array (no checks, no torch on either side: the floor the Python paths stand on);
- `compiled`: `IreeCompiled.__call__`, the path a call takes now (on a CPU device `host_call.HostCall`);
- `invoker path`: `calling.fast_call`, the path before `HostCall` (numpy arrays, `Invoker`);
- `general path`: `IreeCompiled.call_bound`, what every call did before (`convention.bind`, iree.runtime's
  invoker, a DeviceArray per result), still taken by calls with keyword arguments or mutations.

`--single`: one call a sample and the paths in a new (seeded) order each round, so each call starts with the caches
as another path's run left them (as `conv_classes.py --shuffle` times its rows): the call's own steps then cost
several times what they cost in a loop (docs/performance.md "The call's own steps, cold").

`compiled - module function` and `general path - module function` are the Python around the module's run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.cache import CompileCache
from fx_rewrites.backends.iree.calling import fast_call


class Sin(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


def _linear() -> tuple[torch.nn.Module, torch.Tensor, Any, int]:
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 1024), torch.randn(128, 1024, generator=torch.Generator().manual_seed(1)), None, 20


def _sin() -> tuple[torch.nn.Module, torch.Tensor, Any, int]:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    return Sin(), x, ({1: Dim("n", min=2, max=1024)},), 500


def _conv1x1() -> tuple[torch.nn.Module, torch.Tensor, Any, int]:
    torch.manual_seed(0)
    x = torch.randn(1, 256, 56, 56, generator=torch.Generator().manual_seed(1))
    return torch.nn.Conv2d(256, 64, 1), x, None, 20


#: case -> () -> (model, input, dynamic_shapes, calls a sample)
CASES: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor, Any, int]]] = {
    "linear": _linear,
    "sin": _sin,
    "conv1x1": _conv1x1,
}


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    flags = [f for f in lines.get("Flags", "").split() if f in wanted]
    return f"{lines.get('Model name', '?').strip()} ({', '.join(flags)})"


def run_case(name: str, rounds: int, iree: IreeBackend, single: bool = False) -> None:
    model, x, dynamic, calls = CASES[name]()
    calls = 1 if single else calls
    model = model.eval()
    compiled = fx_rewrites.compile(model, (x,), dynamic_shapes=dynamic, backend=iree).runtime
    function, array = compiled.function, x.numpy()

    def module_function() -> Any:
        return np.array(function(array).to_host(), copy=True)

    paths: dict[str, Callable[[], Any]] = {
        "eager": lambda: model(x),
        "module function": module_function,
        "compiled": lambda: compiled(x),
        "general path": lambda: compiled.call_bound(x),
    }
    invoker = fast_call(compiled.plan, function, host_memory=True)
    if invoker is not None:
        paths["invoker path"] = lambda: invoker((x,))
    with torch.no_grad():
        want = model(x)
        for label in paths:
            if label not in ("eager", "module function"):
                torch.testing.assert_close(paths[label](), want, rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {label: [] for label in paths}
        order, rng = list(paths), random.Random(0)
        for _ in range(rounds):
            if single:
                rng.shuffle(order)
            for label in order:
                fn = paths[label]
                start = time.process_time()
                for _ in range(calls):
                    fn()
                times[label].append((time.process_time() - start) / calls * 1e6)
    us = {label: statistics.median(t) for label, t in times.items()}
    floor = us["module function"]
    print(f"{name} ({calls} calls a sample): " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))
    for label in (k for k in paths if k not in ("eager", "module function")):
        spread = statistics.median(a - b for a, b in zip(times[label], times["module function"]))
        print(f"  {label} - module function: {us[label] - floor:.1f} us (median of rounds {spread:.1f})")
    for label in ("compiled", "invoker path"):
        if label in times:
            ratio = statistics.median(a / b for a, b in zip(times[label], times["eager"]))
            print(f"  {label} / eager {ratio:.3f} (median of rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--single", action="store_true", help="one call a sample, the paths shuffled each round")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    iree = IreeBackend(driver="local-sync", cache=CompileCache())
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    mode = "one call a sample, shuffled" if ns.single else "interleaved"
    print(f"CPU: {cpu()}; one thread each, CPU time, {ns.rounds} rounds, {mode}; load average {load}")
    for name in ns.cases.split(","):
        run_case(name, ns.rounds, iree, ns.single)


if __name__ == "__main__":
    main()
