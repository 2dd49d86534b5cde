"""The decoders of `benchmarks/scale.py` at steady state: each route's call against eager, one thread each.

    python benchmarks/decoder_steady.py                          # 0.3b: export route, torch.compile route, Inductor
    flock /tmp/fx-bigmem.lock python benchmarks/decoder_steady.py --sizes 0.3b,1b --json docs/decoder_steady.json
    python benchmarks/decoder_steady.py --plot docs/decoder_steady.json docs/decoder_steady.png   # the plot

One child process per (size, route), one at a time, so that each holds the
model once and one compiled copy, and its peak RSS (VmHWM) is that route's:
the export route (`fx_rewrites.compile`, weights as IREE parameters), the
torch.compile route (`torch.compile(model, backend="fx_rewrites_iree")`,
frozen weights bound as IREE parameters) and Inductor (`torch.compile(model)`).
Each child builds the decoder of `scale.DECODERS` (LlamaForCausalLM, seeded
random weights, float32, eval, batch 1, 128 tokens, use_cache=False), times
the compile (wall clock) and the first call, compares the logits with eager's
(rtol 1e-3, atol 1e-3), then runs interleaved rounds: eager, then the route,
each call timed in CPU time of the process (`time.process_time`) with one
thread (torch.set_num_threads(1), IREE local-sync); the medians and their
ratio come from the same process and the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import DECODERS, ROOT, TOKENS, _peak_gb, cpu_model

ROUTES = ("export", "torch.compile", "inductor")


def child(size: str, route: str, rounds: int, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    import torch
    import transformers

    import fx_rewrites
    from fx_rewrites.backends.dynamo import dynamo_backend
    from fx_rewrites.backends.iree import IreeBackend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, num_key_value_heads=DECODERS[size]["num_attention_heads"], **DECODERS[size]
    )
    model = transformers.LlamaForCausalLM(config).eval()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ids = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    row: dict[str, Any] = {"size": size, "route": route, "weights_gb": weights / 1e9}
    row["parameters"] = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        row["built_peak_gb"] = _peak_gb()
        start = time.perf_counter()
        if route == "export":
            compiled = fx_rewrites.compile(
                model, (ids,), {"use_cache": False}, backend=IreeBackend(driver="local-sync")
            )
        elif route == "torch.compile":
            backend = dynamo_backend(IreeBackend(driver="local-sync"), strict=True)
            compiled = torch.compile(model, backend=backend)
        else:
            compiled = torch.compile(model)
        got = compiled(ids, use_cache=False).logits  # the torch.compile routes compile here
        row["compile_and_first_call_s"] = time.perf_counter() - start
        row["peak_gb"] = _peak_gb()
        row["max_abs_diff"] = float((got - expected).abs().max())
        row["matches_eager"] = bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-3))
        row["same_argmax"] = bool(torch.equal(got.argmax(-1), expected.argmax(-1)))
        times: dict[str, list[float]] = {"eager": [], route: []}
        fns = {"eager": model, route: compiled}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.process_time()
                fn(ids, use_cache=False)
                times[name].append(time.process_time() - start)
    row["eager_s"] = statistics.median(times["eager"])
    row["route_s"] = statistics.median(times[route])
    row["ratio"] = row["route_s"] / row["eager_s"]
    row["rounds"] = rounds
    out.write_text(json.dumps(row))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Decoder steady call (LlamaForCausalLM, float32, batch 1, {TOKENS} tokens), one thread each, CPU time, "
        f"medians of interleaved rounds with eager in the same process, on {cpu_model()}:",
        "",
        "| size | route | compile + first call s | peak RSS | peak / weights | logits vs eager (rtol 1e-3) | "
        "eager s | route s | route / eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['route']} | {r['error']} | | | | | | |")
            continue
        ok = "ok" if r["matches_eager"] else f"differs ({r['max_abs_diff']:.2g})"
        lines.append(
            f"| {r['size']} ({r['parameters'] / 1e6:.0f}M) | {r['route']} | {r['compile_and_first_call_s']:.1f} | "
            f"{r['peak_gb']:.2f} GB | {r['peak_gb'] / r['weights_gb']:.2f}x | {ok} ({r['max_abs_diff']:.1e}) | "
            f"{r['eager_s']:.3f} | {r['route_s']:.3f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in rows if "ratio" in r}, key=list(DECODERS).index)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(ROUTES)
    for k, route in enumerate(ROUTES):
        found = {r["size"]: r["ratio"] for r in rows if r.get("route") == route and "ratio" in r}
        xs = [i + k * width for i, s in enumerate(sizes) if s in found]
        ax.bar(xs, [found[s] for s in sizes if s in found], width, label=route)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(ROUTES) - 1) / 2 for i in range(len(sizes))], sizes)
    ax.set_ylabel("steady call / eager (CPU time)")
    ax.set_title("Llama decoder, batch 1, 128 tokens, one thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.3b")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("ROWS_JSON", "PNG"), help="plot saved rows")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return 0
    if args.child:
        child(args.child[0], args.child[1], args.rounds, args.out)
        return 0
    rows = []
    for size in args.sizes.split(","):
        for route in args.routes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "row.json"
                env = {**os.environ, "FX_REWRITES_IREE_CACHE": "off", "OMP_NUM_THREADS": "1"}
                command = [sys.executable, __file__, "--child", size, route, "--rounds", str(args.rounds)]
                proc = subprocess.run([*command, "--out", str(out)], env=env, check=False, cwd=ROOT)
                if out.is_file():
                    row = json.loads(out.read_text())
                else:
                    row = {"size": size, "route": route, "error": f"exit {proc.returncode}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
