"""Text generation: prefill latency and decode tokens/s of a Llama-like decoder, per route (issue 26 item 5).

    python benchmarks/generate.py                                  # 0.1B, float and int8, prompt 128, 64 new tokens
    flock /tmp/fx-bigmem.lock python benchmarks/generate.py --sizes 1b --new 16 --no-int8   # ~1.1B (~10 GB)
    python benchmarks/generate.py --sizes tiny --prompt 8 --new 4 --rounds 1 --threads 1   # the smoke test's run

`--sizes mamba2-130m`: a `Mamba2ForCausalLM` of state-spaces/mamba2-130m's shape (24 layers, hidden 768, SSM state
128, chunk 256), its cache a recurrent state: compile_lm prefills the prompt padded to 512 (two chunks).

Models: `LlamaForCausalLM` from a config (0.1B: hidden 768, 12 layers, 12 heads / 4 KV heads, MLP 2048, vocab
32000, ~125M parameters; 1b: TinyLlama-1.1B's shape, hidden 2048, 22 layers, 32 / 4 heads, MLP 5632), seeded
random weights (randn x 0.05, so greedy argmax does not tie), eos off (every route generates all tokens). The
int8 variant is the same model after torchao's `quantize_(model, Int8WeightOnlyConfig())`.

Routes, each greedy from the same prompt:
- `eager dynamic`: transformers' `model.generate(do_sample=False)` with its default DynamicCache;
- `eager static`: the same with a StaticCache of `prompt + new` positions;
- `inductor static`: the same with `model.forward` compiled by `torch.compile` (Inductor), compiled per thread
  setting (Inductor fixes the thread count in its kernels);
- `iree export+loop`: what works today: transformers' `TorchExportableModuleWithStaticCache` exported (strict) with a
  Dim on the sequence, `fx_rewrites.compile`, one call for the prompt, one per new token, argmax on the host. The
  cache buffers are passed in and out at each call (`state="host"`); `--state module` keeps them in the module as
  mutable IREE globals (`backends/iree/state.py`; see STATE);
- `iree compile_lm`: `fx_rewrites.compile_lm(model, max_cache_len=...).generate(...)`: one module, prefill and decode
  over shared weights, the cache kept in the module.

Prefill = the time of a generate with 1 new token; decode tokens/s = (N - 1) / (time(N new) - time(1 new)).
`--threads 1`: torch.set_num_threads(1), IREE local-sync, CPU time of the process (time.process_time);
`default`: torch's default threads, IREE local-task, wall time. Routes are timed in turn, round after round,
medians. `match` says whether the route's tokens equal `eager dynamic`'s (of the same model). `--isa` picks the vector
ISA measured (benchmarks/cpu_isa.py: IREE's llvm-cpu target for it, torch held to its width).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_isa  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    # a recurrent state instead of a KV cache: state-spaces/mamba2-130m's shape (Mamba2Config)
    "mamba2-130m": dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, expand=2, state_size=128,
                        n_groups=1, conv_kernel=4, chunk_size=256, vocab_size=50288),
}  # fmt: skip
STRICT = True  # non-strict export lifts the cache as constants written in place (issue 26)
Generate = Callable[[torch.Tensor, int], torch.Tensor]  # (prompt ids, new tokens) -> the new tokens


def transformers_module() -> Any:
    sys.path.insert(0, str(ROOT))
    from benchmarks.runtime_models import _tf  # transformers importable on CPU torch with PyPI's torchvision

    return _tf()


def build(size: str, max_len: int) -> torch.nn.Module:
    """The seeded random Llama (or Mamba2, for a `mamba2-*` size) of `size` (eval, float32)."""
    tf = transformers_module()
    torch.manual_seed(0)
    if size.startswith("mamba2"):
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(**SIZES[size], tie_word_embeddings=False)).eval()
    else:
        config = tf.LlamaConfig(**SIZES[size], max_position_embeddings=max(max_len, 256), tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(config).eval()
    return seeded_for_greedy(model)


def seeded_for_greedy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every matrix drawn again as randn x 0.05 (seed 0; transformers' 0.02 init leaves greedy
    argmax near ties) and eos off (every route generates all tokens), pad 0; in place, returned."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def quantized(model: torch.nn.Module) -> torch.nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    out = copy.deepcopy(model)
    quantize_(out, Int8WeightOnlyConfig())
    return out


def hf_generate(model: torch.nn.Module, *, static: bool, max_len: int) -> Generate:
    tf = transformers_module()

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if static:  # a fresh cache of a fixed length: the same shapes whatever n is
            accepted = inspect.signature(model.forward).parameters
            name = "cache_params" if "cache_params" in accepted else "past_key_values"  # Mamba2: cache_params
            kwargs[name] = tf.StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                disable_compile=True, **kwargs,
            )  # fmt: skip
        return out[:, ids.shape[1] :]

    return run


def inductor_generate(model: torch.nn.Module, max_len: int) -> Generate:
    compiled = copy.copy(model)  # shares the weights; its own forward
    compiled.generation_config = copy.deepcopy(model.generation_config)
    torch._dynamo.reset()
    compiled.forward = torch.compile(model.forward)
    return hf_generate(compiled, static=True, max_len=max_len)


#: where the export+loop route keeps the cache: "host" (passed in and out at each call); "module" (mutable IREE
#: globals) computed this program wrong before main's fix of equal zero-initialised globals sharing one storage
STATE = "host"
#: the vector ISA measured (`--isa`, benchmarks/cpu_isa.py)
ISA = "host"


def iree_backend(threads: str, state: str = "module") -> Any:
    """The `iree` backend for `ISA`: local-sync for one thread, local-task for the default threads."""
    driver = "local-sync" if threads == "1" else cpu_isa.target(ISA).driver
    return cpu_isa.backend(ISA, driver=driver, state=state)


def iree_loop_generate(model: torch.nn.Module, max_len: int, threads: str, prompt: torch.Tensor) -> Generate:
    """Export with transformers' static-cache wrapper (Dim on the sequence), compile, a greedy loop in Python."""
    import fx_rewrites

    tf = transformers_module()
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    try:
        wrapper = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_len)
    finally:
        model.generation_config = saved
    seq = torch.export.Dim("seq", min=1, max=max_len)
    kwargs = {"input_ids": prompt, "cache_position": torch.arange(prompt.shape[1])}
    del tf
    with torch.no_grad():
        program = torch.export.export(
            wrapper, (), kwargs, dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}}, strict=STRICT
        )
    compiled = fx_rewrites.compile(program, backend=iree_backend(threads, STATE))

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        length = ids.shape[1]
        logits = compiled(input_ids=ids, cache_position=torch.arange(length))
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = [token]
        for i in range(n - 1):
            logits = compiled(input_ids=token, cache_position=torch.tensor([length + i]))
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        return torch.cat(out, 1)

    return run


def compile_lm_generate(model: torch.nn.Module, max_len: int, threads: str) -> Generate | str:
    import fx_rewrites

    # a recurrent state's prefill takes the prompt padded to a multiple of the scan's chunk, two at least
    chunk = getattr(model.config, "chunk_size", 0) if "Mamba" in type(model).__name__ else 0
    lm = fx_rewrites.compile_lm(model, max_cache_len=max(max_len, 2 * chunk), backend=iree_backend(threads))
    return lambda ids, n: lm.generate(ids, max_new_tokens=n)[:, ids.shape[1] :]


def routes(model: torch.nn.Module, max_len: int, threads: str, prompt: torch.Tensor, wanted: set[str]) -> dict:
    makers: dict[str, Callable[[], Generate | str]] = {
        "eager dynamic": lambda: hf_generate(model, static=False, max_len=max_len),
        "eager static": lambda: hf_generate(model, static=True, max_len=max_len),
        "inductor static": lambda: inductor_generate(model, max_len),
        "iree export+loop": lambda: iree_loop_generate(model, max_len, threads, prompt),
        "iree compile_lm": lambda: compile_lm_generate(model, max_len, threads),
    }
    out: dict[str, Generate | str] = {}
    for name, make in makers.items():
        if name not in wanted:
            continue
        start = time.perf_counter()
        try:
            out[name] = make()
        except Exception as e:  # a route that fails is a row that says why, not a lost table
            out[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        print(f"  [{name}, threads {threads}] ready in {time.perf_counter() - start:.0f} s wall", flush=True)
    return out


def measure(gens: dict, prompt: torch.Tensor, new: int, rounds: int, threads: str) -> dict[str, Any]:
    clock = time.process_time if threads == "1" else time.perf_counter
    reference = None
    results: dict[str, Any] = {}
    tokens: dict[str, torch.Tensor] = {}
    for name, gen in gens.items():
        if isinstance(gen, str):
            results[name] = gen
            continue
        try:
            tokens[name] = gen(prompt, new)  # warm-up (Inductor and the IREE module compile or load here)
        except Exception as e:
            results[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    reference = tokens.get("eager dynamic")
    times: dict[str, dict[int, list[float]]] = {name: {1: [], new: []} for name in tokens}
    for _ in range(rounds):
        for name in tokens:
            for n in (1, new):
                start = clock()
                gens[name](prompt, n)
                times[name][n].append(clock() - start)
    for name, got in tokens.items():
        first, full = statistics.median(times[name][1]), statistics.median(times[name][new])
        match = "-" if reference is None else ("yes" if torch.equal(got, reference) else "NO")
        rate = (new - 1) / (full - first) if full > first else float("nan")
        results[name] = (first * 1e3, rate, match)
    return results


def row(model_name: str, name: str, threads: str, value: Any) -> str:
    clock = "CPU" if threads == "1" else "wall"
    if isinstance(value, str):
        return f"| {model_name} | {name} | {threads} ({clock}) | - | - | {value} |"
    return f"| {model_name} | {name} | {threads} ({clock}) | {value[0]:.1f} | {value[1]:.2f} | {value[2]} |"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    global STATE, ISA
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["0.1b"], choices=sorted(SIZES))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", nargs="+", default=["1", "default"], choices=["1", "default"])
    parser.add_argument("--routes", nargs="+", default=None, help="default: all")
    parser.add_argument("--state", default=STATE, choices=["host", "module"], help="the export+loop route's cache")
    parser.add_argument("--no-int8", action="store_true", help="skip the torchao int8 weight-only variant")
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    rc = cpu_isa.run_in_child(args.isa, __file__, argv)
    if rc is not None:
        return rc
    STATE, ISA = args.state, args.isa
    wanted = set(args.routes or ["eager dynamic", "eager static", "inductor static", "iree export+loop",
                                 "iree compile_lm"])  # fmt: skip
    default_threads = torch.get_num_threads()
    max_len = args.prompt + args.new
    print(cpu_isa.header(args.isa))
    print(
        f"torch {torch.__version__}, default threads {default_threads}; prompt {args.prompt}, new {args.new}, "
        f"rounds {args.rounds}; load average {load()}"
    )
    rows = []
    prompt = torch.randint(0, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    for size in args.sizes:
        model = build(size, max_len)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        variants = [("float32", model)] if args.no_int8 else [("float32", model), ("int8 wo", quantized(model))]
        for kind, m in variants:
            for threads in args.threads:
                torch.set_num_threads(1 if threads == "1" else default_threads)
                gens = routes(m, max_len, threads, prompt, wanted)
                for name, value in measure(gens, prompt, args.new, args.rounds, threads).items():
                    rows.append((f"{size} ({params:.0f}M) {kind}", name, threads, value))
                    print("  " + row(*rows[-1]), flush=True)  # as measured: a later failure loses nothing
                del gens
        del model, variants
    print("\n| model | route | threads | prefill ms | decode tokens/s | tokens = eager |")
    print("|---|---|---|---:|---:|---|")
    for line in rows:
        print(row(*line))
    print(f"load average at the end: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
