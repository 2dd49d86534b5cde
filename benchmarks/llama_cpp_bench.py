"""llama.cpp beside the quantized routes: the same seeded model as F32, Q8_0 and Q4_0 GGUF through `llama-bench -t 1`.

Used by benchmarks/quantized.py (`--llama-cpp`); needs a llama.cpp build (`LLAMA_CPP_DIR` or `--llama-cpp-dir`, e.g.
the one `llama-cpp-python`'s sdist builds) and its `convert_hf_to_gguf.py`. Decode rate: CPU time of the child
(two runs, 1 and `new + 1` tokens, subtracted: loading and the prompt alike).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

#: llama-bench's repetitions per run
REPEATS = 3


def llama_cpp_paths(build_dir: str | None, src: str | None) -> tuple[Path, Path, Path] | str:
    """(llama-bench, llama-quantize, convert_hf_to_gguf.py), or why not."""
    if not build_dir:
        return "no llama.cpp build (set LLAMA_CPP_DIR or --llama-cpp-dir)"
    build = Path(build_dir)
    bench, quant = build / "bin" / "llama-bench", build / "bin" / "llama-quantize"
    roots = [Path(src)] if src else [build.parent, build, *build.parent.glob("*/vendor/llama.cpp")]
    convert = next((r / "convert_hf_to_gguf.py" for r in roots if (r / "convert_hf_to_gguf.py").exists()), None)
    if not bench.exists() or not quant.exists():
        return f"no llama-bench / llama-quantize in {build / 'bin'}"
    if convert is None:
        return "no convert_hf_to_gguf.py (give --llama-cpp-src, llama.cpp's source tree)"
    return bench, quant, convert


#: run by `convert_hf_to_gguf.py`'s interpreter: its Llama converter with a synthetic vocabulary (no tokenizer)
_CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[1]) / "gguf-py"))
import convert_hf_to_gguf as c
def vocab(self):
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("llama")
    self.gguf_writer.add_token_list([f"<t{i}>".encode() for i in range(n)])
    self.gguf_writer.add_token_scores([0.0] * n)
    self.gguf_writer.add_token_types([1] * n)
    self.gguf_writer.add_bos_token_id(1)
    self.gguf_writer.add_eos_token_id(2)
try:
    from conversion.llama import LlamaModel  # llama.cpp's converter split into modules (2026)
except ImportError:
    LlamaModel = c.LlamaModel
LlamaModel.set_vocab = vocab
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
c.main()
"""


def llama_repacks(choice: str) -> list[str]:
    """llama-bench's `--repack` values for `--llama-repack`: `auto` is 0 where the CPU reports AMX, else 1."""
    from fx_rewrites.backends.iree.targets import cpu_flags

    if choice != "auto":
        return choice.split(",")
    return ["0" if "amx_tile" in cpu_flags() else "1"]


def llama_cpp(
    model: torch.nn.Module, paths: tuple[Path, Path, Path], prompt: int, new: int, repacks: list[str] | None = None
) -> dict[str, Any]:
    """llama-bench -t 1 of the model as F32, Q8_0 and Q4_0 GGUF: name -> (prefill ms, decode tokens/s, MB, wall
    tokens/s); with more than one of `repacks` (llama-bench's `--repack`), a row for each, named `KIND repack R`."""
    repacks = repacks or ["0"]
    bench, quant, convert = paths
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf, f32 = Path(tmp) / "hf", Path(tmp) / "f32.gguf"
        model.save_pretrained(hf, safe_serialization=True)
        run = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(convert.parent), str(hf), str(f32)], capture_output=True, text=True
        )
        if run.returncode:
            return {"llama.cpp": f"convert_hf_to_gguf failed: {run.stderr.strip().splitlines()[-1:]}"}
        files = {"F32": f32}
        for kind in ("Q8_0", "Q4_0"):
            files[kind] = Path(tmp) / f"{kind}.gguf"
            subprocess.run([str(quant), str(f32), str(files[kind]), kind], capture_output=True, check=True)
        for (kind, path), repack in ((f, r) for f in files.items() for r in repacks):
            common = [str(bench), "-m", str(path), "-t", "1", "-p", str(prompt), "-r", str(REPEATS), "--repack", repack]
            name = kind if len(repacks) == 1 else f"{kind} repack {repack}"
            cpu, rows = {}, []
            for n in (1, new + 1):  # decode CPU time: the difference of two runs, loading and prompt alike
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                res = subprocess.run([*common, "-n", str(n), "-o", "json"], capture_output=True, text=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[n] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                if res.returncode:
                    break
                rows = json.loads(res.stdout)
            if res.returncode:
                out[name] = f"llama-bench failed: {res.stderr.strip()[-200:]}"
                continue
            pp = next(r for r in rows if r["n_prompt"] > 0)
            tg = next(r for r in rows if r["n_gen"] > 0)
            cpu_rate = REPEATS * new / (cpu[new + 1] - cpu[1]) if cpu[new + 1] > cpu[1] else float("nan")
            out[name] = (prompt / pp["avg_ts"] * 1e3, cpu_rate, path.stat().st_size / 1e6, tg["avg_ts"])
    return out
