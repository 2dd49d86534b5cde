"""ttnn coverage of the gallery (examples/) and the transformers zoo (tests/zoo): what lowers, what stays on host.

Per model: call nodes after DEFAULT, those computed from the model's
constants only (once, on the host: not per-call work, left out of the share),
how many the ttnn pack lowered (device share of the rest), device and host
regions, the ops left on the host most often (and
why), the largest difference from eager (and relative to the largest eager
output) when the compiled program runs on
the ttnn test double (tests/backends/ttnn/reference_ttnn/: bfloat16, tile
padding) and the seconds it took. Nothing is compiled for IREE.

    python benchmarks/ttnn_coverage.py [--only gallery|zoo] [--models bert,resnet] [--no-run]

Prints a Markdown table; exits 1 if a model that torch exports fails to lower.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.* from a checkout

import torch
from torch.utils import _pytree as pytree

from fx_rewrites import backends
from fx_rewrites.backends.ttnn import lower, runtime
from fx_rewrites.backends.ttnn.coverage import coverage

#: the backend's tolerance against eager (bfloat16 on the device): rtol = atol = 3e-2
TOL = 3e-2


def _max_diff(got: Any, expected: Any) -> str:
    """Largest |got - eager| over the float outputs, and that over the largest |eager|."""
    pairs = [
        (g.float(), e.float())
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
        if isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel()
    ]
    diff = max(((g - e).abs().max().item() for g, e in pairs), default=0.0)
    scale = max((e.abs().max().item() for _, e in pairs), default=0.0)
    # assert_close(rtol=atol=3e-2) holds where every |got - eager| <= 3e-2 + 3e-2 * |eager|: the worst ratio
    worst = max((((g - e).abs() / (TOL + TOL * e.abs())).max().item() for g, e in pairs), default=0.0)
    verdict = "ok" if worst <= 1.0 else f"FAILS x{worst:.1f}"
    return (f"{diff:.2e} ({diff / scale:.1e})" if scale else f"{diff:.2e}") + f" | {verdict}"


def _cases(only: str | None, names: set[str] | None):
    """(name, module, args, kwargs, dynamic_shapes, expected export error) per model."""
    if only in (None, "gallery"):
        from fx_rewrites.app.gallery import gallery

        for e in gallery():
            if names is None or e.name in names:
                module, args = e.make()
                yield f"gallery/{e.name}", module, tuple(args), {}, e.dynamic_shapes, ""
    if only in (None, "zoo"):
        from tests.zoo import registry

        for m in registry.MODELS if names else registry.FIRST:
            if names is None or m.name in names:
                args, kwargs = m.inputs(registry.SEEDS[0])
                yield f"zoo/{m.name}", m.model(), tuple(args), dict(kwargs), None, m.export_error


def _top_host_ops(cov: Any, k: int = 3) -> str:
    ops = sorted((o for o in cov.ops if o.on_host), key=lambda o: -o.on_host)[:k]
    return "; ".join(f"{o.op.removeprefix('aten.')} x{o.on_host} ({o.reasons[0][0]})" for o in ops) or "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("gallery", "zoo"))
    p.add_argument("--models", help="comma-separated names (gallery or zoo)")
    p.add_argument("--no-run", action="store_true", help="do not run the compiled programs on the test double")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from tests.backends.ttnn import reference_ttnn

    runtime.use(reference_ttnn)
    names = set(args.models.split(",")) if args.models else None
    backend = backends.get("ttnn")
    rows, failed, share = [], [], {}
    for name, module, margs, mkwargs, dynamic, export_error in _cases(args.only, names):
        start = time.perf_counter()
        try:
            program = torch.export.export(module, margs, mkwargs or None, dynamic_shapes=dynamic)
        except Exception as e:
            status = "expected" if export_error else "UNEXPECTED"
            rows.append(f"| {name} | torch.export fails ({status}: {type(e).__name__}) | | | | | | | |")
            if not export_error:
                failed.append(name)
            continue
        try:
            cov = coverage(program, name)
            fn = backend.compile(lower(program), margs)
            diff = "- | -"
            if not args.no_run:
                with torch.no_grad():
                    diff = _max_diff(fn(*margs, **mkwargs), module(*margs, **mkwargs))
        except Exception as e:
            failed.append(name)
            rows.append(f"| {name} | FAILS: {type(e).__name__}: {' '.join(str(e).split())[:200]} | | | | | | | |")
            traceback.print_exc(file=sys.stderr)
            continue
        p_ = cov.partitioning
        share[name] = cov.device_share
        rows.append(
            f"| {name} | {cov.nodes} | {cov.nodes_once} | {cov.nodes_on_device} ({cov.device_share:.0%}) | "
            f"{len(p_.device_regions)} / {len(p_.host_regions)} | {_top_host_ops(cov)} | {diff} | "
            f"{time.perf_counter() - start:.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    print(
        "| model | nodes | once (constants) | on device (share) | regions device / host | "
        "most frequent on host (why) | max abs diff on the double (/ max abs eager) | rtol = atol = 3e-2 | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for group in ("gallery", "zoo"):
        shares = sorted(v for k, v in share.items() if k.startswith(group + "/"))
        if shares:
            print(
                f"\n{group}: {len(shares)} models, device share median {statistics.median(shares):.0%}, "
                f"min {shares[0]:.0%}, {sum(s >= 0.9 for s in shares)} at 90% or more"
            )
    if failed:
        print(f"\nfailed to lower: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
