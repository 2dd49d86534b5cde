"""Weights inline or as parameters: how fast the compiled module runs, to choose `parameters.INLINE_LIMIT`.

    python benchmarks/parameters.py                          # benchmarks/runtime_models.py's bert, llama, vit, resnet
    python benchmarks/parameters.py --models resnet --repeat 15 --limits inf,0,65536,1048576
    python benchmarks/parameters.py --models conv2d,conv3d,depthwise,linear   # one op each

Each model is exported, rewritten with the IREE rules and compiled once per
inline limit (`FX_REWRITES_IREE_INLINE_LIMIT`: weights of that many bytes or
more are parameters; `inf` keeps every weight inline, `0` makes every weight
of more than one element a parameter). IREE folds and packs inline constants
at compile time (data tiling's pack of a matmul or conv weight); a parameter
is unknown at compile time, so that work is hoisted to the module's
initialiser or stays in every call. One thread each (torch.set_num_threads(1),
IREE local-sync), CPU time of the calling thread, every variant called in turn
each round (medians), against eager; outputs compared with eager (rtol 1e-4).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from runtime_models import MODELS

import fx_rewrites
from fx_rewrites.backends.iree import CompileCache, IreeBackend
from fx_rewrites.backends.iree.parameters import INLINE_ENV


class _Op(torch.nn.Module):
    """One op whose weight is large: does a parameter cost it what an inline constant does not?"""

    def __init__(self, op: torch.nn.Module) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


#: single ops, each with its input (the weights: conv2d 2.4 MB, conv3d 0.44 MB, depthwise 9 KB, linear 4 MB)
OPS = {
    "conv2d": (lambda: torch.nn.Conv2d(256, 256, 3, padding=1), (1, 256, 28, 28)),
    "conv3d": (lambda: torch.nn.Conv3d(64, 64, 3, padding=1), (1, 64, 8, 28, 28)),
    "depthwise": (lambda: torch.nn.Conv2d(256, 256, 3, padding=1, groups=256), (1, 256, 56, 56)),
    "linear": (lambda: torch.nn.Linear(1024, 1024), (128, 1024)),
}


def _model(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    if name in OPS:
        build, shape = OPS[name]
        torch.manual_seed(0)
        return _Op(build()).eval(), (torch.randn(shape),), {}
    spec = MODELS[name]
    call_args, call_kwargs = spec.inputs(False, 0)
    return spec.model(), call_args, call_kwargs


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,llama,vit,resnet")
    parser.add_argument("--limits", default="inf,0,65536,1048576")
    parser.add_argument("--repeat", type=int, default=11)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["FX_REWRITES_IREE_CACHE"] = "off"
    limits = args.limits.split(",")
    print(f"CPU: {cpu_model()}; one thread each, CPU time per call (ms), median of {args.repeat} rounds")
    print(f"| model | eager | {' | '.join(f'limit {lim}' for lim in limits)} |")
    print(f"|---|---|{'---|' * len(limits)}")
    for name in args.models.split(","):
        model, call_args, call_kwargs = _model(name)
        backend = IreeBackend(driver="local-sync", cache=CompileCache())
        with torch.no_grad():
            expected = model(*call_args, **call_kwargs)
            program = torch.export.export(model, call_args, call_kwargs)
            rewritten = fx_rewrites.apply(program, backend.rules).program
        fns = {"eager": lambda m=model, a=call_args, k=call_kwargs: m(*a, **k)}
        info = {}
        for limit in limits:
            os.environ[INLINE_ENV] = str(1 << 62) if limit == "inf" else limit
            start = time.perf_counter()
            compiled = backend.compile(rewritten, call_args)
            info[limit] = (time.perf_counter() - start, len(compiled.parameters), len(compiled.vmfb))
            got = compiled(*call_args, **call_kwargs)
            a, b = (torch.utils._pytree.tree_leaves(v)[0] for v in (got, expected))
            assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4), (name, limit, (a - b).abs().max())
            fns[limit] = lambda c=compiled, a=call_args, k=call_kwargs: c(*a, **k)
        os.environ.pop(INLINE_ENV, None)
        spent = {k: [] for k in fns}
        with torch.no_grad():
            for _ in range(2):
                for fn in fns.values():
                    fn()
            for _ in range(args.repeat):
                for k, fn in fns.items():
                    start = time.thread_time()
                    fn()
                    spent[k].append(time.thread_time() - start)
        ms = {k: statistics.median(v) * 1e3 for k, v in spent.items()}
        cells = [f"{ms[lim]:.1f} ({ms[lim] / ms['eager']:.2f}x)" for lim in limits]
        print(f"| {name} | {ms['eager']:.1f} | {' | '.join(cells)} |", flush=True)
        for lim in limits:
            seconds, n, size = info[lim]
            print(f"    limit {lim}: compile {seconds:.1f} s, {n} parameters, vmfb {size / 1e6:.2f} MB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
