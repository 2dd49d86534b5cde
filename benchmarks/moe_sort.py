"""MoE through compile_lm at real prompt lengths: prefill, decode, peak memory against eager (issue 34).

    python benchmarks/moe_sort.py                                    # 16 and 64 experts, top 2 and 8, 128/512/2048
    python benchmarks/moe_sort.py --experts 64 --top 8 --prompts 512 2048 --decode 32 --interleave
    python benchmarks/moe_sort.py --shape qwen3-30b-a3b --prompts 1024 --decode 16   # one layer at 30B-A3B's sizes
    python benchmarks/moe_sort.py --isa avx2 ...                     # AVX2 on an AVX-512 host (see below)
    python benchmarks/moe_sort.py --micro                            # the experts' sort alone, ranks vs counting

Model (`--shape small`, the default): `Qwen3MoeForCausalLM` from a config (hidden 512, 4 layers, 8 heads / 4 KV
heads, every layer sparse, moe_intermediate 256, vocab 4096); `--shape qwen3-30b-a3b`: one layer at
Qwen3-30B-A3B's sizes (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts, top 8, moe_intermediate 768),
vocab 4096. Seeded random weights (randn x 0.05), transformers' default experts path (`grouped_mm`: each layer
sorts its tokens x top_k expert ids; `--impl batched_mm`: no sort). Routes, one child process per (config,
route), or all of a config's in one child, interleaved (`--interleave`):
- `counting` / `ranks`: `fx_rewrites.compile_lm(model, max_cache_len=max prompt + decode + 1)` on IREE
  local-sync (the prefill one function with a Dim on the sequence; the experts as backends/iree/rules/moe.py
  writes them), the experts' sorts as counting sorts (the rules as they are) or as ranks
  (`counting_sort_for_iree` left out); `whole-attention`: the rules with `attention_by_key_blocks` left out
  (the prefill's attention over the whole cache as one matmul, softmax, matmul: the form before that rule);
  `no-flash`: the rules with the ISA's `attention_as_flash_dispatch[_avx512]` left out (the attention as before);
  `no-grouped`: the rules with `grouped_mm_packed_as_dispatch_for_iree[_avx2]` left out (AVX-512's prefill experts
  per expert, `packed_matmul` each, as before that rule; AVX2's experts as moe.py writes them, as main had them);
  `no-hoist`: the default rules, compiled with `--iree-opt-const-expr-hoisting=false` (the data-tiling packs of
  the weights run in each call instead of once at load into copies the module keeps); `min-peak-memory`: the default
  rules, compiled with `--iree-stream-partitioning-favor=min-peak-memory`; `peel`: the default rules, compiled with
  `--iree-llvmcpu-vector-pproc-strategy=peel` (what AVX2's dynamic modules get, `IreeTarget.dynamic_flags`: timed
  on AVX-512, where it is not added); `replaced`: the default rules with
  the rule of `--replace-rule FILE:NAME` (a module file, e.g. an earlier commit's: `git show REV:PATH > FILE`)
  in place of the rule of that name (a before/after of one rule in one process, with `--interleave`);
- `saved:PATH.vmfb`: a `compile_lm` module saved before (`lm.save(PATH.vmfb, params=PATH.irpa)`) of the same model
  and cache length, loaded (`fx_rewrites.load`, weights from the .irpa): modules compiled with other flags, timed
  against eager in one process without compiling in it;
- `eager`: transformers' `model.generate(do_sample=False)` (DynamicCache).
`--chunks C ...`: each IREE route once per prefill chunk size C (`generate(prefill_chunk_size=C)`: a prompt longer
than C prefilled in calls of C tokens, the last overlapping the one before; 0 = the whole prompt in one call), named
`ROUTE/C`; the compiled module is shared between a route's chunk sizes in one child.
One generate of 1 + `--decode N` tokens a round, its steps clocked by a streamer (`StepClock`: the CPU time
at each token it receives): prefill = the time to the first token, decode = each later token's step (the
module's call and the host's choice of the token); tokens/s = 1 / the median step over all rounds' steps, with
the steps' 10th-90th percentiles and each round's own tokens/s (the spread). One thread each
(torch.set_num_threads(1), IREE local-sync), CPU time (time.process_time), prompts interleaved round after round,
medians; round 0 warms up. Peak RSS: the
process's high-water mark reset (/proc/self/clear_refs) before a prompt's warm-up calls and read after them
(the compile's peak is not counted; per route only without `--interleave`); `resident_before_mb`: the resident
set at that reset (what the calls add is the peak less it). Every route's tokens are printed
(a route whose tokens differ from eager's says so).
`--isa avx2`: the children run torch held to AVX2 and IREE compiled for the AVX2 target, as `benchmarks/cpu_isa.py`
does it (znver3 without AMD's SSE4a, `cpu_isa.AVX2_ENV`; the child checks torch's capability), the way an AVX2
machine runs both.
`--allocator`: the children's IREE CPU device's allocator (`FX_REWRITES_IREE_ALLOCATOR`, backends/iree/allocators.py):
`bounded` (the default: IREE's caching allocator with a capacity, over glibc's heap keeping freed blocks), `caching`
(unbounded: it keeps every transient size it has seen) or `heap` (IREE's default allocator over that heap); glibc's
setting is process-wide, so with `--interleave` eager's tensors come from that heap too.
`--micro`: two layers' expert-id sorts alone (topk of [T, E] router probabilities, then the sort of the flattened
ids), rewritten by the IREE rules and compiled with a Dim on T: the sort's own cost per prompt, ranks vs counting.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cpu_isa  # noqa: E402
from benchmarks.cpu_isa import AVX2_ENV  # noqa: E402  (--isa avx2: what the children run with; moe_block.py too)


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_mb(field: str = "VmHWM") -> float:
    """The process's resident-set high-water mark (`VmRSS`: its resident set now), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


#: model sizes: keyword arguments of Qwen3MoeConfig besides the experts
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1024, moe_intermediate_size=256),
    # Qwen3-30B-A3B's layer (config.json of Qwen/Qwen3-30B-A3B), one of them
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768),
}  # fmt: skip


def build(experts: int, top: int, max_len: int, impl: str = "grouped_mm", shape: str = "small") -> Any:
    sys.path.insert(0, str(ROOT))
    from benchmarks.generate import seeded_for_greedy
    from benchmarks.runtime_models import _tf

    tf = _tf()
    config = tf.Qwen3MoeConfig(
        vocab_size=4096, **SHAPES[shape], num_experts=experts, num_experts_per_tok=top, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=max(max_len, 256),
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    config._experts_implementation = impl
    torch.manual_seed(0)
    return seeded_for_greedy(tf.Qwen3MoeForCausalLM(config).eval())


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(1, 4096, (1, length), generator=torch.Generator().manual_seed(length))


def _replaced(rules: Any, spec: str) -> Any:
    """`rules` with the rule `NAME` of the module file `FILE` (`spec` "FILE:NAME") in place of theirs of that name."""
    import importlib.util

    from fx_rewrites import Phases, RuleSet

    path, name = spec.rsplit(":", 1)
    loaded = importlib.util.spec_from_file_location(f"replaced_{name}", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    new = getattr(module, name, None)
    if new is None:
        raise SystemExit(f"--replace-rule {spec}: {path} defines no {name!r}")
    sets = [RuleSet([new if r.name == name else r for r in s], name=s.name) for s in rules.sets]
    if not any(r is new for s in sets for r in s):
        raise SystemExit(f"--replace-rule {spec}: no rule named {name!r} in the backend's rules")
    return Phases(*sets, name=rules.name)


#: the flash dispatch's rules for a masked Dim prefill (AVX-512's, AVX2's)
FLASH = ("attention_as_flash_dispatch_avx512", "attention_as_flash_dispatch")
#: the grouped experts dispatch's rules (AVX-512's, AVX2's)
GROUPED = ("grouped_mm_packed_as_dispatch_for_iree", "grouped_mm_packed_as_dispatch_for_iree_avx2")


def _present(rules: Any, *names: str) -> list[str]:
    """Those of `names` that `rules` holds (each ISA holds its own flash dispatch rule)."""
    return [name for name in names if name in rules]


def iree_backend(sort: str, isa: str = "host", replace: str | None = None) -> Any:
    """IREE local-sync with the experts' sort as a counting sort (`counting`, the default rules) or as ranks
    (`ranks`: the counting sort left out, as before it existed); `isa` avx2: `cpu_isa`'s AVX2 target (znver3
    without SSE4a: with it LLVM emits AMD's `insertq`, and the module died of SIGILL on this Intel host)."""
    from fx_rewrites.backends.iree import IreeBackend

    backend = cpu_isa.backend("avx2", driver="local-sync") if isa == "avx2" else IreeBackend(driver="local-sync")
    flags = backend.flags
    rules = backend.rules.without("counting_sort_for_iree") if sort == "ranks" else backend.rules
    if sort == "whole-attention":  # the rules before attention_by_key_blocks (and the flash dispatch)
        rules = backend.rules.without(*_present(backend.rules, "attention_by_key_blocks", *FLASH))
    if sort == "no-flash":  # the rules before the flash dispatch (attention_as_flash_dispatch[_avx512])
        rules = backend.rules.without(*_present(backend.rules, *FLASH))
    if sort == "no-grouped":  # the rules before the grouped experts dispatch (AVX-512 and AVX2 first rules)
        rules = backend.rules.without(*_present(backend.rules, *GROUPED))
    if sort == "replaced":
        if not replace:
            raise SystemExit("the route `replaced` needs --replace-rule FILE:NAME")
        rules = _replaced(backend.rules, replace)
    extra = {"no-hoist": ("--iree-opt-const-expr-hoisting=false",),
             "min-peak-memory": ("--iree-stream-partitioning-favor=min-peak-memory",),
             "peel": ("--iree-llvmcpu-vector-pproc-strategy=peel",)}  # fmt: skip
    perf = (*backend.perf_flags, *extra.get(sort, ()))
    return attrs.evolve(backend, rules=rules, flags=flags, perf_flags=perf)


def _runner(route: str, model: Any, max_len: int, isa: str, replace: str | None = None, lms: Any = None) -> Any:
    """(ids, n) -> ids and n new tokens, by `route`: eager generate, or compile_lm with the sort as `route`
    (`ROUTE/C`: its prompt prefilled in chunks of C; `lms`: the modules compiled so far, by route)."""
    if route.startswith("saved:"):  # a module saved before (`CompiledLM.save`): loaded, its weights from its .irpa
        import fx_rewrites

        saved = fx_rewrites.load(route.partition(":")[2], driver="local-sync")
        return lambda ids, n, clock=None: saved.generate(ids, max_new_tokens=n, streamer=clock)
    base, _, chunk = route.partition("/")
    if base != "eager" and lms is not None:
        if base not in lms:
            lms[base] = _runner(base, model, max_len, isa, replace)
        lm = lms[base].lm
        size = int(chunk) if chunk and int(chunk) > 0 else None
        return lambda ids, n, clock=None: lm.generate(ids, max_new_tokens=n, streamer=clock, prefill_chunk_size=size)
    if route == "eager":

        def run(ids: torch.Tensor, n: int, clock: StepClock | None = None) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    do_sample=False,
                    disable_compile=True,
                    streamer=clock,
                )

        return run
    import fx_rewrites

    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=iree_backend(route, isa, replace))
    fired = {
        f"{name}:{k}": v
        for name, report in lm.reports.items()
        for k, v in report.rewrites.items()
        if any(word in k for word in ("sort", "grouped", "attention"))
    }
    print(json.dumps({"route": route, "compile_s": round(time.perf_counter() - start, 1), "fired": fired}), flush=True)

    def run(ids: torch.Tensor, n: int, clock: StepClock | None = None) -> torch.Tensor:
        return lm.generate(ids, max_new_tokens=n, streamer=clock)

    run.lm = lm  # type: ignore[attr-defined]
    return run


def child(args: argparse.Namespace) -> None:
    """Every route of `args.routes` on one model, interleaved: round after round, prompt after prompt."""
    torch.set_num_threads(1)
    cpu_isa.check(args.isa)  # torch at the ISA's width (the child's environment took)
    max_len = max(args.prompts) + args.decode + 1
    model = build(args.experts[0], args.top[0], max_len, args.impl, args.shape)
    lms: dict[str, Any] = {}
    runs = {route: _runner(route, model, max_len, args.isa, args.replace_rule, lms) for route in args.routes}
    cases = [(route, p) for p in args.prompts for route in args.routes]
    prefill: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    decode: dict[tuple[str, int], list[list[float]]] = {case: [] for case in cases}
    peaks: dict[tuple[str, int], float] = {}
    resident: dict[tuple[str, int], float] = {}  # the resident set at the reset: the calls add what is above it
    tokens: dict[tuple[str, int], list[int]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (and measures the peak)
        for route, p in cases:
            ids = _prompt(p)
            if r == 0:
                _hwm_reset()
                resident[route, p] = _hwm_mb("VmRSS")
            clock = StepClock()
            start = time.process_time()
            out = runs[route](ids, 1 + args.decode, clock)
            if r == 0:
                peaks[route, p] = _hwm_mb()
                tokens[route, p] = out[0, p:].tolist()
            else:
                prefill[route, p].append(clock.times[0] - start)
                decode[route, p].append(clock.steps())
    for route, p in cases:
        row: dict[str, Any] = {"route": route, "prompt": p}  # --rounds 0: the warm-up only (a compile cache filled)
        if prefill[route, p]:
            row["ms"] = round(1e3 * statistics.median(prefill[route, p]), 1)
        row["prefill_ms_rounds"] = [round(1e3 * t) for t in prefill[route, p]]
        if args.decode and decode[route, p]:
            steps = sorted(itertools.chain.from_iterable(decode[route, p]))
            deciles = statistics.quantiles(steps, n=10) if len(steps) > 1 else steps * 9
            row["decode_tok_s"] = round(1 / statistics.median(steps), 2)
            spread = (deciles[0], statistics.median(steps), deciles[-1])
            row["step_ms_p10_p50_p90"] = [round(1e3 * t, 1) for t in spread]
            row["decode_tok_s_rounds"] = [round(len(s) / sum(s), 2) for s in decode[route, p]]
        same = tokens[route, p] == tokens.get(("eager", p), tokens[route, p])
        row |= {"peak_mb": round(peaks[route, p]), "resident_before_mb": round(resident[route, p])}
        row |= {"tokens_equal_eager": same, "tokens": tokens[route, p][:8]}
        print(json.dumps(row), flush=True)


class StepClock:
    """A streamer (transformers' `BaseStreamer` protocol: `put`, `end`) that keeps the CPU time at which each
    new token arrives; the prompt's `put` (first) is not a token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.process_time())

    def end(self) -> None:
        pass

    def steps(self) -> list[float]:
        """Each decode step's CPU seconds: between consecutive tokens."""
        return [b - a for a, b in itertools.pairwise(self.times)]


class _Sorts(torch.nn.Module):
    """Two layers' routing: the top k of E router probabilities per token, the flattened ids sorted."""

    def __init__(self, top: int) -> None:
        super().__init__()
        self.top = top

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for logits in (x, y):
            ids = torch.topk(torch.softmax(logits, -1), self.top, dim=-1).indices.reshape(-1)
            out.extend(torch.sort(ids))
        return tuple(out)


def micro(args: argparse.Namespace) -> None:
    import fx_rewrites
    from fx_rewrites import testing as rt

    torch.set_num_threads(1)
    for experts, top, sort in itertools.product(args.experts, args.top, ("ranks", "counting")):
        backend = iree_backend(sort)
        g = torch.Generator().manual_seed(0)
        inputs = {p: (torch.randn(p, experts, generator=g), torch.randn(p, experts, generator=g)) for p in args.prompts}
        tokens = torch.export.Dim("tokens", min=2, max=max(args.prompts))
        ep = rt.export(_Sorts(top), *inputs[args.prompts[0]], dynamic_shapes=({0: tokens}, {0: tokens}))
        result = fx_rewrites.apply(ep, backend.rules)
        compiled = backend.compile(result.program, inputs[args.prompts[0]])
        fired = {k: v for k, v in result.report.rewrites.items() if "sort" in k or "topk" in k}
        for p in args.prompts:
            expected = _Sorts(top)(*inputs[p])
            got = compiled(*inputs[p])
            equal = all(torch.equal(a, b) for a, b in zip(got[::2], expected[::2], strict=True))
            _hwm_reset()
            compiled(*inputs[p])
            peak = _hwm_mb()
            times = []
            for _ in range(args.rounds):
                start = time.process_time()
                compiled(*inputs[p])
                times.append(time.process_time() - start)
            row = {"experts": experts, "top": top, "sort": sort, "prompt": p, "n": p * top, "fired": fired}
            print(json.dumps({**row, "ms": round(1e3 * statistics.median(times), 2), "peak_mb": round(peak),
                              "values_equal": equal}), flush=True)  # fmt: skip


ROUTES = (
    "counting",
    "ranks",
    "whole-attention",
    "no-flash",
    "no-grouped",
    "no-hoist",
    "min-peak-memory",
    "peel",
    "replaced",
    "eager",
)


def _route(text: str) -> str:
    """A route name, or `ROUTE/C` (the children's: an IREE route with prefill chunks of C)."""
    if text.startswith("saved:") and len(text) > len("saved:"):
        return text
    base, _, chunk = text.partition("/")
    if base not in ROUTES or (chunk and (base == "eager" or not chunk.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(ROUTES)}, or ROUTE/CHUNK for an IREE route")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--top", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument(
        "--routes",
        nargs="+",
        type=_route,
        default=["counting", "eager"],
    )
    parser.add_argument("--chunks", type=int, nargs="+", help="prefill chunk sizes for the IREE routes (0: whole)")
    parser.add_argument("--impl", default="grouped_mm", help="config._experts_implementation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--interleave", action="store_true", help="all routes in one child, interleaved")
    parser.add_argument("--decode", type=int, default=0, help="new tokens after the first: decode tokens/s")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--isa", choices=["host", "avx2"], default="host")
    parser.add_argument("--replace-rule", help="FILE:NAME, the rule the route `replaced` uses in place of NAME")
    parser.add_argument(
        "--allocator",
        choices=["bounded", "caching", "heap"],
        default="bounded",
        help="the IREE CPU device's allocator (FX_REWRITES_IREE_ALLOCATOR in the children)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunks and not args.child:
        if any(c != 0 and c < 2 for c in args.chunks):
            parser.error(f"--chunks {args.chunks}: each 0 (the whole prompt) or at least 2")
        chunked = [f"{r}/{c}" for r in args.routes if r != "eager" for c in args.chunks]
        args.routes = chunked + [r for r in args.routes if r == "eager"]
    if args.child:
        return child(args)
    if args.micro:
        return micro(args)
    print(f"# {cpu_isa.cpu_model()}, isa {args.isa}, allocator {args.allocator}, load {os.getloadavg()[0]:.2f}")
    env = {**os.environ, **(AVX2_ENV if args.isa == "avx2" else {}), "FX_REWRITES_IREE_ALLOCATOR": args.allocator}
    for experts in args.experts:
        for top in args.top:
            for routes in [args.routes] if args.interleave else [[route] for route in args.routes]:
                command = [sys.executable, __file__, "--child", "--experts", str(experts), "--top", str(top),
                           "--routes", *routes, "--impl", args.impl, "--rounds", str(args.rounds),
                           "--decode", str(args.decode), "--shape", args.shape, "--isa", args.isa,
                           "--prompts", *map(str, args.prompts),
                           *(["--replace-rule", args.replace_rule] if args.replace_rule else [])]  # fmt: skip
                out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
                if out.returncode:
                    print(f"# {experts} experts top {top} {routes}: exit {out.returncode}\n{out.stderr[-3000:]}")
                for line in out.stdout.splitlines():
                    print(json.dumps({"experts": experts, "top": top, **json.loads(line)}), flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
