"""Models at the sizes people run: peak memory and the time of each step of `fx_rewrites.compile` (issue 25).

    python benchmarks/scale.py                  # the decoder at 0.1B and 0.3B
    python benchmarks/scale.py --sizes 0.3b,1b  # and the 1B of issue 25 (about 9 GB of memory)
    flock /tmp/fxr-heavy.lock python benchmarks/scale.py --sizes tinyllama   # TinyLlama's shape, 4.4 GB (issue 34)
    python benchmarks/scale.py --cnn            # the CNN row: ResNet-50 (benchmarks/scale_cnn.py)
    python benchmarks/scale.py --cnn --isa avx2 # AVX2 (on an AVX-512 host: emulated, benchmarks/cpu_isa.py)

Each size runs in a child process of its own (one at a time), so its peak
memory is its own: `python peak` is the child's peak RSS (VmHWM), `iree-compile
peak` that of the compiler it started and `tree peak` that of the two together
(both sampled every 50 ms; a child is counted once it runs another program: between its fork and its exec
it reads as this process's RSS), and per step the peak of each (JSON `step_peaks_gb`, a step inside another
as `save > iree-compile`); the bar is peak <= 3x the weights' bytes. The decoder is
a transformers LlamaForCausalLM (seeded random weights, float32, eval),
batch 1, 128 tokens, use_cache=False. Steps, in seconds: build (the model),
export (torch.export), rules (fx_rewrites.apply with the IREE rules),
import (torch -> MLIR, with the weights as parameters), iree-compile, load
(the runtime's packed copy of the weights), first call, eager (one call of
the model), second call and eager again (one more call of each; wall clock
and default threads, not yet the interleaved one-thread rounds issue 25
asks for), save (`compiled.save(vmfb, params=irpa)`: on llvm-cpu the module
compiled again with the weights' packing split out and IREE's parameter encoder
run, the archive holding the weights as the kernels read them,
`backends/iree/encoding.py`), load here and call loaded (`fx_rewrites.load` of the
saved files and a call, in this process: compile + save + load in one process,
its peak); then `fx_rewrites.load` of the saved files and its first call in a
fresh process, as where they are deployed (its own peak, and how much of its
RSS after the call is the archive's mapped pages).
The compiled logits are compared with eager's (rtol 1e-3, atol 1e-3), before
and after the reload. Not yet here (issue 25 item 3): the CNN row,
steady-state calls against eager and Inductor, the torch.compile route.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_isa  # noqa: E402

#: LlamaConfig fields by size (vocab 32000, 16 heads; intermediate about 2.7x hidden as Llama's)
DECODERS: dict[str, dict[str, int]] = {
    "0.1b": {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12, "intermediate_size": 2048},
    "0.3b": {"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "intermediate_size": 3584},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "intermediate_size": 5632},
    # TinyLlama-1.1B's shape (22 layers, 32 heads, 4 key/value heads): 1.1B parameters, 4.4 GB in float32
    "tinyllama": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
    },
}
TOKENS = 128


def cpu_model() -> str:
    """lscpu's model name, the vector extensions the flags list, and the core count (benchmarks/cpu_isa.py)."""
    return cpu_isa.cpu_model()


def _peak_gb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage: Linux keeps ru_maxrss across execve, so a process
    started from a big one (iree-compile, the reload) reports its parent's RSS as its own peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / 1e9


class TreePeak:
    """Samples the RSS of this process and of its children (iree-compile) every `interval` s: the peak of
    their sum, and the children's peak."""

    def __init__(self, interval: float = 0.05) -> None:
        import threading

        self.tree = self.children = 0
        #: the step running now (innermost last) and, per step, the peak of this process and of its children
        self.labels: list[str] = []
        self.by_step: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    @staticmethod
    def _rss(pid: str) -> int:
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def _children(self) -> list[str]:
        """The children that run a program of their own. A child between its fork and its exec is this
        process's image (its RSS reads as this process's, up to 9.2 GB at the 1.1B size, counted once more as a
        "compiler peak" before this check): it is left out."""
        me, python = str(os.getpid()), os.readlink("/proc/self/exe")
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[1] == me and os.readlink(stat.parent / "exe") != python:
                    found.append(stat.parent.name)
            except (OSError, IndexError):
                continue
        return found

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            children = sum(self._rss(pid) for pid in self._children())
            mine = self._rss("self")
            self.children = max(self.children, children)
            self.tree = max(self.tree, mine + children)
            if self.labels:
                peaks = self.by_step.setdefault(" > ".join(self.labels), [0, 0])
                peaks[0], peaks[1] = max(peaks[0], mine), max(peaks[1], children)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return self.tree / 1e9, self.children / 1e9


def _status_gb(field: str) -> float:
    """A field of /proc/self/status in GB (VmHWM, RssFile, RssAnon)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) * 1024 / 1e9


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def child(size: str, out: Path, workdir: Path, isa: str = "host") -> None:
    """One size, in this process: every step timed, results as JSON in `out`."""
    sys.path.insert(0, str(ROOT))
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()  # PyPI's torchvision (a CUDA build) is imported by transformers
    import torch
    import transformers

    import fx_rewrites
    from fx_rewrites import api
    from fx_rewrites.app import compile as app_compile
    from fx_rewrites.backends.iree import backend as iree_backend
    from fx_rewrites.backends.iree import encoding as iree_encoding

    row: dict[str, Any] = {"size": size, **DECODERS[size]}
    sampler = TreePeak()
    steps: dict[str, float] = {}

    memory: dict[str, tuple[float, float]] = {}

    def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        sampler.labels.append(name)
        try:
            result = fn(*args, **kwargs)
        finally:
            sampler.labels.pop()
        steps[name] = steps.get(name, 0.0) + time.perf_counter() - start
        memory[name] = (_rss_gb(), _peak_gb())  # RSS after the step, peak so far
        return result

    def wrap(module: Any, name: str, attribute: str) -> None:  # time each step where fx_rewrites calls it
        original = getattr(module, attribute)
        setattr(module, attribute, lambda *a, **k: timed(name, original, *a, **k))

    wrap(iree_backend, "import", "import_mlir")
    wrap(iree_backend, "iree-compile", "run_iree_compile")
    wrap(iree_encoding, "encoder iree-compile", "run_iree_compile")  # the save's second compile
    wrap(iree_encoding, "encoder run", "run_encoder")
    wrap(app_compile, "export", "_export")
    wrap(iree_backend.IreeBackend, "module load", "load")  # the compiled module started in this process
    wrap(api, "rules", "apply")

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        fields = {"num_key_value_heads": DECODERS[size]["num_attention_heads"], **DECODERS[size]}
        config = transformers.LlamaConfig(vocab_size=32000, **fields)
        return transformers.LlamaForCausalLM(config).eval()

    model = timed("build", build)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row["weights_gb"] = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    ids = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    kwargs = {"use_cache": False}
    with torch.no_grad():
        expected = timed("eager", model, ids, **kwargs).logits
        start = time.perf_counter()
        compiled = fx_rewrites.compile(model, (ids,), kwargs, backend=cpu_isa.backend(isa))
        others = sum(steps[s] for s in ("export", "rules", "import", "iree-compile"))
        steps["load"] = time.perf_counter() - start - others
        runtime = compiled.runtime
        got = timed("first call", compiled, ids, **kwargs).logits
        timed("second call", compiled, ids, **kwargs)
        timed("eager again", model, ids, **kwargs)
        row["matches_eager"] = bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-3))
        row["max_abs_diff"] = float((got - expected).abs().max())
        row["same_argmax"] = bool(torch.equal(got.argmax(-1), expected.argmax(-1)))
        row["mlir_mb"] = len(runtime.mlir) / 1e6
        row["parameters_bound"] = len(runtime.parameters)
        vmfb, irpa = workdir / "model.vmfb", workdir / "model.irpa"
        row["peak_before_save_gb"] = _peak_gb()
        timed("save", compiled.save, vmfb, params=irpa)
        row["save_peak_gb"] = _peak_gb()
        row["vmfb_mb"], row["irpa_gb"] = vmfb.stat().st_size / 1e6, irpa.stat().st_size / 1e9
        torch.save({"ids": ids, "expected": expected}, workdir / "expected.pt")
        # the saved files loaded and called in this process too: compile + save + load in one process
        loaded = timed("load here", fx_rewrites.load, vmfb)
        again = timed("call loaded", loaded, ids, **kwargs).logits
        row["loaded_here_matches_eager"] = bool(torch.allclose(again, expected, rtol=1e-3, atol=1e-3))
        row["one_process_peak_gb"] = _peak_gb()
        del loaded, again
    row["steps_s"] = steps
    row["rss_after_gb"] = {k: round(v[0], 2) for k, v in memory.items()}
    row["peak_after_gb"] = {k: round(v[1], 2) for k, v in memory.items()}
    row["python_peak_gb"] = _peak_gb()
    row["tree_peak_gb"], row["compiler_peak_gb"] = sampler.stop()
    # per step (nested: "save > iree-compile" is the save's compile of the module with its packing split out):
    # the peak RSS of this process and of its children (iree-compile) while it ran, sampled every 50 ms
    row["step_peaks_gb"] = {k: [round(v / 1e9, 2) for v in peaks] for k, peaks in sampler.by_step.items()}
    # the saved files load where they are deployed: in a process of their own
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--reload", str(workdir)], env=env, check=False, cwd=ROOT)
    reloaded = workdir / "reload.json"
    row.update(json.loads(reloaded.read_text()) if reloaded.is_file() else {"reload_error": proc.returncode})
    out.write_text(json.dumps(row))


def reload(workdir: Path) -> None:
    """`fx_rewrites.load` of the saved .vmfb and .irpa in a fresh process, its first call against eager's."""
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    import torch
    import transformers.modeling_outputs  # noqa: F401  (registers CausalLMOutputWithPast, which the convention names)

    import fx_rewrites

    saved = torch.load(workdir / "expected.pt")
    baseline = _peak_gb()  # torch, transformers and IREE imported, nothing loaded
    start = time.perf_counter()
    loaded = fx_rewrites.load(workdir / "model.vmfb")
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        got = loaded(saved["ids"], use_cache=False).logits
    call_s = time.perf_counter() - start
    (workdir / "reload.json").write_text(
        json.dumps(
            {
                "reload_s": load_s,
                "reloaded_first_call_s": call_s,
                "reloaded_matches_eager": bool(torch.allclose(got, saved["expected"], rtol=1e-3, atol=1e-3)),
                "reload_peak_gb": _peak_gb(),
                "reload_baseline_gb": baseline,
                # after the call: what of it is the archive's mapped pages (file) and what the process's own
                "reload_rss_file_gb": _status_gb("RssFile"),
                "reload_rss_anon_gb": _status_gb("RssAnon"),
            }
        )
    )


STEPS = ("build", "export", "rules", "import", "iree-compile", "load", "first call", "second call")
STEPS += ("eager", "eager again", "save", "load here", "call loaded")


def table(rows: list[dict[str, Any]], isa: str = "host") -> str:
    lines = [
        f"Decoder (LlamaForCausalLM, float32, batch 1, {TOKENS} tokens) through `fx_rewrites.compile`. "
        f"{cpu_isa.header(isa)}",
        "",
        "| size | parameters | weights | python peak | iree-compile peak | tree peak | peak / weights | MLIR | "
        + " | ".join(f"{s} s" for s in STEPS)
        + " | compile + save + load in one process: peak, / weights | load in a new process: s, first call s, "
        "peak, / weights (of which mapped file) | logits vs eager (rtol 1e-3) |",
        "|---|" + "---|" * (10 + len(STEPS)),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['error']} |")
            continue
        steps = r["steps_s"]
        ok = "ok" if r["matches_eager"] and r.get("reloaded_matches_eager") else f"differs ({r['max_abs_diff']:.2g})"
        weights, one, re = r["weights_gb"], r.get("one_process_peak_gb", float("nan")), r.get("reload_peak_gb", 0.0)
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.0f}M | {r['weights_gb']:.2f} GB | "
            f"{r['python_peak_gb']:.2f} GB | {r['compiler_peak_gb']:.2f} GB | {r['tree_peak_gb']:.2f} GB | "
            f"{max(r['python_peak_gb'], r['tree_peak_gb']) / r['weights_gb']:.2f}x | {r['mlir_mb']:.2f} MB | "
            + " | ".join(f"{steps.get(s, float('nan')):.1f}" for s in STEPS)
            + f" | {one:.2f} GB, {one / weights:.2f}x"
            + f" | {r.get('reload_s', float('nan')):.1f}, {r.get('reloaded_first_call_s', float('nan')):.1f}, "
            + f"{re:.2f} GB, {re / weights:.2f}x ({r.get('reload_rss_file_gb', float('nan')):.2f} GB) | {ok} |"
        )
    return "\n".join(lines)


def cnn_row(rounds: int, isa: str = "host") -> int:
    """The CNN row (ResNet-50 through the export route, benchmarks/scale_cnn.py) in a child process of its own."""
    env = {**os.environ, "FX_REWRITES_IREE_CACHE": "off"}  # every step from scratch
    script = Path(__file__).resolve().parent / "scale_cnn.py"
    return subprocess.run(
        [sys.executable, str(script), "--rounds", str(rounds), "--before", "--isa", isa], env=env, cwd=ROOT
    ).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1b,0.3b")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reload", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--cnn", action="store_true", help="the CNN row instead: ResNet-50, export route")
    parser.add_argument("--cnn-rounds", type=int, default=11, help="interleaved rounds of the CNN row")
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    if not (args.child or args.reload):
        rc = cpu_isa.run_in_child(args.isa, __file__, argv)
        if rc is not None:
            return rc
    if args.cnn:
        return cnn_row(args.cnn_rounds, args.isa)
    if args.reload:
        reload(Path(args.reload))
        return 0
    if args.child:
        with tempfile.TemporaryDirectory() as workdir:
            child(args.child, args.out, Path(workdir), args.isa)
        return 0
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            env = {**os.environ, "FX_REWRITES_IREE_CACHE": "off"}  # every step from scratch
            proc = subprocess.run(
                [sys.executable, __file__, "--child", size, "--out", str(out), "--isa", args.isa],
                env=env,
                check=False,
                cwd=ROOT,
            )
            row = json.loads(out.read_text()) if out.is_file() else {"size": size, "error": f"exit {proc.returncode}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows, args.isa))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
