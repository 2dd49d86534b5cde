"""IREE on a GPU (CUDA) against torch eager and torch.compile (Inductor) on the same GPU.

Two steps, because a GPU machine may have no iree-compile (its wheel is large)
while any machine compiles for CUDA:

    python benchmarks/gpu_runtime.py prepare --out BUNDLE [--models bert,vit] [--quick]
        here: export each benchmark model (benchmarks/runtime_models.py), apply the
        `iree-cuda` backend's rules, compile for CUDA (sm_80), save the vmfb (and its weights of 64 KiB or
        more as an .irpa), the call
        plan, the inputs and a checksum of the weights
    python benchmarks/gpu_runtime.py run --bundle BUNDLE --out RESULT.md
        on the GPU machine (torch with CUDA, transformers, iree-base-runtime; no
        fx_rewrites needed): rebuild each model from its seed, check the weights'
        checksum, time torch eager, Inductor and the IREE module on the GPU, compare
        IREE's outputs with eager's

Times: medians of --repeat calls after warm-up; torch is timed to
`torch.cuda.synchronize()`, IREE's synchronous `main` to its return; inputs
are on the GPU before timing for all three. TF32 is off for torch (IREE
computes f32 in f32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from runtime_models import MODELS
from torch.utils import _pytree as pytree

#: the input sets each model is compared on (the first is timed); rebuilt from their seeds on the GPU machine
SEEDS = (0, 1)


def checksum(tensors: Any) -> str:
    """A fingerprint of the tensors in `tensors` (a model's state dict, inputs): SHA-256 of their bytes."""
    digest = hashlib.sha256()
    for leaf in pytree.tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor):
            digest.update(leaf.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def performance_phase(name: str) -> Any:
    """`--rules`: the backend's own rules, or those then the llvm-cpu performance rules (to measure them on a GPU)."""
    from fx_rewrites.backends.iree.rules import performance
    from fx_rewrites.ruleset import RuleSet

    by_name = {rule.name: rule for rule in performance.ALL}
    if name == "backend":
        return None
    if name == "llvm-cpu-perf":
        return performance.for_target("llvm-cpu", "avx512")  # the llvm-cpu rules as measured on an AVX-512 host
    return RuleSet([by_name[n] for n in name.split("+")], name=name)


# ----------------------------------------------------------------------------- prepare (any machine)


def prepare(args: argparse.Namespace) -> int:
    import fx_rewrites
    from fx_rewrites import backends
    from fx_rewrites.backends.iree import CompileCache, IreeBackend
    from fx_rewrites.backends.iree.parameters import write_archive
    from fx_rewrites.ruleset import Phases

    registered = backends.get(args.backend)
    backend = IreeBackend(name=registered.name, target=registered.target, cache=CompileCache())
    extra = performance_phase(args.rules)
    if extra is not None:
        backend = IreeBackend(
            name=backend.name, target=backend.target, rules=Phases(*backend.rules.sets, extra), cache=CompileCache()
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"backend": backend.name, "flags": list(backend.flags), "quick": args.quick, "models": {}}
    if (out / "manifest.json").exists():  # add models (under other rules) to a bundle
        manifest = json.loads((out / "manifest.json").read_text())
    for name in args.models.split(",") if args.models else MODELS:
        key = name if args.rules == "backend" else f"{name}@{args.rules}"
        spec = MODELS[name]
        model = spec.model(args.quick)
        pos, kw = spec.inputs(args.quick, 0)
        start = time.perf_counter()
        result = fx_rewrites.apply(torch.export.export(model, pos, kw), backend.rules)
        artifact = backend.artifact(result.program)
        (out / f"{key}.vmfb").write_bytes(artifact.vmfb)
        if artifact.parameters:  # the weights of 64 KiB or more: the module reads them as parameters
            write_archive(artifact.parameters, out / f"{key}.irpa")
        manifest["models"][key] = {
            "model": name,
            "rules": args.rules,
            "args": [a for a in artifact.plan.args if isinstance(a, int)],
            "outputs": [o.result for o in artifact.plan.outputs],
            "checksum": checksum(model.state_dict()),
            "inputs_checksum": checksum([spec.inputs(args.quick, seed) for seed in SEEDS]),
            "fired": dict(result.report.rewrites),
            "compile_s": time.perf_counter() - start,
            "vmfb_bytes": len(artifact.vmfb),
        }
        print(f"{key}: {len(artifact.vmfb) / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s", flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


# ----------------------------------------------------------------------------- run (the GPU machine)


def _median_ms(fn: Any, repeat: int, sync: Any) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _flat_inputs(inputs: Any, indices: list[int]) -> list[torch.Tensor]:
    flat = pytree.tree_leaves(inputs)
    return [flat[i] for i in indices]


def _to(device: torch.device, tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def measure(key: str, entry: dict[str, Any], quick: bool, rt: Any, device: Any, args: argparse.Namespace) -> dict:
    """One model's row: same weights?, IREE against eager on both input sets, eager / IREE / Inductor times."""
    torch_device = torch.device(args.torch_device)
    sync = torch.cuda.synchronize if torch_device.type == "cuda" else (lambda: None)
    spec = MODELS[entry["model"]]
    model = spec.model(quick)
    inputs = [spec.inputs(quick, seed) for seed in SEEDS]
    same = checksum(model.state_dict()) == entry["checksum"] and checksum(inputs) == entry["inputs_checksum"]
    model = model.to(torch_device)
    config = rt.Config(device=device)
    vmfb = (Path(args.bundle) / f"{key}.vmfb").read_bytes()
    modules = []
    archive = Path(args.bundle) / f"{key}.irpa"
    if archive.is_file():  # served under scope "model", as fx_rewrites.load does
        index = rt.ParameterIndex()
        index.load(str(archive))
        modules.append(rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model")))
    modules.append(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    main = rt.load_vm_modules(*modules, config=config)[-1]["main"]
    row: dict[str, Any] = {"model": key, "same_weights": same, "max_diff": 0.0, "close": True}
    with torch.no_grad():
        for pos, kw in inputs:
            on_device_pos, on_device_kw = _to(torch_device, (pos, kw))
            expected = [t.float().cpu() for t in pytree.tree_leaves(model(*on_device_pos, **on_device_kw))]
            results = main(*(rt.asdevicearray(device, t.numpy()) for t in _flat_inputs((pos, kw), entry["args"])))
            results = results if isinstance(results, (tuple, list)) else (results,)
            got = [torch.from_numpy(results[i].to_host().copy()).float() for i in entry["outputs"] if i is not None]
            for g, e in zip(got, expected, strict=True):
                row["max_diff"] = max(row["max_diff"], (g - e).abs().max().item())
                row["close"] = row["close"] and torch.allclose(g, e, rtol=args.tol, atol=args.tol)
        row["matches"] = same and row["close"]
        (pos, kw) = _to(torch_device, inputs[0])
        device_args = [rt.asdevicearray(device, t.numpy()) for t in _flat_inputs(inputs[0], entry["args"])]
        row["eager_ms"] = _median_ms(lambda: model(*pos, **kw), args.repeat, sync)
        row["iree_ms"] = _median_ms(lambda: main(*device_args), args.repeat, lambda: None)
        if args.inductor and entry["rules"] == "backend":
            torch._dynamo.reset()
            inductor = torch.compile(model)
            start = time.perf_counter()
            try:
                inductor(*pos, **kw)
                sync()
                row["inductor_compile_s"] = time.perf_counter() - start
                row["inductor_ms"] = _median_ms(lambda: inductor(*pos, **kw), args.repeat, sync)
            except Exception as e:  # report it in the table, do not stop
                row["inductor_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return row


def run(args: argparse.Namespace) -> int:
    import iree.runtime as rt

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    manifest = json.loads((Path(args.bundle) / "manifest.json").read_text())
    device = rt.get_device(args.device)
    on_gpu = torch.device(args.torch_device).type == "cuda"
    gpu = torch.cuda.get_device_name() if on_gpu else f"{args.torch_device} (a dry run)"
    rows = []
    for name, entry in manifest["models"].items():
        rows.append(measure(name, entry, manifest["quick"], rt, device, args))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows, gpu, manifest, args.repeat)
    print(text)
    Path(args.out).write_text(text + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}))
    return 0 if all(r["matches"] for r in rows) else 1


def table(rows: list[dict[str, Any]], gpu: str, manifest: dict[str, Any], repeat: int) -> str:
    lines = [
        f"{gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), IREE 3.13 `{manifest['backend']}` "
        f"({' '.join(manifest['flags'])}); median of {repeat} calls; TF32 off. model@rules: the backend's rules, "
        "then those performance rules.",
        "",
        "| model | eager ms | Inductor / eager | **IREE / eager** | IREE matches eager (max diff) |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        inductor = f"{r['inductor_ms'] / r['eager_ms']:.2f}" if "inductor_ms" in r else "-"
        inductor = "fails" if "inductor_error" in r else inductor
        ok = "yes" if r["matches"] else ("NO" if r["same_weights"] else "weights or inputs differ")
        lines.append(
            f"| {r['model']} | {r['eager_ms']:.2f} | {inductor} | **{r['iree_ms'] / r['eager_ms']:.2f}** | "
            f"{ok} ({r['max_diff']:.1e}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="export, rewrite and compile for the GPU (no GPU needed)")
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="")
    p.add_argument("--backend", default="iree-cuda", help="iree for a CPU dry run of `run`")
    p.add_argument(
        "--rules", default="backend", help="backend, llvm-cpu-perf, or performance rules joined by + to add as a phase"
    )
    p.add_argument("--quick", action="store_true")
    r = sub.add_parser("run", help="on the GPU machine: time and compare")
    r.add_argument("--bundle", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda", help="IREE device (local-task for a CPU dry run)")
    r.add_argument("--torch-device", default="cuda", help="torch device (cpu for a dry run)")
    r.add_argument("--no-inductor", dest="inductor", action="store_false")
    r.add_argument("--repeat", type=int, default=50)
    r.add_argument("--tol", type=float, default=1e-3, help="rtol = atol of IREE against eager on the GPU")
    args = parser.parse_args(argv)
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
